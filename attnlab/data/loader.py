"""Packed-document data loading on top of torchtitan's ``HuggingFaceTextDataset``.

Documents are tokenized with BOS/EOS and packed into rows of ``seq_len + 1`` tokens; each row yields
``({"input": tokens, "positions": per-document positions}, labels)``. Positions restart at every document
start (a BOS token, or the token after an EOS) and at every row start, which is also what the model's
``block_causal`` mask uses. Sharding is deterministic per data-parallel rank (interleaved),
and the dataset state (documents consumed, the characters read of a long document, leftover tokens, and what data
this is) is saved in checkpoints through torchtitan's ``ParallelAwareDataloader``. A long document is tokenized in
pieces (:func:`piece_end`), so memory does not grow with a document's length.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import torch
from datasets import Dataset
from datasets.distributed import split_dataset_by_node

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset
from torchtitan.tools.logging import logger

from attnlab.data.embedded import build_embedded
from attnlab.data.sources import open_text_dataset

EMBEDDED = "embedded"


def document_positions(tokens: torch.Tensor, bos_id: int | None, eos_id: int | None) -> torch.Tensor:
    """[T] int64 position of each token inside its document; a document starts at a BOS token, after an
    EOS token, and at index 0."""
    T = tokens.shape[0]
    start = torch.zeros(T, dtype=torch.bool)
    if bos_id is not None:
        start |= tokens == bos_id
    if eos_id is not None and T > 1:
        start[1:] |= tokens[:-1] == eos_id
    start[0] = True
    idx = torch.arange(T)
    return idx - torch.cummax(torch.where(start, idx, 0), dim=0).values


def document_lengths(positions: torch.Tensor) -> list[int]:
    """Lengths of the documents of a batch of packed rows, in order, from their per-document ``positions``
    [B, T] (a document starts where the position is 0 and at every row start, as the ``block_causal`` mask
    splits them); they sum to B·T. What ``models.args.ModelArgs.training_flops`` takes for a document-masked
    step."""
    B, T = positions.shape
    starts = positions.reshape(-1) == 0
    starts[::T] = True
    first = starts.nonzero().flatten().cpu()
    return torch.cat([first, torch.tensor([B * T])]).diff().tolist()


PIECE_CHARS = 1 << 18
"""Longest stretch of a document (in characters) tokenized at once: a long document is tokenized and packed piece
by piece, so memory does not grow with a document's length (the tokenizer's intermediate state takes ~100 bytes
per character)."""


def piece_end(text: str, start: int, piece_chars: int) -> int:
    """End of the piece of ``text`` that starts at ``start``: ``len(text)`` when the rest fits in ``piece_chars``,
    else the last index ``i`` in ``(start, start + piece_chars]`` where ``text[i]`` is a space preceded by a
    non-space and followed by a letter. Byte-level BPE pre-tokenizers (GPT-2's, Qwen's, Llama 3's regex, and
    the embedded tokenizer's) always split there, with the space starting the next pre-token (`` word``), so the
    pieces' tokens concatenate to the whole text's. A stretch of ``piece_chars`` without such a space (no spaces
    at all, e.g. Chinese or Japanese text) is cut at ``start + piece_chars``: only there may the tokens differ
    from the whole-document tokenization."""
    limit = start + piece_chars
    if len(text) <= limit:
        return len(text)
    i = text.rfind(" ", start + 1, limit + 1)
    while i > start:
        if i + 1 < len(text) and not text[i - 1].isspace() and text[i + 1].isalpha():
            return i
        i = text.rfind(" ", start + 1, i)
    return limit


class PackedTextDataset(HuggingFaceTextDataset):
    """torchtitan's stateful packing dataset with per-document positions, any ``datasets`` source, a
    ``repeatable`` mode for validation (every pass reads the same documents from the start), and documents
    tokenized in pieces of at most ``piece_chars`` characters (:func:`piece_end`), so a 50 MB document is packed
    in bounded memory. The state is torchtitan's (``sample_idx``: documents read whole, ``token_buffer``: tokens
    not yet in a row, ``data``: a streaming dataset's position) plus ``doc_offset``, the characters of document
    ``sample_idx`` already tokenized (a resume continues inside a long document), and ``data_identity``, what
    data this is (:func:`data_identity`), which a resume compares with its own."""

    piece_chars = PIECE_CHARS

    def __init__(self, ds, text_field: str, name: str, tokenizer, seq_len: int, dp_rank: int, dp_world_size: int,
                 infinite: bool, repeatable: bool = False, max_bad: int = 0, identity: dict | None = None):
        self.dataset_name = name
        # Interleaved shards (document i goes to rank i % world): rank r's k-th row comes from the same part of
        # the corpus as a single process's (k·world + r)-th row, so data-parallel runs see the same data.
        self._data = (ds.shard(num_shards=dp_world_size, index=dp_rank, contiguous=False) if isinstance(ds, Dataset)
                      else split_dataset_by_node(ds, dp_rank, dp_world_size))
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        self.repeatable = repeatable
        self._text_processor = lambda sample: sample[text_field]
        self._text_field, self.max_bad, self.bad_records = text_field, max_bad, 0
        self.identity = identity or {"name": name}
        self._sample_idx = 0
        self._token_buffer: list[int] = []
        self._buffer_start = 0  # tokens of _token_buffer before this index are already in rows
        self._doc_offset = 0
        self._doc_data_state = None  # a streaming dataset's position before the document being read
        self._pieces_exact: bool | None = None
        self._pass = 1

    def _get_data_iter(self):
        """torchtitan's iterator minus records without a string text field. Local files never have them (they
        are scanned at start, data.sources); hub data is checked here: skipped with a count up to
        ``data.max_bad_records``, then an error naming the dataset, the record and the key."""
        for sample in self._documents():
            text = sample.get(self._text_field) if isinstance(sample, dict) else None
            if isinstance(text, str):
                yield sample
                continue
            self.bad_records += 1
            if isinstance(self._data, Dataset):
                self._sample_idx += 1  # the position stays the document index (resume)
            what = f"{self.dataset_name}: a record's {self._text_field!r} is {type(text).__name__}, not a string"
            if self.bad_records > self.max_bad:
                raise ValueError(f"{what} ({self.bad_records} such records, more than data.max_bad_records="
                                 f"{self.max_bad}); set data.text_field or data.max_bad_records")
            logger.warning(f"{what}; skipped ({self.bad_records}/{self.max_bad} allowed by data.max_bad_records)")

    def _documents(self):
        """The documents from the current position; a streaming dataset's position before each one is kept, for
        a checkpoint taken inside a long document."""
        if isinstance(self._data, Dataset):
            yield from super()._get_data_iter()
            return
        it = iter(self._data)
        while True:
            self._doc_data_state = self._data.state_dict()
            sample = next(it, None)
            if sample is None:
                return
            yield sample

    def _pieces_match(self) -> bool:
        """Whether this tokenizer's tokens of text cut at :func:`piece_end` concatenate to the whole text's
        (checked once on a sample text; true for byte-level BPE). When not, documents are tokenized whole."""
        if self._pieces_exact is None:
            text = "Hello world, it's 2 tests. Ünïcode wörds and\n\nmore  text\there: x = y (z) " * 3
            cut = []
            start = 0
            while start < len(text):
                end = piece_end(text, start, 24)
                cut += self._piece_tokens(text, start, end)
                start = end
            self._pieces_exact = cut == self._tokenizer.encode(text, add_bos=True, add_eos=True)
            if not self._pieces_exact:
                logger.warning(f"{self.dataset_name}: this tokenizer's tokens of a text cut between words differ "
                               "from the whole text's; documents are tokenized whole (memory grows with the "
                               "longest document)")
        return self._pieces_exact

    def _piece_tokens(self, text: str, start: int, end: int) -> list[int]:
        """Token ids of ``text[start:end]``, with BOS when it starts the document and EOS when it ends it."""
        if start == 0 and end == len(text):
            return self._tokenizer.encode(text, add_bos=True, add_eos=True)
        ids = self._tokenizer.tokenizer.encode(text[start:end], add_special_tokens=False).ids
        bos, eos = self._tokenizer.bos_id, self._tokenizer.eos_id
        return ([bos] if start == 0 and bos is not None else []) + ids + (
            [eos] if end == len(text) and eos is not None else [])

    def _document_tokens(self, text: str):
        """Yield the token ids of a document piece by piece from ``_doc_offset``; the position (``_doc_offset``,
        or ``_sample_idx`` after the last piece) is advanced before each piece is yielded."""
        start = self._doc_offset
        while True:
            end = piece_end(text, start, self.piece_chars) if self._pieces_match() else len(text)
            tokens = self._piece_tokens(text, start, end)
            if end == len(text):
                self._sample_idx, self._doc_offset = self._sample_idx + 1, 0
            else:
                self._doc_offset = end
            yield tokens
            if end == len(text):
                return
            start = end

    def state_dict(self) -> dict:
        """A snapshot (copies): the worker of ``num_workers = 1`` hands it to a queue that pickles it in a
        background thread while the worker packs on."""
        state = {"token_buffer": self._token_buffer[self._buffer_start:], "doc_offset": self._doc_offset,
                 "data_identity": dict(self.identity)}
        if isinstance(self._data, Dataset):
            state["sample_idx"] = self._sample_idx
        else:
            state["data"] = self._doc_data_state if self._doc_offset else self._data.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._buffer_start = 0
        self._doc_offset = state_dict.get("doc_offset", 0)

    def __iter__(self):
        if self.repeatable:
            self._sample_idx, self._token_buffer, self._buffer_start, self._doc_offset = 0, [], 0, 0
        bos, eos = self._tokenizer.bos_id, self._tokenizer.eos_id
        row = self.seq_len + 1
        while True:
            for sample in self._get_data_iter():
                for tokens in self._document_tokens(sample[self._text_field]):
                    del self._token_buffer[:self._buffer_start]  # once per piece, not per row
                    self._buffer_start = 0
                    self._token_buffer.extend(tokens)
                    while len(self._token_buffer) - self._buffer_start >= row:
                        x = torch.tensor(self._token_buffer[self._buffer_start:self._buffer_start + row])
                        self._buffer_start += row
                        inputs = x[:-1]
                        yield {"input": inputs, "positions": document_positions(inputs, bos, eos)}, x[1:]
            if not self.infinite:
                logger.warning(f"Dataset {self.dataset_name} has run out of data")
                return
            self._sample_idx = 0
            self._pass += 1
            if self._pass & (self._pass - 1) == 0:  # passes 2, 4, 8, ...: a few lines however long the run
                logger.warning(f"Dataset {self.dataset_name} is being re-looped: pass {self._pass} starts (passes "
                               f"2, 4, 8, ... are logged)")
            if not isinstance(self._data, Dataset) and hasattr(self._data, "set_epoch"):
                self._data.set_epoch(self._data.epoch + 1)


def tokenizer_path(job_config) -> str:
    """The folder ``model.hf_assets_path`` names: itself, or for "embedded" the built-in corpus's tokenizer (built
    once, cached)."""
    path = job_config.model.hf_assets_path
    if path == EMBEDDED:
        return str(build_embedded(job_config.data.cache_dir, job_config.data.embedded_vocab_size))
    return path


def build_tokenizer(job_config) -> HuggingFaceTokenizer:
    """``model.hf_assets_path`` is a folder with ``tokenizer.json`` (e.g. Qwen3's), or "embedded"."""
    path = tokenizer_path(job_config)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"model.hf_assets_path={path!r}: no tokenizer.json there (a Hugging Face tokenizer "
                         f"folder, or \"{EMBEDDED}\" for the built-in corpus's tokenizer)")
    try:
        tok = HuggingFaceTokenizer(path)
    except Exception as e:
        raise ValueError(f"model.hf_assets_path={path!r}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
    if tok.eos_id is None and tok.bos_id is None:
        raise ValueError(f"model.hf_assets_path={path!r}: the tokenizer defines neither a BOS nor an EOS token "
                         "(set bos_token/eos_token in tokenizer_config.json); documents could not be separated")
    return tok


def _embedded(job_config) -> bool:
    t = job_config.training
    return t.dataset == EMBEDDED and not t.dataset_path


def _check_held_out(job_config) -> None:
    """Validation without ``validation.dataset_path`` reads the documents ``data.val_every`` holds out of the
    training data; ``data.val_every = 0`` holds out none, so there is nothing to validate on."""
    v, d = job_config.validation, job_config.data
    if v.enable and not v.dataset_path and d.val_every == 0 and not _embedded(job_config):
        raise ValueError("data.val_every=0 holds out no documents, and validation.dataset_path is empty: validation "
                         "would score the training documents; set validation.dataset_path, data.val_every = K (every "
                         "K-th document held out), or validation.enable = false")


def check_data(job_config) -> None:
    """The data checks preflight runs before anything starts, each a ValueError naming the key or file, reading
    nothing but file metadata: validation has held-out data (:func:`_check_held_out`), and local files exist in a
    supported format with the text column (``sources.check_files``)."""
    from attnlab.data.sources import check_files

    t, v, d = job_config.training, job_config.validation, job_config.data
    _check_held_out(job_config)
    if t.dataset_path:
        check_files(t.dataset_path, "training.dataset_path", d.text_field)
    if v.enable and v.dataset_path:
        check_files(v.dataset_path, "validation.dataset_path", d.text_field)


def check_data_source(job_config) -> None:
    """Before a run starts (not in a configuration check, which needs no network): a hub dataset can be reached
    (``sources.check_hub``, one request of at most 5 s)."""
    from attnlab.data.sources import check_hub

    t = job_config.training
    if not t.dataset_path and not _embedded(job_config):
        check_hub(t.dataset, "training.dataset", job_config.data.streaming)


def _source(job_config, split: str):
    """(dataset, text_field, name) for ``split`` in {"train", "val"}."""
    t, v, d = job_config.training, job_config.validation, job_config.data
    if split == "val" and v.dataset_path:
        ds, field = open_text_dataset(v.dataset_path, "validation.dataset_path", local=True,
                                      text_field=d.text_field, streaming=d.streaming, max_bad=d.max_bad_records)
        return ds, field, v.dataset_path
    if _embedded(job_config):
        folder = build_embedded(d.cache_dir, d.embedded_vocab_size)
        ds, field = open_text_dataset(str(folder / f"{split}.jsonl"), "training.dataset", local=True, text_field="text")
        return ds, field, f"{EMBEDDED}/{split}"
    if split == "val":
        _check_held_out(job_config)
    local = bool(t.dataset_path)
    spec = t.dataset_path or t.dataset
    key = "training.dataset_path" if local else "training.dataset"
    ds, field = open_text_dataset(spec, key, local=local, text_field=d.text_field, split=d.hub_split,
                                  streaming=d.streaming, max_bad=d.max_bad_records, subset=d.hub_subset)
    if d.val_every > 0 and v.enable and not v.dataset_path:  # hold out every k-th document for validation
        keep = (lambda _, i: i % d.val_every == 0) if split == "val" else (lambda _, i: i % d.val_every != 0)
        ds = ds.filter(keep, with_indices=True)
        empty = len(ds) == 0 if isinstance(ds, Dataset) else next(iter(ds), None) is None
        if empty:
            raise ValueError(f"{key}={spec!r}: the {split} split is empty after holding out every "
                             f"data.val_every={d.val_every}-th document (from the first) for validation; add "
                             "documents, set validation.dataset_path, or set data.val_every = 0 or "
                             "validation.enable = false")
    return ds, field, f"{spec.rstrip('/')}/{split}"


def data_identity(job_config, split: str) -> dict:
    """What the ``split`` loader reads, kept in its state so that a resume on other data is named: the key and
    its value, the text field, a hub dataset's subset and split, the held-out rule, and for local files their
    count, total bytes and a digest of their paths and sizes (one ``stat`` per file; contents are not read)."""
    import hashlib

    from attnlab.data.sources import resolve_files

    t, v, d = job_config.training, job_config.validation, job_config.data
    if split == "val" and v.dataset_path:
        key, spec, local = "validation.dataset_path", v.dataset_path, True
    elif _embedded(job_config):
        key, spec, local = "training.dataset", EMBEDDED, False
    else:
        local = bool(t.dataset_path)
        key, spec = ("training.dataset_path", t.dataset_path) if local else ("training.dataset", t.dataset)
    ident = {"key": key, "source": spec, "split": split, "text_field": d.text_field}
    if _embedded(job_config):
        ident["embedded_vocab_size"] = d.embedded_vocab_size
    elif not local:
        ident.update(hub_subset=d.hub_subset, hub_split=d.hub_split)
    if key != "validation.dataset_path" and not _embedded(job_config) and v.enable and not v.dataset_path:
        ident["val_every"] = d.val_every
    if local:
        files = resolve_files(spec, key)[1]
        sizes = [os.path.getsize(f) for f in files]
        digest = hashlib.sha1(repr(sorted(zip(map(os.path.abspath, files), sizes))).encode()).hexdigest()[:16]
        ident.update(files=len(files), bytes=sum(sizes), digest=digest)
    return ident


def data_changes(saved: dict, now: dict) -> str:
    """The differences between two :func:`data_identity` records, as "what: saved -> now" parts ("" if none)."""
    name = {"source": now.get("key", "source"), "digest": "files' paths and sizes"}
    keys = sorted({*saved, *now} - {"key"}, key=lambda k: (k != "source", k))  # the dataset's name first
    return ", ".join(f"{name.get(k, k)} {saved.get(k)!r} -> {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k))


def _loader(job_config, split, tokenizer, dp_rank, dp_world_size, batch_size, seq_len, dl_config, **kw):
    ds, field, name = _source(job_config, split)
    dataset = PackedTextDataset(ds, field, name, tokenizer, seq_len, dp_rank, dp_world_size,
                                identity=data_identity(job_config, split), **kw)
    if isinstance(dataset._data, Dataset) and len(dataset._data) == 0:  # an infinite loader would re-loop forever
        raise ValueError(f"{name}: {len(ds)} documents leave data-parallel rank {dp_rank} of {dp_world_size} "
                         "none; add documents or use fewer ranks")
    logger.info(f"Data ({split}): {name}, rank {dp_rank}/{dp_world_size}")
    return ReshardableDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                 **{**asdict(dl_config), "batch_size": batch_size})


class ReshardableDataloader(ParallelAwareDataloader):
    """torchtitan's loader, plus resuming a checkpoint written with a different data-parallel world size.

    Rule (map-style datasets: local files, the embedded corpus, ``data.streaming = false``): with W old ranks
    where old rank r has read n_r documents (rank r reads documents r, r+W, r+2W, ...), every global document
    below N = min_r(n_r·W + r) has been read; new rank r' of W' starts at the first document >= N in its own
    interleaved shard. Old ranks' leftover partial rows are dropped and at most W documents per old rank are
    read twice (a long document an old rank was inside is read again from its start). When every document fills
    whole rows and ranks are in step, this is exactly the data order of an uninterrupted run. Streaming (iterable)
    datasets keep an opaque per-rank state and cannot be resharded: the load fails with one message naming the
    checkpoint and both world sizes.
    ``resume_world_size`` is set by the trainer from the checkpoint's metadata before DCP loads it, and cleared once
    the state is loaded: until then :meth:`state_dict` is the old ranks' template DCP fills, afterwards this rank's
    own state, which the run's next checkpoint saves.
    """

    resume_world_size: int | None = None
    checkpoint_path: str = ""

    def state_dict(self) -> dict:
        old = self.resume_world_size
        if old is None or old == self.dp_world_size:
            return super().state_dict()
        # the template DCP fills on load: every old rank's state (bytes), so this rank can reshard them
        return {**{f"dp_rank_{r}": b"" for r in range(old)}, "world_size": old}

    def check_reshardable(self, old: int) -> None:
        """Raise the one clear error when a checkpoint of ``old`` ranks cannot be resharded to this world size."""
        if old != self.dp_world_size and not isinstance(getattr(self.dataset, "_data", None), Dataset):
            raise ValueError(
                f"checkpoint {self.checkpoint_path!r} was written by {old} data-parallel ranks and this run has "
                f"{self.dp_world_size}: the streaming data loader's per-rank position cannot be resharded. Resume "
                f"with {old} data-parallel ranks, or use local files / data.streaming = false (map-style datasets "
                "reshard), or start a new run from it with checkpoint.initial_load_path (model only).")

    def load_state_dict(self, state_dict: dict) -> None:
        self.resume_world_size = None  # loaded: later checkpoints save this rank's state, not the template
        old = state_dict.get("world_size") if state_dict else None
        if old is None or old == self.dp_world_size:
            if state_dict and self._rank_id in state_dict:
                _note_data_change(self, state_dict[self._rank_id])
            return super().load_state_dict(state_dict)
        import math
        import pickle

        self.check_reshardable(old)
        ds = self.dataset
        _note_data_change(self, state_dict["dp_rank_0"])
        done = [dataset_state(pickle.loads(state_dict[f"dp_rank_{r}"]))["sample_idx"] for r in range(old)]
        n_global = min(n * old + r for r, n in enumerate(done))
        W, r = self.dp_world_size, self.dp_rank
        ds._sample_idx = max(0, math.ceil((n_global - r) / W))
        ds._token_buffer, ds._buffer_start, ds._doc_offset = [], 0, 0
        logger.warning(f"Data loader resharded from {old} to {W} ranks: resuming at global document {n_global} "
                       f"(rank {r} skips {ds._sample_idx} of its documents; leftover partial rows dropped)")


def _note_data_change(loader, rank_state: bytes) -> None:
    """Warn in one line when the checkpoint's loader read other data than ``loader`` (:func:`data_identity`): its
    position (documents read, tokens buffered) is applied to this data as it is."""
    import pickle

    try:
        saved = dataset_state(pickle.loads(rank_state)).get("data_identity")
    except (KeyError, TypeError):  # no batch delivered yet, or a state without the dataset's
        return
    changes = data_changes(saved, loader.dataset.identity) if saved else ""
    if changes:
        logger.warning(f"Data changed since checkpoint {loader.checkpoint_path or '(resumed)'}: {changes}; its "
                       "loader position is applied to this data as it is (to read this data from its first "
                       "document, resume with --checkpoint.exclude_from_loading dataloader)")


def dataset_state(loader_state: dict) -> dict:
    """The packed dataset's state (``sample_idx``, ``token_buffer``) inside one rank's ``StatefulDataLoader`` state:
    at its top level without worker processes, in the worker's snapshot with ``num_workers = 1`` (the snapshot
    of the last batch delivered, so prefetched batches are not counted)."""
    if "dataset_state" in loader_state:
        return loader_state["dataset_state"]
    return loader_state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config) -> ParallelAwareDataloader:
    t = job_config.training
    return _loader(job_config, "train", tokenizer, dp_rank, dp_world_size, t.local_batch_size, t.seq_len,
                   t.dataloader, infinite=True, max_bad=job_config.data.max_bad_records)


def build_validation_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config) -> ParallelAwareDataloader:
    v = job_config.validation
    return _loader(job_config, "val", tokenizer, dp_rank, dp_world_size, v.local_batch_size, v.seq_len,
                   v.dataloader, infinite=False, repeatable=True, max_bad=job_config.data.max_bad_records)
