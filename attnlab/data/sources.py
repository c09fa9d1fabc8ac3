"""Open a text dataset with Hugging Face ``datasets``: local files, folders, globs, or hub datasets."""

from __future__ import annotations

import glob
import os

from datasets import load_dataset

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text", ".md": "text"}


def _builder_for(path: str) -> str | None:
    name = path[:-3] if path.endswith(".gz") else path
    return _BUILDERS.get(os.path.splitext(name)[1])


def resolve_files(spec: str, key: str) -> tuple[str, list[str]]:
    """Expand a file, folder or glob into (builder, sorted files); fail naming ``key`` when nothing is found."""
    if os.path.isdir(spec):
        files = sorted(p for p in glob.glob(os.path.join(spec, "**", "*"), recursive=True)
                       if os.path.isfile(p) and _builder_for(p))
    elif any(c in spec for c in "*?["):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
    elif os.path.isfile(spec):
        files = [spec]
    else:
        raise ValueError(f"{key}={spec!r}: no such file, folder or glob match")
    if not files:
        raise ValueError(f"{key}={spec!r}: no data files found ({SUPPORTED})")
    builders = {_builder_for(f) for f in files}
    if None in builders:
        other = next(f for f in files if _builder_for(f) is None)
        raise ValueError(f"{key}={spec!r}: {other} is not a supported format; {SUPPORTED}")
    if len(builders) > 1:
        raise ValueError(f"{key}={spec!r}: files must all be of one format ({SUPPORTED}); got {files[:5]}")
    return builders.pop(), files


SUPPORTED = ("supported: .jsonl/.json (JSON Lines, or one array of records), .parquet, .txt/.text/.md (one document "
             "per file), each optionally .gz; convert other formats (e.g. .csv) to one of these")


def check_files(spec: str, key: str, text_field: str) -> None:
    """What preflight checks of local data without reading it: the files exist and have a supported format
    (:func:`resolve_files`), and every parquet file's schema has the ``text_field`` column (its footer only).
    JSON and text records are scanned when the loader opens them (:func:`scan_files`), still before step 1. A
    path that matches nothing is left to the loader, which names it then: a configuration may be checked where
    its data is not mounted."""
    if not (os.path.exists(spec) or glob.glob(spec, recursive=True)):
        return
    builder, files = resolve_files(spec, key)
    if builder != "parquet":
        return
    import pyarrow.parquet as pq

    for path in files:
        try:
            columns = pq.read_schema(path).names
        except Exception as e:  # not a parquet file, truncated footer
            raise ValueError(f"{key}={spec!r}: {path}: cannot read its parquet schema ({type(e).__name__}: {e})") \
                from None
        if text_field not in columns:
            raise ValueError(f"{key}={spec!r}: {path} has no column {text_field!r} (data.text_field); its columns "
                             f"are {columns[:8]}")


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hugging Face Hub answers one HEAD request, through huggingface_hub's own HTTP session (its
    endpoint, proxies and offline mode apply)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception:  # no network, DNS failure, proxy refusal, offline mode: the Hub cannot be used
        return False
    return True


def check_hub(spec: str, key: str, streaming: bool | None) -> None:
    """A hub dataset can be read: the Hub answers (one request of at most 5 s, instead of ``datasets``' retries for
    half a minute), or ``HF_HUB_OFFLINE`` is set and the dataset is not streamed (then ``datasets`` reads a copy
    in its cache, and names it when there is none)."""
    import datasets.config
    from huggingface_hub import constants

    cached = ("for a copy already in the datasets cache ($HF_HOME, default ~/.cache/huggingface) set "
              "HF_HUB_OFFLINE=1 and data.streaming = false")
    if datasets.config.HF_HUB_OFFLINE or constants.HF_HUB_OFFLINE:
        if streaming is not False:
            raise ValueError(f"{key}={spec!r}: HF_HUB_OFFLINE is set, and a hub dataset is streamed from the Hub "
                             "(data.streaming); set data.streaming = false to read a copy already in the datasets "
                             "cache, or use local files (training.dataset_path)")
        return
    if not hub_reachable():
        raise ValueError(f"{key}={spec!r}: the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached (no "
                         f"network, or a proxy refuses); use local files (training.dataset_path), or {cached}")


