"""Triton kernels for causal softmax and Parallax attention: training forward/backward and decode.

One streaming kernel family (FlashAttention-2 style, online softmax in exp2, Dao 2023) with a constexpr
probe branch: with ``r`` it computes Parallax (two extra accumulators d2, O2 on the same K/V tiles, Parallax
paper eq. 14), without it the same source compiles to plain softmax attention. GQA without repeated
K/V, packed documents (fla's ``cu_seqlens``), sliding windows, head dims 16–256 (powers of two), any T, and query
offsets for context parallelism (``cu_seqlens_k``: each segment's queries are the last ones of its longer key
range).

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

from attnlab.attention.ops.parallax.triton import ops as _ops
from attnlab.attention.ops.parallax.triton.ops import decode_splits, parallax_bwd, parallax_decode_op, parallax_fwd

__all__ = ["parallax_triton", "parallax_decode_triton", "parallax_fwd", "parallax_bwd", "decode_splits"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


HEAD_DIMS = (16, 32, 64, 128, 256)


def autotuned_kernels() -> dict:
    """The training kernels' Triton autotuners by pass ("fwd", "dq", "dkv"), for tools that report the autotuner's
    pick per key (``.cache``) or compile candidates offline (``.fn``)."""
    from attnlab.attention.ops.parallax.triton import bwd, fwd

    return {"fwd": fwd._parallax_fwd_kernel, "dq": bwd._parallax_bwd_dq_kernel, "dkv": bwd._parallax_bwd_dkv_kernel}


def supports(q: torch.Tensor) -> bool:
    """Whether the kernels take this query's head dim and dtype (``impl="auto"`` falls back otherwise)."""
    return q.shape[-1] in HEAD_DIMS and q.dtype in _DTYPES


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor | None,
           own_keys: bool = False) -> None:
    """Shapes, head dims and dtypes the kernels take. ``own_keys``: k and v have token counts of their own (query
    offsets, ``cu_seqlens_k``; decode's KV cache); otherwise q's batch and token counts."""
    D = q.shape[-1]
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B, T, HQ, D], k = v [B, T, HKV, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not own_keys and k.shape[:2] != q.shape[:2]:
        raise ValueError(f"k, v {tuple(k.shape)} must have q's batch and token counts {tuple(q.shape[:2])}; keys "
                         f"segmented apart from the queries need cu_seqlens_k")
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
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int = 0,
) -> torch.Tensor:
    """Causal Parallax (``r`` given) or softmax (``r=None``) attention, differentiable in q, k, v, r.

    q, r: [B, T, HQ, D]; k, v: [B, T, HKV, D] (HQ % HKV == 0), one dtype of fp16/bf16/fp32 (fp32 accumulation).
    cu_seqlens: [N+1] int32 document offsets over the flattened B*T tokens, or None; max_seqlen: the longest
    document (computed, with a host sync, when 0). window_size: each query sees at most this many most
    recent keys, itself included (None/0: full causal). scale: applied to q·k only; default D**-0.5.
    Returns o: [B, T, HQ, D] in q's dtype.

    Query offsets (context parallelism; needs cu_seqlens): cu_seqlens_k [N+1] int32 segment offsets over the
    flattened Bk*Tk tokens of k, v [Bk, Tk, HKV, D] (any Bk*Tk). Segment s has the queries cu_seqlens[s] ..
    cu_seqlens[s+1] (Lq of them) and the keys cu_seqlens_k[s] .. cu_seqlens_k[s+1] (Lk >= Lq; Lq may be 0); its
    query j sits at key position Lk - Lq + j and sees the keys n <= Lk - Lq + j (and, with a window, those with
    Lk - Lq + j - n < window_size): flash-attention's bottom-right causal alignment. Keys that no query sees get
    dk = dv = 0. max_seqlen_k: the longest key segment (computed, with a host sync, when 0). Not checked (it
    would cost a host sync): Lk >= Lq per segment, cu_seqlens[-1] == B*T and cu_seqlens_k[-1] == Bk*Tk.
    """
    if cu_seqlens_k is not None and (cu_seqlens is None or cu_seqlens_k.numel() != cu_seqlens.numel()):
        raise ValueError(f"cu_seqlens_k (key segments, {cu_seqlens_k.numel()} offsets) needs cu_seqlens with as many "
                         f"offsets (the query segments; got {None if cu_seqlens is None else cu_seqlens.numel()})")
    _check(q, k, v, r, own_keys=cu_seqlens_k is not None)
    B, T, HQ, D = q.shape
    scale = D**-0.5 if scale is None else float(scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    r = r.contiguous() if r is not None else None
    if cu_seqlens is not None:
        q = q.reshape(1, B * T, HQ, D)
        k, v = (t.reshape(1, t.shape[0] * t.shape[1], t.shape[2], D) for t in (k, v))
        r = r.reshape(1, B * T, HQ, D) if r is not None else None
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if cu_seqlens_k is not None:
        cu_seqlens_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    o = _ops.attend(q, k, v, r, cu_seqlens, scale, int(max_seqlen or 0), int(window_size or 0), cu_seqlens_k,
                    int(max_seqlen_k or 0))
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
    _check(q, k_cache, v_cache, r, own_keys=True)
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
