"""The project's TOML sections: ``[model]``, ``[attention]`` (one ``[attention.<name>]`` table per registered
mechanism), ``[data]``, ``[training]``, ``[checkpoint]``, ``[metrics]`` and the optimizer/scheduler fields of
``attnlab/optim/config.py``, as dataclasses merged into torchtitan's ``JobConfig`` by :mod:`attnlab.config.parse`.
Each field's docstring is its ``--help`` text and its row in docs/configuration.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from attnlab.attention.registry import IMPLS, REGISTRY  # IMPLS: attention.ops.common's, every impl name
from attnlab.optim import config as optim_config


@dataclass
class Model:
    name: str = "qwen3_attn"
    """Train spec name; this project registers "qwen3_attn"."""
    flavor: str = field(default="debug", metadata={
        "valid": "any: a flavor of attnlab/models/args.py, checked naming them when preflight builds the model"})
    """Size (attnlab/models/args.py): debug (1.3M parameters with the embedded 4096-token vocabulary, CPU) | repl-45M |
    repl-68M (small-scale replication, 8k vocabulary) | 0.6B | 0.6B-T24 (Transformer†) | 0.6B-P64 (Parallax†) | 0.6B-ffn3712 | 1.7B |
    1.7B-T24 | 1.7B-P64 | 1.7B-ffn7424 (the paper's Qwen3 sizes); the keys below override its dimensions."""
    dim: int = field(default=0, metadata={"valid": ">= 0"})
    """Model width (0 = flavor's)."""
    n_layers: int = field(default=0, metadata={"valid": ">= 0"})
    """Number of layers (0 = flavor's)."""
    n_heads: int = field(default=0, metadata={"valid": ">= 0"})
    """Query heads (0 = flavor's); a multiple of n_kv_heads."""
    n_kv_heads: int = field(default=0, metadata={"valid": ">= 0"})
    """Key/value heads (0 = flavor's); divides n_heads."""
    head_dim: int = field(default=0, metadata={"valid": ">= 0"})
    """Per-head width (0 = flavor's); independent of dim (q: dim → n_heads·head_dim, as Qwen3)."""
    hidden_dim: int = field(default=0, metadata={"valid": ">= 0"})
    """Feed-forward (SwiGLU) inner width (0 = flavor's)."""
    attention: str = field(default="softmax", metadata={"valid": "a registered mechanism"})
    """Token mixer of every layer (``python -m attnlab.train --list-attention`` lists them)."""
    layer_pattern: list[str] = field(default_factory=list, metadata={"valid": "a registered mechanism"})
    """Mechanisms repeated over depth, e.g. ["gdn", "gdn", "gdn", "parallax"]; empty = ``attention`` everywhere."""
    attn_mask_type: str = field(default="causal", metadata={"valid": "one of causal, block_causal"})
    """"causal": each row is one sequence; "block_causal": packed documents never attend across boundaries."""
    vocab_size: int = field(default=0, metadata={"valid": ">= 0"})
    """Override the flavor's vocabulary size (0 = flavor's); must cover the tokenizer's vocabulary."""
    rope_theta: float = field(default=0.0, metadata={"valid": ">= 0"})
    """Override the RoPE base (0 = flavor's, 1e6)."""
    tie_embeddings: bool | None = None
    """Override weight tying of input and output embeddings (None = flavor's; the paper ties)."""


IMPL_RULE = "one of " + ", ".join(IMPLS)
"""``[attention] impl``: a path every mechanism knows by name; the model built at preflight checks that each
mechanism it uses accepts the one chosen."""


def _attention_section() -> type:
    """``[attention]``: ``impl`` plus one sub-table per registered mechanism, built from the registry as it is when
    called (by :func:`parse_config`), so a mechanism registered after this module was imported has its table too."""
    fields = [("impl", str, field(default="auto", metadata={"valid": IMPL_RULE})),
              ("sac_save", bool, field(default=True))]
    fields += [(name, mech.options, field(default_factory=mech.options)) for name, mech in sorted(REGISTRY.items())]
    cls = dataclasses.make_dataclass("Attention", fields)
    # a class made at run time has no source for tyro to read field docstrings from: Google-style attributes
    cls.__doc__ = """Attention options: ``impl`` and one ``[attention.<mechanism>]`` table per mechanism.

    Attributes:
        impl: Kernel choice of every mechanism: "auto" picks per device (Triton/fla on GPU, the chunked PyTorch
            form on CPU); "reference" forces the readable PyTorch oracle; some mechanisms take more (their
            ``--list-attention`` entry and docs/mechanisms.md name them).
        sac_save: Under selective activation checkpointing ("op" mode), keep the outputs of the attention custom
            ops (true) or recompute them in the backward (false: less activation memory, one more forward of
            each op per step). benchmarks/README.md has both for GDN and KDA.
    """
    return cls


@dataclass
class Data:
    text_field: str = field(default="text", metadata={"valid": "non-empty"})
    """Column holding the text in JSONL/parquet/hub datasets."""
    hub_split: str = field(default="train", metadata={"valid": "non-empty"})
    """Split to read from a hub dataset."""
    hub_subset: str = field(default="", metadata={"valid": "any: a subset of the hub dataset; empty = its default"})
    """Subset (config name) of a hub dataset, e.g. "en" for allenai/c4 or "sample-10BT" for
    HuggingFaceFW/fineweb-edu; empty = the dataset's default."""
    streaming: bool | None = None
    """Stream the dataset (None = stream hub datasets, load local files as Arrow map-style datasets)."""
    val_every: int = field(default=100, metadata={"valid": "0 or >= 2"})
    """When ``validation.dataset_path`` is empty, every ``val_every``-th document is held out for validation.
    0 holds out none: validation then needs ``validation.dataset_path`` (else the run is refused before it starts;
    ``validation.enable = false`` trains on every document without validation)."""
    embedded_vocab_size: int = field(default=4096, metadata={"valid": ">= 258; 256 bytes and 2 special tokens"})
    """Vocabulary of the BPE tokenizer trained for the embedded corpus."""
    cache_dir: str = field(default=".cache/attnlab", metadata={"valid": "non-empty and not a file"})
    """Where the embedded corpus and its tokenizer are built once and reused."""
    max_bad_records: int = field(default=0, metadata={"valid": ">= 0"})
    """Malformed records (not a JSON object, no ``text_field`` string, broken UTF-8) that are skipped with a count
    before the run stops; 0 = the first one stops the run, naming the file and line. Local files are checked
    record by record before step 1, so a bad record never stops a run mid-training."""


@dataclass
class Training:
    stop_after_step: int = field(default=0, metadata={"valid": ">= 0"})
    """Stop after this step as if the job were preempted (0 = run to ``training.steps``); the schedule still
    spans ``training.steps``, and a checkpoint is written at the stop step so the same command resumes."""
    nonfinite_skips: int = field(default=0, metadata={"valid": ">= 0"})
    """Steps with a non-finite loss or gradient norm that are skipped (no optimizer update) before the run stops;
    0 = stop at the first one. 0 costs no extra host sync (checked at log steps and before every checkpoint save);
    > 0 decides before every optimizer step, one host sync and all-reduce per step."""
    loss_chunk_tokens: int = field(default=0, metadata={"valid": ">= 0"})
    """Compute the training loss N tokens at a time (0 = off: torchtitan's loss of the whole [batch, seq_len,
    vocab] logits). The logits of one chunk exist at a time, so the loss needs O(N·vocab) memory instead of
    O(tokens·vocab): Qwen3's 151,936-entry head at 65,536 tokens a rank makes 18.5 GiB of bf16 logits (and twice
    that in their fp32 upcast); a chunk peaks at about 6·N·vocab bytes in bf16, 3.5 GiB at N = 4096
    (attnlab/models/loss.py). Same loss and gradients, no recomputation; validation, evaluation and decoding keep the
    full logits. The head must stay out of float8/MX conversion (``filter_fqns`` holds "output")."""


@dataclass
class Checkpoint:
    partial_load: bool = False
    """Resume from a checkpoint whose model keys differ from the model built: keys missing from the checkpoint
    keep their initialisation, keys the model lacks are ignored (both listed in the log). Off: any difference is
    an error naming the keys."""


@dataclass
class Metrics:
    wandb_project: str = field(default="attnlab", metadata={"valid": "non-empty"})
    """wandb project of the run (with ``metrics.enable_wandb``); its files go to ``<job.dump_folder>/wandb/``."""
    wandb_run_name: str = field(default="", metadata={"valid": "any: a name; empty = the name of job.dump_folder"})
    """wandb run name; empty = the name of ``job.dump_folder``."""


def job_config_class() -> type:
    """The project's sections as one dataclass (merged into torchtitan's by :func:`parse_config`)."""
    section = _attention_section()
    return dataclasses.make_dataclass("JobConfig", [
        ("model", Model, field(default_factory=Model)),
        ("attention", section, field(default_factory=section)),
        ("data", Data, field(default_factory=Data)),
        ("training", Training, field(default_factory=Training)),
        ("checkpoint", Checkpoint, field(default_factory=Checkpoint)),
        ("metrics", Metrics, field(default_factory=Metrics)),
        ("optimizer", optim_config.Optimizer, field(default_factory=optim_config.Optimizer)),
        ("lr_scheduler", optim_config.LRScheduler, field(default_factory=optim_config.LRScheduler)),
    ])
