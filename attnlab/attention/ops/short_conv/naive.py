"""The readable reference of the short convolution (the oracle of :mod:`attention.ops.short_conv.triton`).

A causal depthwise 1-D convolution over time with an optional SiLU (fla ``ShortConvolution``, no bias):

    y_t = act(Σ_{j=0}^{K-1} w[:, K-1-j] · x_{t-j})

where an input from before the token's document start (``cu_seqlens``, fla varlen over the flattened ``B*T``
tokens) or before its row's start reads zero, or, in decode, comes from the state of the previous inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.attention.ops.common import position_in_doc

Tensor = torch.Tensor


def naive_short_conv(x: Tensor, weight: Tensor, cu_seqlens: Tensor | None = None, state: Tensor | None = None,
                     activation: bool = True) -> tuple[Tensor, Tensor]:
    """x: [B, T, C]; weight: [C, K] (column ``K-1`` multiplies the current token, ``K-1-j`` lag j);
    cu_seqlens: [N + 1] int32 or None; state: [B, C, K-1] previous inputs (decode) or None (zeros).

    Computes in x's dtype (float64 inputs give the float64 oracle). Returns (y [B, T, C] in x's dtype,
    new_state [B, C, K-1] = the last K-1 inputs, state included). ``cu_seqlens`` and ``state`` are exclusive.
    """
    B, T, C = x.shape
    K = weight.shape[1]
    if state is not None and cu_seqlens is not None:
        raise ValueError("ShortConvolution: packed documents (cu_seqlens) cannot be combined with a decode state")
    xp = _after_state(x, K, state)  # [B, K-1+T, C]
    w = weight.to(x.dtype)
    pos = position_in_doc(cu_seqlens, B, T, x.device) if cu_seqlens is not None else None
    y = xp[:, K - 1:] * w[:, K - 1]
    for lag in range(1, K):
        term = xp[:, K - 1 - lag: K - 1 - lag + T] * w[:, K - 1 - lag]
        if pos is not None:  # a lag reaching before the document start reads zeros
            term = term * (pos >= lag).unsqueeze(-1).to(x.dtype)
        y = y + term
    if activation:
        y = F.silu(y)
    return y, last_inputs(x, K, state)


def last_inputs(x: Tensor, K: int, state: Tensor | None = None) -> Tensor:
    """The decode state after x [B, T, C]: [B, C, K-1], the last K-1 of (``state`` [B, C, K-1], zeros when None,
    followed by x's rows)."""
    if K == 1:
        return x.new_zeros(x.shape[0], x.shape[2], 0)
    return _after_state(x[:, -(K - 1):], K, state)[:, -(K - 1):].transpose(1, 2).contiguous()


def _after_state(x: Tensor, K: int, state: Tensor | None) -> Tensor:
    """[B, K-1+T, C]: the K-1 previous inputs (``state`` [B, C, K-1], zeros when None), then x [B, T, C]."""
    prev = x.new_zeros(x.shape[0], K - 1, x.shape[2]) if state is None else state.transpose(1, 2).to(x.dtype)
    return torch.cat([prev, x], dim=1)
