"""Kimi Delta Attention (Kimi Team 2025, "Kimi Linear"): the delta rule with a per-channel decay.

    S_t = S_{t-1} diag(alpha_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t q_t     (docs/mechanisms.md)

Gated DeltaNet with the scalar decay replaced by a vector over the key channels, parameterised as in fla's
``KimiDeltaAttention``: ``log alpha_t = -exp(A_log[h]) * softplus(a_proj(x_t) + dt_bias)`` in R^K per head,
with ``a_proj`` low rank (dim -> head_v_dim -> H*K), ``A ~ U(1, 16)``, ``dt_bias [H*K]`` from the Mamba2
LogUniform(1e-3, 1e-1) init. Output gate low rank with bias (dim -> head_v_dim -> value_dim) and a
*sigmoid* activation: ``RMSNorm(o) * sigmoid(g_proj x)``. Gate projections, ``A_log``, ``dt_bias``, ``b_proj``
and conv kernels go to the Adam group. fla defaults (16 heads x 128, expand_v 1) match Qwen3 0.6B's.

``gate_lower_bound = lb`` in [-5, 0) switches to fla-core 0.6.0's bounded gate
``log alpha_t = lb * sigmoid(exp(A_log[h]) * (a_proj(x_t) + dt_bias))`` in [lb, 0), with ``A_log = 0`` at init
(fla's ``KDAPreTrainedModel._init_weights`` for ``safe_gate``; ``A_init_range`` applies to the softplus gate only).
Every log decay is then >= lb, which licenses fla's ``safe_gate`` chunk kernels (tensor-core dots on the 16x16
diagonal blocks); the chunk and recurrent paths are exact for any gate and ignore the bound.
Not implemented: grouped value heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.deltanet import DeltaNetOptions, DeltaRuleAttention
from attnlab.attention.linear_common import log_gate, reset_A_log_, reset_dt_bias_
from attnlab.attention.ops.delta_rule import check_lower_bound_range
from attnlab.attention.registry import register_attention


@dataclass
class KDAOptions(DeltaNetOptions):
    use_output_gate: bool = True
    """Output = RMSNorm(o) * sigmoid(g_proj x), g_proj low rank (fla KimiDeltaAttention: on)."""
    gate_rank: int = field(default=0, metadata={"valid": ">= 0"})
    """Rank of the low-rank decay and output-gate projections; 0 = head_v_dim (fla)."""
    A_init_range: tuple[float, float] = field(default=(1.0, 16.0), metadata={"valid": "> 0"})
    """A ~ U(low, high), A_log = log A (fla KDA)."""
    dt_min: float = field(default=1e-3, metadata={"valid": "> 0"})
    """dt ~ LogUniform(dt_min, dt_max) initialises dt_bias = softplus^{-1}(dt)."""
    dt_max: float = field(default=0.1, metadata={"valid": "> 0"})
    """Upper end of the dt initialisation range."""
    gate_lower_bound: float | None = field(default=None, metadata={"valid": "in [-5, 0)"})
    """None = the paper's softplus gate -exp(A_log) * softplus(a + dt_bias); a value in [-5, 0) = fla's bounded
    gate lb * sigmoid(exp(A_log) * (a + dt_bias)), which lets fla's KDA forward use tensor cores on the diagonal
    blocks (safe_gate); our backward kernel (``attnlab/attention/ops/delta_rule/triton/kda_intra.py``) does so for
    either gate, so the two gates cost about the same."""


@register_attention("kda", options=KDAOptions,
                    description="Kimi Delta Attention: delta rule with a per-channel (column-wise) decay")
class KDAAttention(DeltaRuleAttention):
    """Kimi Delta Attention layer (fla ``KimiDeltaAttention`` parameterisation)."""

    gate_activation = "sigmoid"

    def __init__(self, args, opts: KDAOptions):
        lb = opts.gate_lower_bound
        if lb is not None:
            check_lower_bound_range(lb, "attention.kda.gate_lower_bound")
        super().__init__(args, opts)
        self.gate_lower_bound = None if lb is None else float(lb)  # TOML's -5 is an int
        H, K = self.n_heads, self.head_k_dim
        r = self.rank
        self.a_proj = nn.Sequential(nn.Linear(args.dim, r, bias=False), nn.Linear(r, H * K, bias=False))
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.param_roles.update(a_proj="vector", A_log="vector", dt_bias="vector")
        if self.g_proj is not None:
            self.param_roles["g_proj"] = "vector"  # low-rank output gate: thin factors, not hidden matrices

    @property
    def rank(self) -> int:
        return self.opts.gate_rank or self.head_v_dim

    def build_output_gate(self) -> nn.Module:
        return nn.Sequential(nn.Linear(self.args.dim, self.rank, bias=False),
                             nn.Linear(self.rank, self.value_dim, bias=True))

    def reset_gate_parameters(self) -> None:
        for lin in self.a_proj:
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        if self.gate_lower_bound is None:
            reset_A_log_(self.A_log, *self.opts.A_init_range)
        else:  # A = 1 (fla): sigmoid(A * dt_bias) in [1e-3, 0.1]; A ~ U(1, 16) can underflow it to 0 (no decay, no grad)
            nn.init.zeros_(self.A_log)
        reset_dt_bias_(self.dt_bias, self.opts.dt_min, self.opts.dt_max)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_k_dim
        a = self.a_proj(x).view(B, T, H, K)
        # [B, T, H, K] float32, <= 0 (in [gate_lower_bound, 0) when set)
        return log_gate(a, self.A_log[:, None], self.dt_bias.view(H, K), self.gate_lower_bound)
