"""Plain (ungated) linear attention (Katharopoulos et al., 2020; Variants eqs. 2-3).

    h_t = h_{t-1} + φ(k_t) v_t^T,   o_t = h_t^T φ(q_t) / sqrt(K)    [ / (φ(q_t)^T z_t) with normalize ]

Defaults follow fla's ``LinearAttention`` layer: feature map elu(x)+1, no denominator, per-head output
RMSNorm. ``normalize = true`` restores the paper's denominator ``φ(q_t)^T Σ_{i<=t} φ(k_i)`` (computed by
appending a ones column to v, so the same kernels and the same decode state carry the normaliser).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F

from attnlab.attention.base import AttentionArgs
from attnlab.attention.gla import LinearFamilyAttention
from attnlab.attention.registry import register_attention

FEATURE_MAPS = ("elu", "relu", "silu", "identity")
OUTPUT_NORMS = ("rmsnorm", "none")


@dataclass
class LinearOptions:
    feature_map: str = field(default="elu", metadata={"valid": "one of elu, relu, silu, identity"})
    """φ applied to q and k: "elu" (elu(x)+1, the paper's), "relu", "silu" or "identity"."""
    normalize: bool = False
    """Divide by φ(q_t)·Σφ(k_i) (Katharopoulos). Needs a positive feature map ("elu" or "relu")."""
    output_norm: str = field(default="rmsnorm", metadata={"valid": "one of rmsnorm, none"})
    """Per-head output normalisation: "rmsnorm" (fla default) or "none"."""
    output_gate: bool = False
    """Multiply the output by swish(W_g x) (GLA-style output gate)."""
    use_short_conv: bool = False
    """Causal depthwise conv + SiLU on q, k, v (before the feature map)."""
    conv_size: int = field(default=4, metadata={"valid": ">= 1"})
    """Kernel size of the short convolutions."""
    chunk_size: int = field(default=64, metadata={"valid": "a power of 2"})
    """Chunk length of the chunked paths (a power of 2; 16-128 for the Triton kernel)."""


@register_attention("linear", options=LinearOptions, description="linear attention (Katharopoulos) with feature map / normaliser options")
class LinearAttention(LinearFamilyAttention):
    """Ungated linear attention with a feature map, optional denominator and output norm."""

    def __init__(self, args: AttentionArgs, opts: LinearOptions):
        super().__init__()
        if opts.feature_map not in FEATURE_MAPS:
            raise ValueError(f"attention.linear.feature_map={opts.feature_map!r}; choose from {list(FEATURE_MAPS)}")
        if opts.output_norm not in OUTPUT_NORMS:
            raise ValueError(f"attention.linear.output_norm={opts.output_norm!r}; choose from {list(OUTPUT_NORMS)}")
        if opts.normalize and opts.feature_map not in ("elu", "relu"):
            raise ValueError(f"attention.linear.normalize=true needs a positive feature_map ('elu' or 'relu'), got {opts.feature_map!r}")
        self.normalize = opts.normalize
        self._build(args, opts, args.head_dim, output_norm=opts.output_norm == "rmsnorm", output_gate=opts.output_gate)

    def feature_map(self, q, k):
        fm = self.opts.feature_map
        if fm == "elu":
            return F.elu(q) + 1, F.elu(k) + 1
        if fm == "relu":
            return F.relu(q), F.relu(k)
        if fm == "silu":
            return F.silu(q), F.silu(k)
        return q, k

    def gates(self, x):
        return None, None