def _open(path: str):
    import gzip

    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


class UnreadableFile(ValueError):
    """A local data file that cannot be read to its end, or not as records (one JSON document, not JSON Lines)."""


def _records(path: str, builder: str, text_field: str):
    """Yield (line number, text or None, reason) for every record of a local text file; ``reason`` says why a
    record is malformed (then text is None). A file that cannot be read to its end (truncated or corrupt gzip)
    raises ValueError naming it."""
    import json
    import zlib

    try:
        with _open(path) as f:
            if builder == "text":  # one document per file
                yield 1, *_decoded(f.read())
                return
            if path.removesuffix(".gz").endswith(".json") and f.peek(1).lstrip()[:1] == b"[":
                text, reason = _decoded(f.read())
                try:
                    rows = json.loads(text) if reason is None else None
                except json.JSONDecodeError as e:
                    reason = f"not valid JSON ({e.msg}, line {e.lineno} column {e.colno})"
                if reason:
                    yield 1, None, reason
                    return
                for i, rec in enumerate(rows if isinstance(rows, list) else [rows]):
                    yield i + 1, *_text_of(rec, text_field)
                return
            at_start = True  # no record read yet: a first line that does not parse may be one JSON document
            for n, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                text, reason = _decoded(raw.rstrip(b"\r\n"))
                if reason is None:
                    try:
                        yield n, *_text_of(json.loads(text), text_field)
                        at_start = False
                        continue
                    except json.JSONDecodeError as e:
                        reason = f"not valid JSON ({e.msg}, column {e.colno})"
                        if at_start and (kind := _one_document(path)):
                            array = " (or a .json file holding one array of records)" if kind == "object" \
                                and path.removesuffix(".gz").endswith(".json") else ""
                            raise UnreadableFile(f"{path} holds one JSON {kind} spread over lines, not JSON Lines "
                                                 "(one object per line, e.g. {\"text\": \"...\"}); write one "
                                                 f"record per line{array}")
                at_start = False
                yield n, None, reason
    except (EOFError, OSError, zlib.error) as e:
        raise UnreadableFile(f"{path}: cannot be read to the end ({type(e).__name__}: {e}); a truncated or "
                             "corrupt file? Replace it or leave it out of the dataset path") from e


def _one_document(path: str) -> str | None:
    """"object" or "array" when the whole file ``path`` is one JSON document (what a JSON Lines file whose first
    line does not parse often is: a pretty-printed object or array), else None."""
    import json

    with _open(path) as f:
        text, reason = _decoded(f.read())
    try:
        doc = json.loads(text) if reason is None else None
    except json.JSONDecodeError:
        return None
    return {dict: "object", list: "array"}.get(type(doc))


def _decoded(raw: bytes) -> tuple[str | None, str | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte {e.start}: {raw[e.start:e.start + 4]!r})"


def _text_of(rec, text_field: str) -> tuple[str | None, str | None]:
    if not isinstance(rec, dict):
        return None, f"not a JSON object ({type(rec).__name__})"
    if text_field not in rec:
        return None, f"no column {text_field!r} (data.text_field) in this record; its keys are {sorted(rec)[:8]}"
    if not isinstance(rec[text_field], str):
        return None, f"{text_field!r} is {type(rec[text_field]).__name__}, not a string"
    return rec[text_field], None


_SCANNED: dict[tuple, int] = {}
"""Successful scans by (files, their size and mtime, builder, text_field, max_bad): the training and the held-out
split of one local dataset open the same files, which are then read once."""


def file_stamps(files: list[str]) -> list[tuple[int, int]]:
    """(size, mtime in ns) of each file: what tells an edited file from the one scanned or cached before."""
    return [(st.st_size, st.st_mtime_ns) for st in map(os.stat, files)]


