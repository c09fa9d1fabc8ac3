"""The project's TOML sections, merged into torchtitan 0.2.2's ``JobConfig`` (custom-config mechanism).

Precedence: command line (``--section.key value``) > TOML file > the defaults below and torchtitan's.
Sections added or extended here: ``[model]`` (attention choice), ``[training]`` (``stop_after_step``), ``[attention]`` (one sub-table per
registered mechanism, e.g. ``[attention.parallax]``, generated from the registry), ``[data]``, and the
optimizer/scheduler fields of ``optim/config.py``. :func:`validate_config` checks everything once at start.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import attention
from attention.registry import REGISTRY
from optim import config as optim_config


@dataclass
class Model:
    name: str = "qwen3_attn"
    """Train spec name; this project registers "qwen3_attn"."""
    flavor: str = "debug"
    """Size: debug | 0.6B | 0.6B-T24 (Transformer†) | 0.6B-P64 (Parallax†) | 0.6B-ffn3712 | 1.7B | 1.7B-T24 | 1.7B-P64 | 1.7B-ffn7424."""
    attention: str = "softmax"
    """Token mixer of every layer (``python train.py --list-attention`` lists them)."""
    layer_pattern: list[str] = field(default_factory=list)
    """Mechanisms repeated over depth, e.g. ["gdn", "gdn", "gdn", "parallax"]; empty = ``attention`` everywhere."""
    attn_mask_type: str = "causal"
    """"causal": each row is one sequence; "block_causal": packed documents never attend across boundaries."""
    vocab_size: int = 0
    """Override the flavor's vocabulary size (0 = flavor's); must cover the tokenizer's vocabulary."""
    rope_theta: float = 0.0
    """Override the RoPE base (0 = flavor's, 1e6)."""
    tie_embeddings: bool | None = None
    """Override weight tying of input and output embeddings (None = flavor's; the paper ties)."""


def _attention_section() -> type:
    """``[attention]``: ``impl`` plus one sub-table per registered mechanism, built from the registry."""
    fields = [("impl", str, field(default="auto"))]
    fields += [(name, mech.options, field(default_factory=mech.options)) for name, mech in sorted(REGISTRY.items())]
    cls = dataclasses.make_dataclass("Attention", fields)
    cls.__doc__ = 'Attention options: ``impl`` ("auto" picks per device) and ``[attention.<mechanism>]`` tables.'
    return cls


Attention = _attention_section()


@dataclass
class Data:
    text_field: str = "text"
    """Column holding the text in JSONL/parquet/hub datasets."""
    hub_split: str = "train"
    """Split to read from a hub dataset."""
    streaming: bool | None = None
    """Stream the dataset (None = stream hub datasets, load local files as Arrow map-style datasets)."""
    val_every: int = 100
    """When ``validation.dataset_path`` is empty, every ``val_every``-th document is held out for validation."""
    embedded_vocab_size: int = 4096
    """Vocabulary of the BPE tokenizer trained for the embedded corpus."""
    cache_dir: str = ".cache/attnlab"
    """Where the embedded corpus and its tokenizer are built once and reused."""


@dataclass
class Training:
    stop_after_step: int = 0
    """Stop after this step as if the job were preempted (0 = run to ``training.steps``); the schedule still
    spans ``training.steps``, and a checkpoint is written at the stop step so the same command resumes."""


JobConfig = dataclasses.make_dataclass(
    "JobConfig",
    [("model", Model, field(default_factory=Model)),
     ("attention", Attention, field(default_factory=Attention)),
     ("data", Data, field(default_factory=Data)),
     ("training", Training, field(default_factory=Training)),
     ("optimizer", optim_config.Optimizer, field(default_factory=optim_config.Optimizer)),
     ("lr_scheduler", optim_config.LRScheduler, field(default_factory=optim_config.LRScheduler))],
)


def validate_config(job_config) -> None:
    """Fail before training starts, naming the key, the value and what is valid."""
    from models.args import get_flavor

    m = job_config.model
    args = get_flavor(m.flavor)
    for key, name in [("model.attention", m.attention)] + [
        (f"model.layer_pattern[{i}]", n) for i, n in enumerate(m.layer_pattern)
    ]:
        attention.get_mechanism(name, key)
    if m.attn_mask_type not in ("causal", "block_causal"):
        raise ValueError(f"model.attn_mask_type={m.attn_mask_type!r}; choose from ['causal', 'block_causal']")
    if args.n_heads % args.n_kv_heads:
        raise ValueError(f"model.flavor={m.flavor!r}: n_heads={args.n_heads} is not a multiple of n_kv_heads={args.n_kv_heads}")
    if m.vocab_size < 0:
        raise ValueError(f"model.vocab_size={m.vocab_size} must be >= 0")
    t = job_config.training
    if t.seq_len <= 0 or t.local_batch_size <= 0 or t.steps <= 0:
        raise ValueError(f"training.seq_len, training.local_batch_size and training.steps must be positive "
                         f"(got {t.seq_len}, {t.local_batch_size}, {t.steps})")
    f8 = job_config.quantize.linear.float8
    if "quantize.linear.float8" in job_config.model.converters and f8.recipe_name and f8.enable_fsdp_float8_all_gather:
        raise ValueError(f"quantize.linear.float8.recipe_name={f8.recipe_name!r} cannot be combined with "
                         "enable_fsdp_float8_all_gather=true in torchtitan 0.2.2; unset recipe_name for tensorwise "
                         "scaling with float8 all-gather")
    p = job_config.parallelism
    for key in ("tensor_parallel_degree", "context_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree"):
        if getattr(p, key) != 1:
            raise ValueError(f"parallelism.{key}={getattr(p, key)}: this framework supports FSDP/HSDP only; set it to 1")
