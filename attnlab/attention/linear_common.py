"""Shared pieces of the linear-attention family (delta rule, GLA, gated/plain linear attention, ...).

What is here, and where it comes from (fla-core 0.6.0's layers; docs/mechanisms.md, "The linear family"):

- :class:`ShortConvolution`: causal depthwise conv (kernel 4) + SiLU on q/k/v (fla ``ShortConvolution``),
  respecting packed-document boundaries and carrying a decode state of the last ``kernel_size - 1`` inputs.
- :class:`GatedRMSNorm`: ``RMSNorm(o) * act(g)`` per head (fla ``FusedRMSNormGated``; swish or sigmoid).
- :func:`l2norm`: ``x / sqrt(sum x^2 + eps)`` (fla's eps 1e-6 inside the sqrt).
- The Mamba2-style log-gate ``log γ = -exp(A_log) * softplus(a + dt_bias)`` (:func:`log_gate`; with
  ``lower_bound``, fla's bounded KDA gate ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``) and the
  initialisers of ``A_log`` (:func:`reset_A_log_`) and ``dt_bias`` (:func:`reset_dt_bias_`), which draw the whole
  tensor and write it through :func:`attention.base.copy_full_` (FSDP-sharded parameters included).
- :class:`RecurrentCache`: per-layer decode cache (conv states + recurrent state).

The ``impl`` vocabulary, the fla-core gate, the document helpers and the fallback notices every op shares are in
:mod:`attention.ops.common`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.attention.base import copy_full_
from attnlab.attention.ops.short_conv import short_conv


# ----------------------------------------------------------------------------------------------- helpers
def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 tensors (tests), float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)``, computed in float32 (or float64), returned in x's dtype."""
    xf = x.to(acc_dtype(x))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def log_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
             lower_bound: float | None = None) -> torch.Tensor:
    """Mamba2/GDN/KDA log-space decay ``-exp(A_log) * softplus(a + dt_bias)`` in float32 (always <= 0;
    float64 for float64 ``a``). With ``lower_bound``: fla-core 0.6.0's bounded KDA gate (``safe_gate``)
    ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``, in [lower_bound, 0).

    a: [..., H] (or [..., H, K]); A_log broadcasts against a's last dims ([H] or [H, 1]); dt_bias like a's
    last dims ([H] or [H, K]).
    """
    acc = acc_dtype(a)
    a = a.to(acc)
    if dt_bias is not None:
        a = a + dt_bias.to(acc)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(torch.exp(A_log.to(acc)) * a)
    return -torch.exp(A_log.to(acc)) * F.softplus(a)


@torch.no_grad()
def reset_A_log_(p: torch.Tensor, low: float = 0.0, high: float = 16.0) -> None:
    """``A ~ U(low, high)``, ``A_log = log A`` (GDN: U(0,16); KDA: U(1,16)). Clamped away from A = 0."""
    A = torch.empty(p.shape, dtype=torch.float32, device=p.device).uniform_(low, high).clamp_min_(1e-4)
    copy_full_(p, torch.log(A))


@torch.no_grad()
def reset_dt_bias_(p: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4) -> None:
    """``dt ~ LogUniform(dt_min, dt_max)`` clamped >= dt_floor; ``dt_bias = softplus^{-1}(dt)`` (Mamba2)."""
    u = torch.rand(p.shape, dtype=torch.float32, device=p.device)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp_min_(dt_floor)
    copy_full_(p, dt + torch.log(-torch.expm1(-dt)))


def linear_recurrence_cp(run, v: torch.Tensor, key_dim: int, ctx) -> torch.Tensor:
    """A recurrence over a [K, V] state per head that is linear in the state column by column (h ← A_t h + k_t v_tᵀ,
    A_t any decay: none, per head, per key channel) over this rank's two chunks under context parallelism
    (``ctx.cp``, :mod:`attention.cp`; the delta rule's :meth:`attention.deltanet.DeltaRuleAttention._mix_cp` is
    the same algorithm with A_t = (I − β_t k_t k_tᵀ) D_t).

    ``run(v, initial_state, output_final_state, cu_seqlens)``: the mechanism's kernel over the local chunks
    flattened into one row (its other token-wise inputs flattened to [1, B·2c, ...] likewise), v [1, B·2c, H, V'],
    initial_state [S, H, K, V'] (one per segment), returning (o [1, B·2c, H, V'], final state [S, H, K, V'] or None).
    ``v``: [B, 2c, H, V]; ``key_dim``: K. Returns o [B, 2c, H, V].

    A chunk maps the state entering it to M h + B; the kernel started from [0 | I] with values [v | 0] ends at
    [B | M]. :meth:`attention.cp.ContextParallel.states_entering` all-gathers every chunk's map and composes the
    states entering this rank's chunks, from which the chunks run (documents inside a chunk are the kernel's
    segments, :meth:`attention.cp.ContextParallel.chunk_segments`)."""
    cp = ctx.cp
    B, L, H, V = v.shape
    K = key_dim
    seg = ctx.cp_segments.chunk_segments()
    segments, acc = seg.cu_seqlens.numel() - 1, acc_dtype(v)
    h0 = torch.zeros(segments, H, K, V + K, device=v.device, dtype=acc)
    h0[seg.first, :, :, V:] = torch.eye(K, device=v.device, dtype=acc)
    v_ext = torch.cat([v, v.new_zeros(B, L, H, K)], -1).reshape(1, B * L, H, V + K)
    _, final = run(v_ext, h0, True, seg.cu_seqlens)
    entering = cp.states_entering(final[seg.last].view(B, 2, H, K, V + K), seg.continues)  # [B, 2, H, K, V]
    h_in = torch.zeros(segments, H, K, V, device=v.device, dtype=entering.dtype).index_put(
        (seg.first,), entering.reshape(B * 2, H, K, V))
    o, _ = run(v.reshape(1, B * L, H, V), h_in, False, seg.cu_seqlens)
    return o.view(B, L, H, V)


