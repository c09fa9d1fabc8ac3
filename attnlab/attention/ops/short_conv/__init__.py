"""The short convolution of the linear family (GDN, KDA, DeltaNet, GLA, PaTH): one public op.

``short_conv(x, weight, cu_seqlens=None, state=None, activation=True, impl=...)`` computes the causal depthwise
convolution ``y_t = act(Σ_{j<K} w[:, K-1-j] · x_{t-j})`` with zeros before each document (``cu_seqlens``) or
row start, or the decode state's inputs. ``impl``:

- "reference": :func:`naive_short_conv` (readable PyTorch, float64-capable, the oracle; decode with a state);
- "triton":    :mod:`attention.ops.short_conv.triton` (a forward and two backward kernels, as ops);
- "auto":      "triton" for a CUDA tensor in fp32 / bf16 / fp16 without a decode state, else "reference".

Returns (y [B, T, C], new_state [B, C, K-1] = the last K-1 inputs, state included).
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.short_conv.naive import last_inputs, naive_short_conv

IMPLS = ("auto", "reference", "triton")

__all__ = ["short_conv", "naive_short_conv", "IMPLS"]

Tensor = torch.Tensor

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_impl(impl: str, x: Tensor, state: Tensor | None) -> str:
    check_impl(impl, IMPLS, "short convolution")
    if impl == "auto":
        return "triton" if x.is_cuda and state is None and x.dtype in _KERNEL_DTYPES else "reference"
    if impl == "triton" and state is not None:
        raise ValueError("short_conv: impl='triton' has no decode state; use 'reference' or 'auto'")
    return impl


def short_conv(x: Tensor, weight: Tensor, cu_seqlens: Tensor | None = None, state: Tensor | None = None,
               activation: bool = True, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """x: [B, T, C]; weight: [C, K]; cu_seqlens: [N + 1] int32 (fla varlen over B*T) or None;
    state: [B, C, K-1] or None. Returns (y [B, T, C] in x's dtype, new_state [B, C, K-1])."""
    if resolve_impl(impl, x, state) == "reference":
        return naive_short_conv(x, weight, cu_seqlens, state, activation)
    from attnlab.attention.ops.short_conv.triton import short_conv_fwd

    y = short_conv_fwd(x, weight, None if cu_seqlens is None else cu_seqlens.to(torch.int32), activation)
    return y, last_inputs(x, weight.shape[1])
