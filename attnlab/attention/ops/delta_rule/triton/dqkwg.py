"""Our Triton replacement for fla-core's ``chunk_bwd_kernel_dqkwg`` (the one kernel of the chunked delta-rule
backward that Triton 3.4 <= v < 3.7.1 miscompiles on Hopper; docs/kernels.md, "The delta rule").

Per chunk of BT tokens (head h, K-block of BK channels), with fla's chunk tensors: v = v_new (the pseudo-values
of the forward), h / dh the state and its gradient at the chunk start ([K, V], fla layout ``h = S^T``), dv the
gradient of v_new (from ``chunk_gated_delta_rule_bwd_dhu``), and g the chunk-local cumulative log2 decay
(scalar per token; None for DeltaNet), it computes

    dq = scale * (exp2(g) * (do h^T) + M @ k)              M = scale-free causal gated score gradient:
    dk = exp2(g_last - g) * (v dh^T) + M^T @ q                 M_ij = [i >= j] exp2(g_i - g_j) (do v^T)_ij
    dw = -(dv h^T)                                     (only when w is given: the WY-form term)
    dg = rowsum(dq * q) - rowsum(dk * k), plus, on the chunk's last token,
         exp2(g_last) * sum(h * dh) + sum(dk_state * k)      (dk_state = the first term of dk)

(M carries ``scale`` when gated, exactly as fla's kernel; dg is the per-token gradient *before* fla's reverse
chunk-local cumsum). Without g: dq = scale (do h^T + M k), dk = v dh^T + scale M^T q, no dg.

The miscompile is ``tl.trans`` applied to the accumulated ``tl.dot`` result ``ds`` (wgmma register layout)
before it is used as a dot operand. Here ``ds^T`` is never formed by transposing a dot result: a second
accumulator computes ``v do^T`` directly from the loaded tiles (transposing only loaded tiles, which is safe),
at the price of one extra [BT, BV] x [BV, BT] product per V block. Written for this project (MIT); follows the
structure of fla's kernel so it can be swapped into fla's backward pipeline.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attnlab.attention.ops.autotune import candidates

__all__ = ["chunk_bwd_dqkwg", "chunk_grid", "chunk_indices_for"]


def _configs():
    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter cannot benchmark configs
        return [triton.Config({}, num_warps=4, num_stages=2)]
    # fla keeps this kernel at 2 or 4 warps on Hopper; 4 configs keep the one-time autotune to a few seconds.
    return candidates([triton.Config({}, num_warps=w, num_stages=s) for w in (2, 4) for s in (2, 3)])


@triton.heuristics({
    "USE_G": lambda a: a["g"] is not None,
    "USE_DW": lambda a: a["dw"] is not None,
    "IS_VARLEN": lambda a: a["cu_seqlens"] is not None,
})
@triton.autotune(configs=_configs(), key=["H", "K", "V", "BT", "BK", "BV", "USE_G", "USE_DW"])
@triton.jit(do_not_specialize=["T", "NTOK"])
def _dqkwg_kernel(
    q, k, v, g, h, do, dh, dv,  # inputs
    dq, dk, dw, dg,  # outputs
    cu_seqlens, chunk_indices, scale,
    T, NTOK,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
    USE_G: tl.constexpr, USE_DW: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_kt, i_bh = tl.program_id(0), tl.program_id(1)
    i_k, i_t = i_kt % NK, i_kt // NK
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_tg = i_t  # global chunk index (rows of h / dh)
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        n_tok = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        n_tok = T
        i_tg = i_b * tl.cdiv(T, BT) + i_t
        bos = (i_b * T).to(tl.int64)

    # per-(chunk, head) bases; tokens are rows of stride H*K (q, k, w) or H*V (v, do, dv)
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    dq += (bos * H + i_h) * K
    dk += (bos * H + i_h) * K
    v += (bos * H + i_h) * V
    do += (bos * H + i_h) * V
    h += (i_tg.to(tl.int64) * H + i_h) * K * V
    dh += (i_tg.to(tl.int64) * H + i_h) * K * V

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < n_tok
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)  # do v^T
    b_dst = tl.zeros([BT, BT], dtype=tl.float32)  # v do^T: ds^T computed, not transposed
    b_hdh = tl.zeros([1], dtype=tl.float32)  # sum(h * dh) over this K block
    # -- V loop: every product that needs v, do, h, dh, dv --
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_vk = m_v[:, None] & m_k[None, :]
        b_v = tl.load(v + o_t[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)  # [BT, BV]
        b_do = tl.load(do + o_t[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)  # [BT, BV]
        b_ht = tl.load(h + o_v[:, None] + o_k[None, :] * V, mask=m_vk, other=0.0)  # [BV, BK] = h^T
        b_dht = tl.load(dh + o_v[:, None] + o_k[None, :] * V, mask=m_vk, other=0.0)  # [BV, BK]
        if USE_G:
            b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32))
        b_ds = tl.dot(b_do, tl.trans(b_v), b_ds)
        b_dst = tl.dot(b_v, tl.trans(b_do), b_dst)
        b_dq = tl.dot(b_do, b_ht.to(b_do.dtype), b_dq)
        b_dk = tl.dot(b_v, b_dht.to(b_v.dtype), b_dk)
        if USE_DW:
            b_dv = tl.load(dv + (bos * H + i_h) * V + o_t[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)
            b_dw = tl.dot(b_dv.to(b_v.dtype), b_ht.to(b_v.dtype), b_dw)
    if USE_DW:
        p_dw = dw + (bos * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :]
        tl.store(p_dw, -b_dw.to(p_dw.dtype.element_ty), mask=m_tk)

    # -- epilogue: intra-chunk (causal) terms --
    b_q = tl.load(q + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)  # [BT, BK]
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
    m_tt = m_t[:, None] & m_t[None, :]
    m_low = (o_t[:, None] >= o_t[None, :]) & m_tt  # i >= j
    m_up = (o_t[:, None] <= o_t[None, :]) & m_tt  # transposed mask for ds^T
    p_dq = dq + o_t[:, None] * (H * K) + o_k[None, :]
    p_dk = dk + o_t[:, None] * (H * K) + o_k[None, :]
    if USE_G:
        i_last = tl.minimum(i_t * BT + BT, n_tok) - 1
        b_g = tl.load(g + (bos + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [BT] log2 cumsum
        b_gl = tl.load(g + (bos + i_last) * H + i_h).to(tl.float32)
        b_dgl = b_hdh * tl.math.exp2(b_gl)
        b_dq = b_dq * tl.math.exp2(b_g)[:, None] * scale
        b_dk = b_dk * tl.where(m_t, tl.math.exp2(b_gl - b_g), 0.0)[:, None]
        b_dgl += tl.sum(b_dk * b_k.to(tl.float32))
        # exponents are <= 0 where the masks keep them (g is non-increasing within a chunk)
        b_ds = tl.where(m_low, b_ds * tl.math.exp2(b_g[:, None] - b_g[None, :]), 0.0) * scale
        b_dst = tl.where(m_up, b_dst * tl.math.exp2(b_g[None, :] - b_g[:, None]), 0.0) * scale
        b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq)
        b_dk = tl.dot(b_dst.to(b_q.dtype), b_q, b_dk)
        b_dg = tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
        b_dg = tl.where(o_t == i_last, b_dg + b_dgl, b_dg)
        p_dg = dg + i_k * NTOK * H + (bos + o_t) * H + i_h
        tl.store(p_dg, b_dg, mask=m_t)
    else:
        b_ds = tl.where(m_low, b_ds, 0.0)
        b_dst = tl.where(m_up, b_dst, 0.0)
        b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq) * scale
        b_dk += tl.dot(b_dst.to(b_q.dtype), b_q) * scale
    tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), mask=m_tk)
    tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), mask=m_tk)


def chunk_indices_for(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[total_chunks, 2] int32 (document, chunk within document) pairs, fla's ``prepare_chunk_indices`` order."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    pairs = [(n, t) for n, L in enumerate(lens) for t in range(-(-int(L) // chunk_size))]
    return torch.tensor(pairs, dtype=torch.int32, device=cu_seqlens.device).view(-1, 2)


def chunk_grid(T: int, chunk_size: int, cu_seqlens: torch.Tensor | None,
               chunk_indices: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """(chunk_indices, NT) for a chunk kernel's launch: NT = chunks per row, or with ``cu_seqlens`` the chunks of all
    documents, whose (document, chunk) pairs are ``chunk_indices`` (computed by :func:`chunk_indices_for` when None)."""
    if cu_seqlens is None:
        return chunk_indices, triton.cdiv(T, chunk_size)
    if chunk_indices is None:
        chunk_indices = chunk_indices_for(cu_seqlens, chunk_size)
    return chunk_indices, chunk_indices.shape[0]


def chunk_bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    scale: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
    block_k: int | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Drop-in for fla's ``chunk_bwd_dqkwg`` (``H == HV``, state layout [K, V]).

    q, k: [B, T, H, K]; v (= v_new), do: [B, T, H, V]; h, dh: [B, NT, H, K, V] (NT = chunks per row, or the
    total chunks over all documents with ``cu_seqlens``); w: [B, T, H, K] or None; g: [B, T, H] float32
    chunk-local cumulative log2 decay or None; dv: [B, T, H, V] (needed with w).
    cu_seqlens: [N + 1] (B == 1); chunk_indices: from :func:`chunk_indices_for` (computed when None).
    block_k / block_v: tile sizes (default: next power of two of K / V, at most 128; tests use smaller).
    Returns (dq, dk in q's / k's dtype, dw like w or None, dg [B, T, H] float32 or None).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    if v.shape[2] != H:
        raise ValueError(f"chunk_bwd_dqkwg: grouped value heads not supported (q heads {H}, v heads {v.shape[2]})")
    if w is not None and dv is None:
        raise ValueError("chunk_bwd_dqkwg: w given without dv")
    BT = chunk_size
    chunk_indices, NT = chunk_grid(T, BT, cu_seqlens, chunk_indices)
    BK = block_k or min(max(triton.next_power_of_2(K), 16), 128)
    BV = block_v or min(max(triton.next_power_of_2(V), 16), 128)
    NK = triton.cdiv(K, BK)
    q, k, v, do, h, dh = (t.contiguous() for t in (q, k, v, do, h, dh))
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dw = None if w is None else torch.empty_like(w)
    dv = None if dv is None else dv.contiguous()
    dg = None if g is None else torch.empty(NK, B, T, H, dtype=torch.float32, device=q.device)
    _dqkwg_kernel[(NK * NT, B * H)](
        q, k, v, None if g is None else g.contiguous(), h, do, dh, dv,
        dq, dk, dw, dg,
        cu_seqlens, chunk_indices, scale,
        T, B * T,
        H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, NK=NK,
    )
    return dq, dk, dw, (None if dg is None else dg.sum(0))
