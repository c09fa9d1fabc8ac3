"""Packed-document data loading on top of torchtitan's ``HuggingFaceTextDataset``.

Documents are tokenized with BOS/EOS and packed into rows of ``seq_len + 1`` tokens; each row yields
``({"input": tokens, "positions": per-document positions}, labels)``. Positions restart at every document
start (a BOS token, or the token after an EOS) and at every row start, which is also what the model's
``block_causal`` mask uses. Sharding is deterministic per data-parallel rank (interleaved),
and the dataset state (documents consumed + leftover tokens) is saved in checkpoints through torchtitan's
``ParallelAwareDataloader``.
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


class PackedTextDataset(HuggingFaceTextDataset):
    """torchtitan's stateful packing dataset with per-document positions, any ``datasets`` source, and a
    ``repeatable`` mode for validation (every pass reads the same documents from the start)."""

    def __init__(self, ds, text_field: str, name: str, tokenizer, seq_len: int, dp_rank: int, dp_world_size: int,
                 infinite: bool, repeatable: bool = False, max_bad: int = 0):
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
        self._sample_idx = 0
        self._token_buffer: list[int] = []

    def _get_data_iter(self):
        """torchtitan's iterator minus records without a string text field. Local files never have them (they
        are scanned at start, data.sources); hub data is checked here: skipped with a count up to
        ``data.max_bad_records``, then an error naming the dataset, the record and the key."""
        for sample in super()._get_data_iter():
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

    def state_dict(self) -> dict:
        """torchtitan's state with a copy of the token buffer. torchtitan returns the live list, and the worker of
        ``num_workers = 1`` hands its snapshot to a queue that pickles it in a background thread while the worker
        packs on: the next document's tokens could extend the snapshot's buffer after its ``sample_idx`` was set,
        and a resume would read them twice."""
        return {**super().state_dict(), "token_buffer": list(self._token_buffer)}

    def __iter__(self):
        if self.repeatable:
            self._sample_idx, self._token_buffer = 0, []
        bos, eos = self._tokenizer.bos_id, self._tokenizer.eos_id
        for batch in super().__iter__():
            (inputs,), labels = batch[0].values(), batch[1]
            yield {"input": inputs, "positions": document_positions(inputs, bos, eos)}, labels


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


def _source(job_config, split: str):
    """(dataset, text_field, name) for ``split`` in {"train", "val"}."""
    t, v, d = job_config.training, job_config.validation, job_config.data
    if split == "val" and v.dataset_path:
        ds, field = open_text_dataset(v.dataset_path, "validation.dataset_path", local=True,
                                      text_field=d.text_field, streaming=d.streaming, max_bad=d.max_bad_records)
        return ds, field, v.dataset_path
    if t.dataset == EMBEDDED and not t.dataset_path:
        folder = build_embedded(d.cache_dir, d.embedded_vocab_size)
        ds, field = open_text_dataset(str(folder / f"{split}.jsonl"), "training.dataset", local=True, text_field="text")
        return ds, field, f"{EMBEDDED}/{split}"
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
    return ds, field, f"{spec}/{split}"


def _loader(job_config, split, tokenizer, dp_rank, dp_world_size, batch_size, seq_len, dl_config, **kw):
    ds, field, name = _source(job_config, split)
    dataset = PackedTextDataset(ds, field, name, tokenizer, seq_len, dp_rank, dp_world_size, **kw)
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
    read twice. When every document fills whole rows and ranks are in step, this is exactly the data order of an
    uninterrupted run. Streaming (iterable) datasets keep an opaque per-rank state and cannot be resharded: the
    load fails with one message naming the checkpoint and both world sizes.
    ``resume_world_size`` is set by the trainer from the checkpoint's metadata before DCP loads it.
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
        old = state_dict.get("world_size") if state_dict else None
        if old is None or old == self.dp_world_size:
            return super().load_state_dict(state_dict)
        import math
        import pickle

        self.check_reshardable(old)
        ds = self.dataset
        done = [dataset_state(pickle.loads(state_dict[f"dp_rank_{r}"]))["sample_idx"] for r in range(old)]
        n_global = min(n * old + r for r, n in enumerate(done))
        W, r = self.dp_world_size, self.dp_rank
        ds._sample_idx = max(0, math.ceil((n_global - r) / W))
        ds._token_buffer = []
        logger.warning(f"Data loader resharded from {old} to {W} ranks: resuming at global document {n_global} "
                       f"(rank {r} skips {ds._sample_idx} of its documents; leftover partial rows dropped)")


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
