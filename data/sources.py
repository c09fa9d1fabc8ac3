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
        raise ValueError(f"{key}={spec!r}: no .jsonl/.json/.parquet/.txt (optionally .gz) files found")
    builders = {_builder_for(f) for f in files}
    if None in builders or len(builders) > 1:
        raise ValueError(f"{key}={spec!r}: files must all be one of {sorted(set(_BUILDERS))} (+.gz); got {files[:5]}")
    return builders.pop(), files


def open_text_dataset(spec: str, key: str, *, local: bool, text_field: str, split: str = "train",
                      streaming: bool | None = None):
    """A ``datasets`` dataset with a ``text_field`` column. ``local`` selects files (``spec`` a path/glob)
    versus a hub dataset name (streamed by default)."""
    if local:
        builder, files = resolve_files(spec, key)
        kw = {"sample_by": "document"} if builder == "text" else {}
        ds = load_dataset(builder, data_files=files, split="train", streaming=bool(streaming), **kw)
        if builder == "text":
            text_field = "text"
    else:
        try:
            ds = load_dataset(spec, split=split, streaming=True if streaming is None else streaming)
        except Exception as e:  # offline, unknown name, gated dataset …
            raise ValueError(f"{key}={spec!r}: could not open hub dataset ({type(e).__name__}: {e})") from e
    columns = ds.column_names if ds.column_names is not None else list(next(iter(ds)).keys())
    if text_field not in columns:
        raise ValueError(f"{key}={spec!r}: no column {text_field!r} (data.text_field); columns are {columns}")
    if not streaming and local and len(ds) == 0:
        raise ValueError(f"{key}={spec!r}: the dataset is empty")
    return ds, text_field
