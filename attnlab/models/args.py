"""Model arguments and flavors: the Parallax paper's Qwen3 sizes (Table 2a, App. F) plus a tiny debug model."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from torchtitan.protocols.train_spec import BaseModelArgs


@dataclass
class ModelArgs(BaseModelArgs):
    INIT_ONLY: ClassVar[tuple[str, ...]] = ("depth_init",)
    """Fields that only set initial weights (the per-layer init std): a resume loads the weights, so it may change
    them (checkpoint.dcp.INIT_ONLY_FIELDS)."""

    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128
    hidden_dim: int = 3072
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_seq_len: int = 4096
    enable_weight_tying: bool = True
    depth_init: bool = True
    attn_mask_type: str = "causal"  # "causal" | "block_causal" (packed documents)
    attention: str = "softmax"
    layer_pattern: list[str] = field(default_factory=list)  # repeated over depth; empty = all `attention`
    attn_impl: str = "auto"
    attention_options: dict[str, Any] = field(default_factory=dict)  # mechanism name -> options dataclass
    custom_import: str = ""  # [experimental] custom_import: the user's module registering a mechanism used here

    def layer_mechanisms(self) -> list[str]:
        """The mechanism of every layer: ``layer_pattern`` repeated over depth, or ``attention`` everywhere."""
        pattern = self.layer_pattern or [self.attention]
        return [pattern[i % len(pattern)] for i in range(self.n_layers)]

    def update_from_config(self, job_config, **kwargs) -> None:
        m, a = job_config.model, job_config.attention
        override_dims(self, m)
        self.max_seq_len = job_config.training.seq_len
        self.attention = m.attention
        self.layer_pattern = list(m.layer_pattern)
        self.attn_mask_type = m.attn_mask_type
        self.attn_impl = a.impl
        self.custom_import = job_config.experimental.custom_import
        if m.vocab_size > 0:
            self.vocab_size = m.vocab_size
        if m.rope_theta > 0:
            self.rope_theta = m.rope_theta
        if m.tie_embeddings is not None:
            self.enable_weight_tying = m.tie_embeddings
        self.attention_options = {name: getattr(a, name) for name in set(self.layer_mechanisms())}
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.n_kv_heads} "
                             f"(flavor {m.flavor!r} with the [model] overrides)")

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Total parameters and training FLOPs per token of a causal row of ``seq_len`` tokens (one document):
        :meth:`training_flops` of ``[seq_len]`` over seq_len. Under ``block_causal`` a step's documents are shorter
        and its attention does less; :meth:`training_flops` of the step's document lengths counts that."""
        nparams = sum(p.numel() for p in model.parameters())
        return nparams, self.training_flops(model, [seq_len]) // seq_len

    def training_flops(self, model: nn.Module, doc_lens: Iterable[int]) -> int:
        """Training (forward + backward) FLOPs of one step over documents of ``doc_lens`` tokens each (a causal
        row of T tokens is one document of T; under ``block_causal`` every document of every row, lengths summing
        to the step's tokens):

        6·(non-embedding parameters + the LM head's V·dim, a real matmul even when tied)·Σ L
        + 3·Σ_layers Σ_documents L·attention.flops_per_token(L)

        (each mechanism counts its own token mixing per document: a causal softmax document of L tokens does
        L·(L+1)/2 query-key pairs).
        """
        lens = Counter(int(n) for n in doc_lens)
        if not lens or min(lens) < 1:
            raise ValueError(f"document lengths must be >= 1, got {sorted(lens)[:5]}")
        nparams = sum(p.numel() for p in model.parameters())
        n_embed = model.tok_embeddings.weight.numel()
        head = self.vocab_size * self.dim
        dense = nparams - n_embed + (head if self.enable_weight_tying else 0)
        tokens = sum(n * c for n, c in lens.items())
        mixing = sum(c * n * layer.attention.flops_per_token(n) for layer in model.layers.values()
                     for n, c in lens.items())
        return 6 * dense * tokens + 3 * mixing


def _flavor(**kw) -> ModelArgs:
    return ModelArgs(**kw)


_06 = dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=3072)
_17 = dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=6144)

FLAVORS: dict[str, ModelArgs] = {
    # ~1.3M parameters with the embedded 4096-token vocabulary: trains visibly on a 2-core CPU in minutes (the embedded default).
    "debug": _flavor(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=384,
                     vocab_size=4096, max_seq_len=256),
    # ~45M parameters, 8k vocabulary: the small-scale replication model (benchmarks/replicate/).
    "repl-45M": _flavor(dim=512, n_layers=12, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=1536,
                        vocab_size=8192, max_seq_len=512),
    # ~68M parameters (softmax; Parallax adds W_R, +4.9M): inside the 50-150M range, same vocabulary.
    "repl-68M": _flavor(dim=640, n_layers=12, n_heads=10, n_kv_heads=5, head_dim=64, hidden_dim=2048,
                        vocab_size=8192, max_seq_len=512),
    "0.6B": _flavor(**_06),
    "0.6B-T24": _flavor(**{**_06, "n_heads": 24}),  # Transformer†: param-matched through more q heads
    "0.6B-P64": _flavor(**{**_06, "head_dim": 64, "hidden_dim": 4480}),  # Parallax†: compute-matched
    "0.6B-ffn3712": _flavor(**{**_06, "hidden_dim": 3712}),  # second param-matched Transformer
    "1.7B": _flavor(**_17),
    "1.7B-T24": _flavor(**{**_17, "n_heads": 24}),
    "1.7B-P64": _flavor(**{**_17, "head_dim": 64, "hidden_dim": 8960}),
    "1.7B-ffn7424": _flavor(**{**_17, "hidden_dim": 7424}),
}


DIMS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim")
"""Size fields ``[model]`` may override on top of the flavor (0 = the flavor's)."""


def override_dims(args: ModelArgs, model_config) -> ModelArgs:
    """Set every :data:`DIMS` field that ``model_config`` (the ``[model]`` section) gives as non-zero."""
    for name in DIMS:
        value = getattr(model_config, name, 0)
        if value:
            setattr(args, name, value)
    return args


def get_flavor(name: str) -> ModelArgs:
    if name not in FLAVORS:
        raise ValueError(f"model.flavor={name!r} is not defined; choose from {list(FLAVORS)}")
    return dataclasses.replace(FLAVORS[name])