def scan_files(files: list[str], builder: str, key: str, spec: str, text_field: str, max_bad: int) -> int:
    """Read every record of local text files once, before training: a malformed record (broken JSON, bad
    UTF-8, not an object, no string ``text_field``) or an unreadable file is found here, not mid-training.
    Returns the number of malformed records (<= ``max_bad``, to be skipped); more stops with one message naming
    the file, the line and the keys to change. Costs one pass over the files at start (parquet is not scanned)."""
    memo = (tuple(files), tuple(file_stamps(files)), builder, text_field, max_bad)
    if memo in _SCANNED:
        return _SCANNED[memo]
    bad, good, nonempty, first = 0, 0, 0, None
    for path in files:
        try:
            for line, text, reason in _records(path, builder, text_field):
                if reason is None:
                    good += 1
                    nonempty += bool(text.strip())
                    continue
                bad, first = bad + 1, first or f"{path} line {line}: {reason}"
                if bad > max_bad:
                    more = (f" ({bad} malformed records so far, more than data.max_bad_records={max_bad})"
                            if max_bad else "")
                    raise ValueError(f"{key}={spec!r}: {path} line {line}: {reason}{more}. Fix the file, or set "
                                     "data.max_bad_records to skip malformed records with a count")
        except UnreadableFile as e:
            raise ValueError(f"{key}={spec!r}: {e}") from e
    if not good:
        raise ValueError(f"{key}={spec!r}: no records in {files[:5]}; the dataset is empty")
    if not nonempty:  # training would see BOS/EOS only, re-looping over the empty documents
        raise ValueError(f"{key}={spec!r}: every one of the {good} records in {files[:5]} has an empty "
                         f"{text_field!r} (data.text_field); the dataset has no text")
    if bad:
        from torchtitan.tools.logging import logger

        logger.warning(f"{key}={spec!r}: skipping {bad} malformed records (data.max_bad_records={max_bad}); "
                       f"the first: {first}")
    _SCANNED[memo] = bad
    return bad


def _good_records(files: list[str], builder: str, text_field: str, stamps=()):
    """The records of ``files`` that pass the scan. ``stamps`` (each file's size and mtime) only enters
    ``datasets``' cache key, which hashes the arguments and would otherwise serve an edited file's old records."""
    for path in files:
        for _, text, reason in _records(path, builder, text_field):
            if reason is None:
                yield {text_field: text}


def open_text_dataset(spec: str, key: str, *, local: bool, text_field: str, split: str = "train",
                      streaming: bool | None = None, max_bad: int = 0, subset: str = ""):
    """A ``datasets`` dataset with a ``text_field`` column. ``local`` selects files (``spec`` a path/glob)
    versus a hub dataset name (streamed by default; ``subset`` is its config name, e.g. c4's "en", "" = the
    dataset's default). Local text files are scanned first (:func:`scan_files`);
    when ``max_bad`` malformed records are allowed and some are found, the dataset is built from the good
    records only."""
    if local:
        builder, files = resolve_files(spec, key)
        if builder == "text":
            text_field = "text"
        skipped = scan_files(files, builder, key, spec, text_field, max_bad) if builder != "parquet" else 0
        if skipped:
            from datasets import Dataset, IterableDataset

            cls = IterableDataset if streaming else Dataset
            stamps = file_stamps(files)
            ds = cls.from_generator(_good_records, gen_kwargs={"files": files, "builder": builder,
                                                               "text_field": text_field, "stamps": stamps})
        else:
            kw = {"sample_by": "document"} if builder == "text" else {}
            ds = load_dataset(builder, data_files=files, split="train", streaming=bool(streaming), **kw)
    else:
        try:
            ds = load_dataset(spec, subset or None, split=split, streaming=True if streaming is None else streaming)
        except Exception as e:  # offline, unknown name or subset, gated dataset …
            what = f"{key}={spec!r}" + (f" (data.hub_subset={subset!r})" if subset else "")
            raise ValueError(f"{what}: could not open hub dataset ({type(e).__name__}: {e})") from e
    columns = ds.column_names if ds.column_names is not None else list(next(iter(ds)).keys())
    if text_field not in columns:
        raise ValueError(f"{key}={spec!r}: no column {text_field!r} (data.text_field); columns are {columns}")
    if not streaming and local and len(ds) == 0:
        raise ValueError(f"{key}={spec!r}: the dataset is empty")
    return ds, text_field
