"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule").

    S_t = gamma_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t q_t     (Variants eq. 24)

DeltaNet (``deltanet.py``) plus a scalar decay per head and token, parameterised as in Mamba2 and fla's
``GatedDeltaNet`` layer: ``log gamma_t = -exp(A_log) * softplus(a_proj x_t + dt_bias)`` with
``A ~ U(0, 16)``, ``dt ~ LogUniform(1e-3, 1e-1)`` (``dt_bias = softplus^{-1}(dt)``). Output:
``RMSNorm(o) * swish(g_proj x)`` then ``o_proj``. ``A_log``, ``dt_bias``, ``a_proj``, ``b_proj`` and the conv
kernels have the role "vector" (``param_roles``, :mod:`optim.groups`): not hidden matrices, so never Muon's.

Departures from fla's layer defaults (head_dim 256, 6 heads, expand_v 2): heads and head dim default to the
model's (Qwen3 0.6B: 16 x 128) with expand_v 1, keeping the parameter count near softmax attention's; all
are configurable in ``[attention.gdn]``. Grouped value heads (GVA) are not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.deltanet import DeltaNetOptions, DeltaRuleAttention
from attnlab.attention.linear_common import log_gate, reset_A_log_, reset_dt_bias_
from attnlab.attention.registry import register_attention


@dataclass
class GatedDeltaNetOptions(DeltaNetOptions):
    use_output_gate: bool = True
    """Output = RMSNorm(o) * swish(g_proj x) (fla GatedDeltaNet: on)."""
    A_init_range: tuple[float, float] = field(default=(0.0, 16.0), metadata={"valid": ">= 0"})
    """A ~ U(low, high), A_log = log A (Mamba2 / fla)."""
    dt_min: float = field(default=1e-3, metadata={"valid": "> 0"})
    """dt ~ LogUniform(dt_min, dt_max) initialises dt_bias = softplus^{-1}(dt)."""
    dt_max: float = field(default=0.1, metadata={"valid": "> 0"})
    """Upper end of the dt initialisation range."""


@register_attention("gdn", options=GatedDeltaNetOptions,
                    description="Gated DeltaNet: delta rule with a scalar Mamba2-style decay per head")
class GatedDeltaNetAttention(DeltaRuleAttention):
    """Gated DeltaNet layer (fla ``GatedDeltaNet`` parameterisation)."""

    def __init__(self, args, opts: GatedDeltaNetOptions):
        super().__init__(args, opts)
        H = self.n_heads
        self.a_proj = nn.Linear(args.dim, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.param_roles.update(a_proj="vector", A_log="vector", dt_bias="vector")

    def reset_gate_parameters(self) -> None:
        trunc_normal_(self.a_proj.weight, mean=0.0, std=0.02)
        reset_A_log_(self.A_log, *self.opts.A_init_range)
        reset_dt_bias_(self.dt_bias, self.opts.dt_min, self.opts.dt_max)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        return log_gate(self.a_proj(x), self.A_log, self.dt_bias)  # [B, T, H] float32, <= 0
