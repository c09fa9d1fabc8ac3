"""Parallax attention (Zuo et al., 2026): softmax attention plus a learned probe of the KV covariance.

    o_i = v̄_i − Σ_KV(i) ρ_i,   ρ_i = RMSNorm(W_R x_i) per q head   (eq. 8; docs/mechanisms.md)

Departures from softmax attention: one more projection ``wr`` (q's shape and head grouping), an RMSNorm
``r_norm`` on ρ, optional RoPE on ρ (same positions and θ as q, k), an optional sigmoid gate per head
``ρ_i = σ(w_g·x_i)·W_R x_i`` (Section 4.3). With ``W_R = 0`` the output is exactly softmax attention, so a
Transformer checkpoint converts by adding a zero ``wr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.base import AttentionArgs, AttentionContext, apply_rope
from attnlab.attention.registry import register_attention
from attnlab.attention.softmax import SoftmaxAttention, SoftmaxOptions


@dataclass
class ParallaxOptions(SoftmaxOptions):
    INIT_ONLY: ClassVar[tuple[str, ...]] = ("wr_init", "rho_norm_init", "rho_gate_bias")
    """Options that only set initial weights (W_R, ρ's RMSNorm gain, the gate's bias): a resume loads those
    weights, so it may change them (checkpoint.dcp.INIT_ONLY_FIELDS)."""

    rope_on_rho: bool = True
    """Apply RoPE to ρ (the paper's best 0.6B/1.7B setting)."""
    rho_gate: bool = False
    """Sigmoid gate per token and head on ρ (Section 4.3)."""
    rho_gate_bias: float = field(default=0.0, metadata={"valid": "any: a bias; σ(bias) is the initial gate"})
    """Initial bias of the gate (σ(bias) is the initial gate value)."""
    wr_init: str = field(default="normal", metadata={"valid": "one of normal, zero"})
    """Initialisation of W_R: "normal" (like W_Q, std 0.02) or "zero" (starts as softmax attention)."""
    rho_norm_init: float = field(default=0.1, metadata={"valid": ">= 0"})
    """Starting gain g of ρ's RMSNorm (``r_norm.weight``, every entry), ≥ 0. ρ is RMS-normalised per head, so
    at init ‖ρ_i‖ = √head_dim · g whatever W_R's scale (0 when W_R x = 0). The correction Σ_KV ρ is linear in g,
    so g sets its starting size relative to the softmax output (COR, eq. 16); g = 0 makes ρ = 0 (softmax
    attention) until the gain itself learns. The paper applies an RMSNorm to ρ (Section 4.2, Appendix F.1) with
    the norm lr multiplier 0.015× under Muon (Table 2b) and does not state the gain's init: 1.0 (RMSNorm's
    default) is the paper's recipe as written. 0.1 by default: the starting correction is a tenth of the
    paper's; benchmarks/README.md, "Parallax at small scale", has the runs that chose it."""


@register_attention("parallax", options=ParallaxOptions, description="Parallax: softmax attention + learned covariance probe ρ (W_R=0 is softmax)")
class ParallaxAttention(SoftmaxAttention):
    """Softmax attention with a learned probe ρ = RMSNorm(W_R x) (optionally gated and RoPE'd)."""

    def __init__(self, args: AttentionArgs, opts: ParallaxOptions):
        super().__init__(args, opts)
        if opts.wr_init not in ("normal", "zero"):
            raise ValueError(f"attention.parallax.wr_init={opts.wr_init!r}; choose from ['normal', 'zero']")
        if not (math.isfinite(opts.rho_norm_init) and opts.rho_norm_init >= 0):
            raise ValueError(f"attention.parallax.rho_norm_init={opts.rho_norm_init!r}; must be a finite number >= 0")
        self.wr = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.r_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.r_gate = nn.Linear(args.dim, args.n_heads, bias=True) if opts.rho_gate else None

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        if self.opts.wr_init == "zero":
            nn.init.zeros_(self.wr.weight)
        else:
            trunc_normal_(self.wr.weight, mean=0.0, std=0.02)
        nn.init.constant_(self.r_norm.weight, self.opts.rho_norm_init)
        if self.r_gate is not None:
            trunc_normal_(self.r_gate.weight, mean=0.0, std=0.02)
            nn.init.constant_(self.r_gate.bias, self.opts.rho_gate_bias)

    def probe(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """ρ: [B, T, HQ, D]."""
        B, T, _ = x.shape
        r = self.r_norm(self.wr(x).view(B, T, -1, self.head_dim))
        if self.r_gate is not None:
            r = r * torch.sigmoid(self.r_gate(x)).unsqueeze(-1).to(r.dtype)
        if self.opts.rope_on_rho:
            cos, sin = ctx.rope(self.head_dim)
            r = apply_rope(r, cos, sin)
        return r

    def flops_per_token(self, seq_len: int) -> int:
        # Two more GEMMs per tile (ρ·k and p∘t · v): twice softmax's mixing FLOPs (Parallax eq. 15).
        return 2 * super().flops_per_token(seq_len)
