"""Scalar-gated linear attention (Mamba2 / RetNet / "simple GLA" style; Variants eq. 18).

    h_t = γ_t h_{t-1} + k_t v_t^T,   o_t = h_t^T q_t / sqrt(K),   one γ_t ∈ (0, 1) per head and token

Gate parameterisations (``[attention.gated_linear] gate``):
- "mamba2" (default): log γ = −exp(A_log) · softplus(W_a x + dt_bias), A ~ U(1, 16), dt ~ LogU(1e-3, 0.1)
  (Mamba2; the same gate fla reuses for GDN/KDA);
- "logsigmoid": log γ = logsigmoid(W_g x + b) / 16 (fla ``SimpleGatedLinearAttention``);
- "retnet": fixed γ_h = 1 − 2^(−5−h) per head (RetNet multi-scale retention, data-independent).
Short convs on q/k/v (Mamba2 style, on by default), output RMSNorm · swish(W_g x).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.base import AttentionArgs
from attnlab.attention.gla import LinearFamilyAttention
from attnlab.attention.linear_common import log_gate, reset_A_log_, reset_dt_bias_
from attnlab.attention.registry import register_attention

GATES = ("mamba2", "logsigmoid", "retnet")


@dataclass
class GatedLinearOptions:
    gate: str = field(default="mamba2", metadata={"valid": "one of mamba2, logsigmoid, retnet"})
    """Forget-gate parameterisation: "mamba2" (A_log/dt_bias), "logsigmoid" (fla simple GLA) or "retnet" (fixed)."""
    gate_logit_normalizer: float = field(default=16.0, metadata={"valid": "> 0"})
    """For gate="logsigmoid": log γ = logsigmoid(W_g x + b) / gate_logit_normalizer (fla: 16)."""
    expand_k: float = field(default=1.0, metadata={"valid": "> 0"})
    """Key head dim = expand_k · head_dim."""
    use_short_conv: bool = True
    """Causal depthwise conv + SiLU on q, k, v (Mamba2 style)."""
    conv_size: int = field(default=4, metadata={"valid": ">= 1"})
    """Kernel size of the short convolutions."""
    output_gate: bool = True
    """Output RMSNorm(o) · swish(W_g x); off leaves the plain per-head RMSNorm."""
    chunk_size: int = field(default=64, metadata={"valid": "a power of 2"})
    """Chunk length of the chunked paths (a power of 2; 16-128 for the Triton kernel)."""


@register_attention("gated_linear", options=GatedLinearOptions, description="scalar-gated linear attention (Mamba2 / RetNet / simple GLA gates)")
class GatedLinearAttention(LinearFamilyAttention):
    """Linear attention with one data-dependent (or fixed) decay per head and token."""

    def __init__(self, args: AttentionArgs, opts: GatedLinearOptions):
        super().__init__()
        if opts.gate not in GATES:
            raise ValueError(f"attention.gated_linear.gate={opts.gate!r}; choose from {list(GATES)}")
        self._build(args, opts, int(args.head_dim * opts.expand_k), output_norm=True, output_gate=opts.output_gate)
        H = self.n_heads
        self.a_proj = nn.Linear(args.dim, H, bias=opts.gate == "logsigmoid") if opts.gate != "retnet" else None
        if opts.gate == "mamba2":
            self.A_log = nn.Parameter(torch.empty(H))
            self.dt_bias = nn.Parameter(torch.empty(H))
        if opts.gate == "retnet":
            self.register_buffer("log_gamma", torch.empty(H), persistent=False)
        # the gate's parameters are not hidden matrices (optim.groups)
        self.param_roles = {"a_proj": "vector"} if self.a_proj is not None else {}
        if opts.gate == "mamba2":
            self.param_roles.update(A_log="vector", dt_bias="vector")

    def _init_extra(self) -> None:
        if self.a_proj is not None:
            trunc_normal_(self.a_proj.weight, mean=0.0, std=0.02)
            if self.a_proj.bias is not None:
                nn.init.zeros_(self.a_proj.bias)
        if self.opts.gate == "mamba2":
            reset_A_log_(self.A_log, 1.0, 16.0)
            reset_dt_bias_(self.dt_bias)
        if self.opts.gate == "retnet":
            h = torch.arange(self.n_heads, dtype=torch.float32)
            self.log_gamma.copy_(torch.log1p(-torch.exp2(-5.0 - h)))

    def gates(self, x):
        B, T, _ = x.shape
        if self.opts.gate == "mamba2":
            g = log_gate(self.a_proj(x), self.A_log, self.dt_bias)
        elif self.opts.gate == "logsigmoid":
            g = F.logsigmoid(self.a_proj(x).float()) / self.opts.gate_logit_normalizer
        else:
            g = self.log_gamma.float().expand(B, T, self.n_heads)
        return g, None