# ----------------------------------------------------------------------------------------------- cache
@dataclass
class RecurrentCache:
    """Decode cache of one linear-attention layer.

    conv:  name -> [B, C, kernel_size - 1] last inputs of each short convolution (zeros at the start).
    state: [B, H, K, V] float32 recurrent state (fla layout ``h = S^T``), or None before the first token.
    extra: free slots for mechanism-specific state (e.g. normaliser, key cache).
    seen:  number of tokens already processed.
    """

    conv: dict[str, torch.Tensor] = field(default_factory=dict)
    state: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    seen: int = 0


# ----------------------------------------------------------------------------------------------- modules
class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time with optional SiLU (fla ``ShortConvolution``, no bias).

    ``y_t = act(sum_{j=0}^{K-1} w[:, K-1-j] * x_{t-j})``, where inputs from before the token's document
    start (``cu_seqlens``) or before the sequence start count as zero, or come from the decode state.

    weight: [C, kernel_size] (``kernel_size - 1`` is the oldest lag); role "vector" (not a hidden matrix).
    """

    param_roles = {"weight": "vector"}

    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu"):
        super().__init__()
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"ShortConvolution activation={activation!r}; choose from [None, 'silu', 'swish']")
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # nn.Conv1d's default (kaiming_uniform a=sqrt(5)) for a depthwise kernel: U(-1/sqrt(K), 1/sqrt(K)).
        bound = 1.0 / math.sqrt(self.kernel_size)
        self.weight.uniform_(-bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, C]; state: [B, C, K-1] previous inputs (decode) or None (zeros).

        Returns (y [B, T, C], new_state [B, C, K-1] = the last K-1 inputs, state included).
        ``cu_seqlens`` (fla varlen over B*T) and ``state`` are mutually exclusive. CUDA tensors without a state
        run the Triton kernels (:mod:`attention.ops.short_conv`); CPU, float64 and decode run the reference.
        """
        return short_conv(x, self.weight, cu_seqlens, state, self.activation is not None)

    @property
    def cp_halo_width(self) -> int:
        """Inputs of history :meth:`forward_cp` puts before each chunk (``BatchSegments.halo_segments``' width)."""
        return self.kernel_size - 1

    def forward_cp(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """The convolution of this rank's two chunks x [B, 2c, C] under context parallelism (``ctx.cp``,
        :mod:`attention.cp`): each chunk extended by the K − 1 inputs before it in the row
        (:meth:`attention.cp.ContextParallel.halo`), which count only where they belong to the same document
        (:meth:`attention.cp.ContextParallel.halo_segments`). Returns y [B, 2c, C]."""
        B, L, C = x.shape
        c, k1 = L // 2, self.kernel_size - 1
        ext = ctx.cp.halo(x, k1)  # [B, 2, K-1+c, C]
        cu = ctx.cp_segments.halo_segments(k1)
        y, _ = self(ext.reshape(1, 2 * B * (k1 + c), C), cu_seqlens=cu)
        return y.view(B, 2, k1 + c, C)[:, :, k1:].reshape(B, L, C)

    def init_state(self, batch_size: int, device, dtype) -> torch.Tensor:
        return torch.zeros(batch_size, self.channels, self.kernel_size - 1, device=device, dtype=dtype)


class GatedRMSNorm(nn.Module):
    """``RMSNorm(x) * weight * act(g)`` over the last dim (fla ``FusedRMSNormGated``), float32 inside
    (float64 for float64 x).

    x, g: [..., D]; activation "swish" (GDN, DeltaNet) or "sigmoid" (KDA).
    """

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "swish"):
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"output gate activation={activation!r}; choose from ['swish', 'sigmoid']")
        self.dim, self.eps, self.activation = dim, eps, activation
        self.weight = nn.Parameter(torch.ones(dim))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        acc = acc_dtype(x)
        xf = x.to(acc)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(acc)
        if g is not None:
            gf = g.to(acc)
            y = y * (torch.sigmoid(gf) if self.activation == "sigmoid" else F.silu(gf))
        return y.to(x.dtype)
