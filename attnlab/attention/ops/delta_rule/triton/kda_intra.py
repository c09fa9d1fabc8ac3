"""Our Triton replacement for fla-core 0.6.0's ``chunk_kda_bwd_intra`` (KDA's intra-chunk backward), fast for any gate.

KDA's forward builds, per chunk of BT tokens and head, the gated score matrices (per channel c, j <= i in the chunk)

    Aqk[i, j] = sum_c q[i, c] k[j, c] 2^(g[i, c] - g[j, c])
    Akk[i, j] = beta[i] sum_c k[i, c] k[j, c] 2^(g[i, c] - g[j, c])

with g the chunk-local cumulative log2 decay ([B, T, H, K] float32, non-increasing within a chunk). Given their
gradients dAqk, dAkk ([B, T, H, BT] float32, column = key position in the chunk) and the partial gradients dq, dk,
db, dg of the rest of the backward, this kernel adds the scores' contribution:

    dq += dAqk 2^(g_i - g_j) k          dk += beta-scaled (dAkk ... k) + the transposed products (key side)
    db += rowsum((dAkk ... k) * k)      dg += q * dq_A + k * (dk_A,query side - dk_A,key side)

(dg per token, before the reverse chunk-local cumsum, in natural-log units: the log2 scale of g cancels the ln 2 of
d 2^x / dx, as in fla). Work is split into sub-chunks of BC = 16 rows. Off-diagonal sub-chunk pairs factor the
decay through the boundary row of the block, where both factors are <= 1 (fla's scheme). The **diagonal** 16 x 16
blocks are where fla-core 0.6.0 is slow for the plain (unbounded) gate: it loops over the 16 key rows one at a
time (a [16, BK] exp2 and multiply per step), because 2^(g_i - g_j) cannot be split into a row factor times a
column factor without a bound on the per-step decay — its tensor-core path (``safe_gate``) needs a lower bound
on every gate value. Here the split is chosen per block from the data: with each channel's centre
c = (max g + min g) / 2 over the block's rows, 2^(g_i - g_j) = 2^(g_i - c) 2^(c - g_j) and both factors are at
most 2^(span / 2), span = max over channels of (max g - min g). When span <= ``span_max`` (log2 units; default
120, factors <= 2^60, far inside float32) the block runs as two tensor-core dots (fp32-accurate ``bf16x3``
precision where Triton has it); otherwise it runs fla's exact 16-step loop. The choice is per program, so the
result is exact for any gate: a gate bounded by fla's ``lower_bound`` >= -5 never exceeds span 108 in a block
and always takes the dots.

Written for this project (MIT); follows the structure of fla's ``chunk_kda_bwd_kernel_intra`` so it drops into
fla's KDA backward pipeline (:func:`attention.ops.delta_rule.triton.pipeline.kda_bwd`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from packaging.version import Version

from attnlab.attention.ops.autotune import INTERPRET, candidates
from attnlab.attention.ops.delta_rule.triton.dqkwg import chunk_grid

__all__ = ["chunk_kda_bwd_intra", "SPAN_MAX"]

SPAN_MAX = 120.0
"""Largest per-block gate span (log2 units, max over channels of max g - min g) run as tensor-core dots."""

_BF16X3 = Version(triton.__version__.split("+")[0]) >= Version("3.6") and not INTERPRET
_DOT_PRECISION = tl.constexpr("bf16x3" if _BF16X3 else "ieee")  # fp32-accurate dots; the interpreter lacks bf16x3


def _configs():
    if INTERPRET:  # the CPU interpreter cannot benchmark configs
        return [triton.Config({}, num_warps=4, num_stages=2)]
    return candidates([triton.Config({}, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (2, 3)])


@triton.heuristics({"IS_VARLEN": lambda a: a["cu_seqlens"] is not None})
@triton.autotune(configs=_configs(), key=["H", "K", "BT", "BK"])
@triton.jit(do_not_specialize=["T", "NTOK", "span_max"])
def _kda_bwd_intra_kernel(
    q, k, g, beta, dAqk, dAkk, dq, dk, dg,  # inputs (dq, dk, dg: the partial gradients)
    dq2, dk2, db2, dg2,  # outputs (db2: [NK, NTOK, H], summed by the launcher)
    cu_seqlens, chunk_indices, span_max,
    T, NTOK,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, NC: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_kc, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k, i_i = i_kc // NC, i_kc % NC
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_b.to(tl.int64) * T
        L = T
    i_ti = i_t * BT + i_i * BC  # this block's first row, within the sequence
    if i_ti >= L:
        return

    SK: tl.constexpr = H * K  # token strides
    SA: tl.constexpr = H * BT
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    g += (bos * H + i_h) * K
    beta += bos * H + i_h
    dAqk += (bos * H + i_h) * BT
    dAkk += (bos * H + i_h) * BT
    off = (bos * H + i_h) * K
    dq += off
    dk += off
    dg += off
    dq2 += off
    dk2 += off
    dg2 += off
    db2 += i_k * NTOK * H + bos * H + i_h

    o_i = tl.arange(0, BC)
    o_c = i_ti + o_i
    m_c = o_c < L
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_ck = m_c[:, None] & m_k[None, :]
    p_ck = o_c[:, None] * SK + o_k[None, :]
    b_q = tl.load(q + p_ck, mask=m_ck, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_ck, mask=m_ck, other=0.0).to(tl.float32)
    b_g = tl.load(g + p_ck, mask=m_ck, other=0.0).to(tl.float32)
    b_b = tl.load(beta + o_c * H, mask=m_c, other=0.0).to(tl.float32)

    # per-channel centre and the block's span (valid rows only; padded channels have span 0)
    g_hi = tl.max(tl.where(m_c[:, None], b_g, float("-inf")), axis=0)
    g_lo = tl.min(tl.where(m_c[:, None], b_g, float("inf")), axis=0)
    b_gc = tl.where(m_k, 0.5 * (g_hi + g_lo), 0.0)
    use_dot = tl.max(tl.where(m_k, g_hi - g_lo, 0.0), axis=0) <= span_max
    b_e = tl.where(m_c[:, None], b_g - b_gc[None, :], 0.0)  # |b_e| <= span / 2 on valid rows

    # ---- query side: dq_A, dk_A (before beta) from key blocks j <= this block
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    if i_i > 0:
        b_gn = tl.load(g + i_ti * SK + o_k, mask=m_k, other=0.0).to(tl.float32)  # this block's first row
        for i_j in range(0, i_i):
            o_j = i_t * BT + i_j * BC + o_i  # rows of an earlier block: all < i_ti < L
            p_jk = o_j[:, None] * SK + o_k[None, :]
            b_kj = tl.load(k + p_jk, mask=m_k[None, :], other=0.0).to(tl.float32)
            b_gj = tl.load(g + p_jk, mask=m_k[None, :], other=0.0).to(tl.float32)
            b_kg = b_kj * tl.exp2(b_gn[None, :] - b_gj)  # <= |k|: g_j >= g_n
            p_A = o_c[:, None] * SA + (i_j * BC + o_i)[None, :]
            b_dAqk = tl.load(dAqk + p_A, mask=m_c[:, None], other=0.0)
            b_dAkk = tl.load(dAkk + p_A, mask=m_c[:, None], other=0.0)
            b_dq = tl.dot(b_dAqk, b_kg, b_dq)
            b_dk = tl.dot(b_dAkk, b_kg, b_dk)
        b_gqn = tl.where(m_c[:, None], tl.exp2(b_g - b_gn[None, :]), 0.0)
        b_dq *= b_gqn
        b_dk *= b_gqn

    m_diag = m_c[:, None] & m_c[None, :]
    p_D = o_c[:, None] * SA + (i_i * BC + o_i)[None, :]  # [query row i, key row j] of the diagonal block
    if use_dot:
        m_low = m_diag & (o_i[:, None] >= o_i[None, :])
        b_dAqk = tl.where(m_low, tl.load(dAqk + p_D, mask=m_diag, other=0.0), 0.0)
        b_dAkk = tl.where(m_low, tl.load(dAkk + p_D, mask=m_diag, other=0.0), 0.0)
        b_kd = b_k * tl.exp2(-b_e)
        b_up = tl.exp2(b_e)
        b_dq += tl.dot(b_dAqk, b_kd, input_precision=_DOT_PRECISION) * b_up
        b_dk += tl.dot(b_dAkk, b_kd, input_precision=_DOT_PRECISION) * b_up
    else:
        for j in range(0, tl.minimum(BC, L - i_ti)):
            b_dAqkj = tl.load(dAqk + o_c * SA + i_i * BC + j, mask=m_c, other=0.0)
            b_dAkkj = tl.load(dAkk + o_c * SA + i_i * BC + j, mask=m_c, other=0.0)
            b_kj = tl.load(k + (i_ti + j) * SK + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_gj = tl.load(g + (i_ti + j) * SK + o_k, mask=m_k, other=0.0).to(tl.float32)
            m_j = m_c[:, None] & (o_i[:, None] >= j)
            b_dec = tl.exp2(tl.where(m_j, b_g - b_gj[None, :], 0.0))
            b_dq += tl.where(m_j, b_dAqkj[:, None] * b_kj[None, :] * b_dec, 0.0)
            b_dk += tl.where(m_j, b_dAkkj[:, None] * b_kj[None, :] * b_dec, 0.0)

    b_db = tl.sum(b_dk * b_k, axis=1)
    b_dk *= b_b[:, None]
    b_dgv = b_q * b_dq
    b_dq += tl.load(dq + p_ck, mask=m_ck, other=0.0).to(tl.float32)
    tl.store(dq2 + p_ck, b_dq.to(dq2.dtype.element_ty), mask=m_ck)
    tl.store(db2 + o_c * H, b_db, mask=m_c)

    # ---- key side: dk_A^T from query blocks i >= this block
    b_dkt = tl.zeros([BC, BK], dtype=tl.float32)
    nc = tl.minimum(NC, tl.cdiv(L - i_t * BT, BC))
    if i_i < nc - 1:  # a later block exists, so this one is full
        b_gn = tl.load(g + (i_ti + BC - 1) * SK + o_k, mask=m_k, other=0.0).to(tl.float32)  # its last row
        for i_j in range(i_i + 1, nc):
            o_j = i_t * BT + i_j * BC + o_i
            m_j = o_j < L
            m_jk = m_j[:, None] & m_k[None, :]
            p_jk = o_j[:, None] * SK + o_k[None, :]
            b_qj = tl.load(q + p_jk, mask=m_jk, other=0.0).to(tl.float32)
            b_kbj = tl.load(k + p_jk, mask=m_jk, other=0.0).to(tl.float32)
            b_kbj *= tl.load(beta + o_j * H, mask=m_j, other=0.0).to(tl.float32)[:, None]
            b_gj = tl.load(g + p_jk, mask=m_jk, other=0.0).to(tl.float32)
            b_gkn = tl.where(m_jk, tl.exp2(b_gj - b_gn[None, :]), 0.0)  # <= 1: g_j <= g_n
            p_At = (i_i * BC + o_i)[:, None] + o_j[None, :] * SA  # [key row (this block), query row j]
            b_dAqk = tl.load(dAqk + p_At, mask=m_j[None, :], other=0.0)
            b_dAkk = tl.load(dAkk + p_At, mask=m_j[None, :], other=0.0)
            b_dkt = tl.dot(b_dAqk, b_qj * b_gkn, b_dkt)
            b_dkt = tl.dot(b_dAkk, b_kbj * b_gkn, b_dkt)
        b_dkt *= tl.exp2(b_gn[None, :] - b_g)

    if use_dot:
        p_Dt = (i_i * BC + o_i)[:, None] + o_c[None, :] * SA  # [key row j, query row i]
        m_up = m_diag & (o_i[:, None] <= o_i[None, :])
        b_dAqk = tl.where(m_up, tl.load(dAqk + p_Dt, mask=m_diag, other=0.0), 0.0)
        b_dAkk = tl.where(m_up, tl.load(dAkk + p_Dt, mask=m_diag, other=0.0), 0.0)
        b_up = tl.exp2(b_e)
        b_dn = tl.exp2(-b_e)
        b_acc = tl.dot(b_dAqk, b_q * b_up, input_precision=_DOT_PRECISION)
        b_acc = tl.dot(b_dAkk, b_k * b_b[:, None] * b_up, b_acc, input_precision=_DOT_PRECISION)
        b_dkt += b_acc * b_dn
    else:
        for i in range(0, tl.minimum(BC, L - i_ti)):
            b_dAqki = tl.load(dAqk + (i_ti + i) * SA + i_i * BC + o_i, mask=m_c, other=0.0)
            b_dAkki = tl.load(dAkk + (i_ti + i) * SA + i_i * BC + o_i, mask=m_c, other=0.0)
            b_qi = tl.load(q + (i_ti + i) * SK + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_kbi = tl.load(k + (i_ti + i) * SK + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_kbi *= tl.load(beta + (i_ti + i) * H).to(tl.float32)
            b_gi = tl.load(g + (i_ti + i) * SK + o_k, mask=m_k, other=0.0).to(tl.float32)
            m_i = m_c[:, None] & (o_i[:, None] <= i)
            b_dec = tl.exp2(tl.where(m_i, b_gi[None, :] - b_g, 0.0))
            b_dkt += tl.where(m_i, (b_dAqki[:, None] * b_qi[None, :] + b_dAkki[:, None] * b_kbi[None, :]) * b_dec,
                              0.0)

    b_dgv += (b_dk - b_dkt) * b_k + tl.load(dg + p_ck, mask=m_ck, other=0.0).to(tl.float32)
    b_dk += b_dkt + tl.load(dk + p_ck, mask=m_ck, other=0.0).to(tl.float32)
    tl.store(dk2 + p_ck, b_dk.to(dk2.dtype.element_ty), mask=m_ck)
    tl.store(dg2 + p_ck, b_dgv.to(dg2.dtype.element_ty), mask=m_ck)


@functools.cache
def _launcher():
    """The kernel behind :class:`attention.ops.fla_launch.FastLaunch` (the autotuner's choice cached per key:
    one ``JITFunction`` launch per call instead of the heuristics and autotuner layers)."""
    from attnlab.attention.ops.fla_launch import FastLaunch

    return FastLaunch(_kda_bwd_intra_kernel)


def chunk_kda_bwd_intra(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    dAqk: torch.Tensor,
    dAkk: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    db: torch.Tensor,
    dg: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_size: int = 64,
    span_max: float = SPAN_MAX,
    block_k: int | None = None,
    dq_dtype: torch.dtype | None = None,
    dk_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop-in for fla-core 0.6.0's ``chunk_kda_bwd_intra`` (``H == HV``; any gate, no ``safe_gate`` flag).

    q, k: [B, T, H, K]; g: [B, T, H, K] float32 chunk-local cumulative log2 decay; beta: [B, T, H];
    dAqk, dAkk: [B, T, H, chunk_size] float32; dq, dk, dg: [B, T, H, K] and db: [B, T, H], the partial gradients.
    cu_seqlens: [N + 1] (B == 1); chunk_indices: fla's / :func:`dqkwg.chunk_indices_for`'s (computed when None).
    span_max: per-block gate span (log2) up to which the diagonal blocks run as dots (tests force each path);
    block_k: channel tile (default min(64, next power of two of K); at K = 128, BK 64 ran the bounded gate's
    blocks markedly faster than fla's BK 32).
    dq_dtype / dk_dtype: the new dq / dk's dtypes (default dq's / dk's): the caller's gradient dtype, so the
    float32 sums are rounded once in the kernel instead of stored in float32 and cast by a separate pass.
    Returns new (dq, dk, db, dg), dg in dg's dtype and db float32.
    """
    B, T, H, K = k.shape
    if g.shape != k.shape or dq.shape != k.shape or beta.shape != (B, T, H):
        raise ValueError(f"chunk_kda_bwd_intra: g {list(g.shape)}, dq {list(dq.shape)}, beta {list(beta.shape)} "
                         f"do not match k [B, T, H, K] = {list(k.shape)} (grouped value heads are not supported)")
    BT, BC = chunk_size, 16
    if BT % BC:
        raise ValueError(f"chunk_kda_bwd_intra: chunk_size={BT} must be a multiple of {BC}")
    chunk_indices, NT = chunk_grid(T, BT, cu_seqlens, chunk_indices)
    BK = block_k or min(64, max(triton.next_power_of_2(K), 16))
    NK, NC = triton.cdiv(K, BK), BT // BC
    ins = [t.contiguous() for t in (q, k, g, beta, dAqk, dAkk, dq, dk, dg)]
    dq2 = torch.empty_like(ins[6], dtype=dq_dtype or dq.dtype)
    dk2 = torch.empty_like(ins[7], dtype=dk_dtype or dk.dtype)
    dg2 = torch.empty_like(ins[8])
    db2 = torch.empty(NK, B * T, H, dtype=torch.float32, device=q.device)
    _launcher()[(NK * NC, NT, B * H)](
        *ins, dq2, dk2, db2, dg2, cu_seqlens, chunk_indices, float(span_max), T, B * T,
        H=H, K=K, BT=BT, BC=BC, BK=BK, NC=NC,
    )
    return dq2, dk2, db2.sum(0).view(B, T, H).add_(db), dg2
