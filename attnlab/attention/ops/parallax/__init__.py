"""Public entry for the softmax/Parallax attention family: one function, several implementations.

``parallax_attention(q, k, v, r=None, ...)`` computes Parallax when a probe ``r`` is given and plain
softmax attention when it is None. ``impl`` selects the implementation:

- "reference": :func:`naive_parallax` (PyTorch, O(T²) memory, any device);
- "triton":    the streaming Triton kernels (``attnlab/attention/ops/parallax/triton``) when present;
- "auto":      Triton on CUDA when the kernels are available and take the head dim and dtype, else the
               reference (e.g. head dim 8 in tiny test models: ``tl.dot`` needs K ≥ 16).
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.parallax.naive import naive_parallax, naive_parallax_decode

IMPLS = ("auto", "reference", "triton")


def _kernels():
    """The Triton package (``attention.ops.parallax.triton``), or None where Triton does not import."""
    try:
        from attnlab.attention.ops.parallax import triton as kernels
    except ImportError:
        return None
    return kernels


def _triton_impl():
    k = _kernels()
    return None if k is None else k.parallax_triton


def resolve_impl(impl: str, q: torch.Tensor) -> str:
    """The implementation that runs for query ``q`` [B, T, HQ, D] (its device, head dim and dtype)."""
    check_impl(impl, IMPLS, "softmax/parallax")
    if impl == "auto":
        k = _kernels() if q.is_cuda else None
        return "triton" if k is not None and k.supports(q) else "reference"
    if impl == "triton" and _triton_impl() is None:
        raise ValueError("attention.impl='triton' but the Triton kernels are not available in this build")
    return impl


def parallax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
    window_size: int | None = None,
    impl: str = "auto",
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int = 0,
) -> torch.Tensor:
    """Causal softmax (r=None) or Parallax attention. Shapes as in :func:`naive_parallax`:
    q, r: [B, T, HQ, D]; k, v: [B, T, HKV, D]; returns [B, T, HQ, D].
    cu_seqlens_k (with cu_seqlens; max_seqlen_k its longest segment, 0: computed): query offsets for context
    parallelism, k, v then hold key segments of their own, each query segment aligned to the end of its key
    segment (bottom-right causal; ``parallax_triton``'s docstring)."""
    if resolve_impl(impl, q) == "reference":
        return naive_parallax(q, k, v, r, scale=scale, cu_seqlens=cu_seqlens, window_size=window_size,
                              cu_seqlens_k=cu_seqlens_k)
    return _triton_impl()(q, k, v, r, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                          window_size=window_size, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)


def parallax_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    r: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Decode step against a KV cache that already holds the TQ new tokens (softmax when r is None).
    q, r: [B, TQ, HQ, D]; k_cache, v_cache: [B, LMAX, HKV, D]; cache_seqlens: [B] int32 valid tokens per row;
    returns [B, TQ, HQ, D]. The Triton path splits the cache length (CUDA-graph capturable)."""
    if resolve_impl(impl, q) == "reference":
        return naive_parallax_decode(q, k_cache, v_cache, cache_seqlens, r, scale=scale, window_size=window_size)
    return _kernels().parallax_decode_triton(q, k_cache, v_cache, cache_seqlens, r, scale=scale,
                                             window_size=window_size)
