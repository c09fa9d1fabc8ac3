"""Triton kernels for causal softmax and Parallax attention: training forward/backward and decode.

One streaming kernel family (FlashAttention-2 style, online softmax in exp2, Dao 2023) with a constexpr
probe branch: with ``r`` it computes Parallax (two extra accumulators d2, O2 on the same K/V tiles, Parallax
paper eq. 14), without it the same source compiles to plain softmax attention. GQA without repeated
K/V, packed documents (fla's ``cu_seqlens``), sliding windows, head dims 16–256 (powers of two), any T.

- :func:`parallax_triton`: training op with autograd (custom ops ``attnlab::parallax_fwd``/``parallax_bwd`` where
  ``torch.compile`` or a dispatch mode must see them, ``ops.attend``).
- :func:`parallax_decode_triton`: new tokens against a fixed-shape KV cache, split over the cache length; a second
  kernel merges the partials (a programmatic dependent launch on Hopper), or with ``merge="fused"`` the last split
  program of each row does (``decode.py``).

Layout follows Tri Dao's FlashAttention-2 and the Triton fused-attention tutorial; the probe branch follows
the authors' description (Zuo et al., 2026, Algorithm 1 and Appendix C/D).
"""

from __future__ import annotations

import torch

from attention.ops.parallax.triton import ops as _ops
from attention.ops.parallax.triton.ops import decode_splits, parallax_bwd, parallax_decode_op, parallax_fwd

__all__ = ["parallax_triton", "parallax_decode_triton", "parallax_fwd", "parallax_bwd", "decode_splits"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


HEAD_DIMS = (16, 32, 64, 128, 256)


def autotuned_kernels() -> dict:
    """The training kernels' Triton autotuners by pass ("fwd", "dq", "dkv"), for tools that report the autotuner's
    pick per key (``.cache``) or compile candidates offline (``.fn``)."""
    from attention.ops.parallax.triton import bwd, fwd

    return {"fwd": fwd._parallax_fwd_kernel, "dq": bwd._parallax_bwd_dq_kernel, "dkv": bwd._parallax_bwd_dkv_kernel}


def supports(q: torch.Tensor) -> bool:
    """Whether the kernels take this query's head dim and dtype (``impl="auto"`` falls back otherwise)."""
    return q.shape[-1] in HEAD_DIMS and q.dtype in _DTYPES


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor | None) -> None:
    D = q.shape[-1]
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B, T, HQ, D], k = v [B, T, HKV, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if D not in HEAD_DIMS or k.shape[-1] != D:
        raise ValueError(f"head dim {D} (k: {k.shape[-1]}) not supported by the Triton kernels; use 16, 32, 64, 128 "
                         f"or 256, or attention.impl='reference'")
    dtypes = {t.dtype for t in (q, k, v) + ((r,) if r is not None else ())}
    if len(dtypes) != 1 or q.dtype not in _DTYPES:
        raise ValueError(f"q, k, v, r must share one dtype of {_DTYPES}; got {sorted(map(str, dtypes))}")
    if r is not None and r.shape != q.shape:
        raise ValueError(f"r must have q's shape {tuple(q.shape)}; got {tuple(r.shape)}")


def parallax_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
    window_size: int | None = None,
) -> torch.Tensor:
    """Causal Parallax (``r`` given) or softmax (``r=None``) attention, differentiable in q, k, v, r.

    q, r: [B, T, HQ, D]; k, v: [B, T, HKV, D] (HQ % HKV == 0), one dtype of fp16/bf16/fp32 (fp32 accumulation).
    cu_seqlens: [N+1] int32 document offsets over the flattened B*T tokens, or None; max_seqlen: the longest
    document (computed, with a host sync, when 0). window_size: each query sees at most this many most
    recent keys, itself included (None/0: full causal). scale: applied to q·k only; default D**-0.5.
    Returns o: [B, T, HQ, D] in q's dtype.
    """
    _check(q, k, v, r)
    B, T, HQ, D = q.shape
    scale = D**-0.5 if scale is None else float(scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    r = r.contiguous() if r is not None else None
    if cu_seqlens is not None:
        q, k, v = (t.reshape(1, B * T, t.shape[2], D) for t in (q, k, v))
        r = r.reshape(1, B * T, HQ, D) if r is not None else None
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    o = _ops.attend(q, k, v, r, cu_seqlens, scale, int(max_seqlen or 0), int(window_size or 0))
    return o.view(B, T, HQ, D)


def parallax_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    r: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    num_splits: int = 0,
    merge: str | None = None,
) -> torch.Tensor:
    """Decode step: TQ new tokens per sequence against a KV cache that already holds them.

    q, r: [B, TQ, HQ, D]; k_cache, v_cache: [B, LMAX, HKV, D]; cache_seqlens: [B] int32, valid tokens per
    row including the TQ new ones (query t sits at position cache_seqlens − TQ + t). num_splits: KV splits
    (0: chosen from the static shapes, CUDA-graph safe). merge: how the splits are combined, "kernel" (a
    second launch) or "fused" (the last split program merges, one launch); None: ``ops.DECODE_MERGE`` (env
    ``PARALLAX_DECODE_MERGE``, default "kernel"). Returns [B, TQ, HQ, D] in q's dtype.
    """
    _check(q, k_cache, v_cache, r)
    merge = _ops.DECODE_MERGE if merge is None else merge
    if merge not in _ops.DECODE_MERGES:
        raise ValueError(f"decode merge {merge!r} (PARALLAX_DECODE_MERGE) must be one of {_ops.DECODE_MERGES}")
    B, TQ, HQ, D = q.shape
    scale = D**-0.5 if scale is None else float(scale)
    if num_splits <= 0:
        num_splits = decode_splits(B, k_cache.shape[2], k_cache.shape[1], q.device)
    return parallax_decode_op(q.contiguous(), k_cache, v_cache, cache_seqlens.to(torch.int32),
                              r.contiguous() if r is not None else None, scale, int(window_size or 0), num_splits,
                              merge == "fused")
