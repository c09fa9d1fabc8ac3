"""Streaming forward kernel (FlashAttention-2 style, online softmax in exp2) with an optional probe branch.

Per query tile and q head, over key blocks (Parallax paper eq. 14 / Algorithm 1):

    S1 = Q Kᵀ·scale (masked) ; m = max(m, rowmax S1) ; α = 2^(m_old − m) ; P1 = 2^(S1·log2e − m)
    d1 = α d1 + rowsum P1 ;  O1 = α O1 + P1 V
    probe only:  P2 = P1 ⊙ (R Kᵀ) ;  d2 = α d2 + rowsum P2 ;  O2 = α O2 + P2 V
    o = O1/d1 · (1 + d2/d1) − O2/d1          (plain softmax: o = O1/d1)

Saved for the backward: lse = m + log2 d1 (log2 units), t̄ = d2/d1 and v̄ = O1/d1.
GQA reads the kv head ``h // (HQ // HKV)`` directly (no repeated K/V). Packed documents: one program row
per (document, head); keys never leave the document. Optional constexprs (autotune candidates at D >= 128,
``common.FWD_SPECS``): ``TMA`` loads the mask-free key blocks' K/V tiles through device-side tensor descriptors,
``WS`` warp-specialises that loop.

``Q_OFFSET`` (query offsets, context parallelism): document s holds its Lq queries at CU[s] .. CU[s+1] and its
Lk >= Lq keys at CU_K[s] .. CU_K[s+1] of K/V ([1, NT_K, HKV, D], NT_K != NT in general), the queries aligned to the
last keys (bottom-right: query j at key position OFF + j, OFF = Lk − Lq; ``common.py``). A program's rows o_m then
sit at key positions o_m + OFF, which the mask and the phases compare with the keys; Q, O and the row statistics
stay indexed by the query. Without it OFF is the constant 0 and the kernel compiles as before.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnlab.attention.ops.parallax.triton.common import (_kv_tiles, _row_phases, _row_program, _segment, fwd_configs,
                                                   prune_fwd)

LOG2E = 1.4426950408889634  # 1/ln(2): exp(x) = 2^(x·log2e)


@triton.jit
def _fwd_inner(acc1, acc2, d1, d2, m_i, b_q, b_r, p_k0, p_v0, desc_k, desc_v, row0, col0, o_m, lo, hi, L, W,
               qk_scale, STRIDE_KV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, HAS_PROBE: tl.constexpr,
               MASK: tl.constexpr, WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, USE_DESC: tl.constexpr,
               WS: tl.constexpr):
    """o_m: the rows' key positions (query index + OFF); L: the document's key count.

    EARLY (not WS): the probe's R·Kᵀ is issued right after Q·Kᵀ, before the exponentials, which it overlaps;
    the warp-specialised loop measured no gain from it and keeps the late issue."""
    EARLY: tl.constexpr = not WS
    o_d = tl.arange(0, D)
    for start_n in tl.range(lo, hi, BN, warp_specialize=WS):
        o_n = start_n + tl.arange(0, BN)
        p_k = p_k0 + o_n[:, None] * STRIDE_KV + o_d[None, :]
        p_v = p_v0 + o_n[:, None] * STRIDE_KV + o_d[None, :]
        if USE_DESC:  # TMA tile loads (mask-free phase only: a descriptor does not stop at a document's end)
            b_k = desc_k.load([row0 + start_n, col0])
            b_v = desc_v.load([row0 + start_n, col0])
        elif MASK:
            b_k = tl.load(p_k, mask=o_n[:, None] < L, other=0.0)
            b_v = tl.load(p_v, mask=o_n[:, None] < L, other=0.0)
        else:
            b_k = tl.load(p_k)
            b_v = tl.load(p_v)
        # -- scores, log2 units --
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale  # [BM, BN]
        if HAS_PROBE:
            if EARLY:
                b_t = tl.dot(b_r, tl.trans(b_k), input_precision=DOT_PREC)  # t_ij = ρ_i·k_j, unscaled
        if MASK:
            vis = (o_m[:, None] >= o_n[None, :]) & (o_n[None, :] < L)
            if WINDOW:
                vis = vis & (o_m[:, None] - o_n[None, :] < W)
            b_s = tl.where(vis, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        if MASK:  # a row with no visible key yet keeps m = -inf: subtract 0 instead (no NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        alpha = tl.math.exp2(m_i - m_sub)
        b_p = tl.math.exp2(b_s - m_sub[:, None])
        d1 = d1 * alpha + tl.sum(b_p, 1)
        acc1 = acc1 * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
        if HAS_PROBE:
            if not EARLY:
                b_t = tl.dot(b_r, tl.trans(b_k), input_precision=DOT_PREC)
            b_p2 = b_p * b_t
            d2 = d2 * alpha + tl.sum(b_p2, 1)
            acc2 = acc2 * alpha[:, None] + tl.dot(b_p2.to(b_v.dtype), b_v, input_precision=DOT_PREC)
        m_i = m_new
    return acc1, acc2, d1, d2, m_i


@triton.autotune(configs=fwd_configs(),
                 key=["D", "HQ", "HKV", "HAS_PROBE", "IS_VARLEN", "WINDOW", "DOT_PREC", "Q_OFFSET"],
                 prune_configs_by={"early_config_prune": prune_fwd})
@triton.jit
def _parallax_fwd_kernel(Q, K, V, R, O, LSE, VBAR, TBAR, CU, CU_K, qk_scale, W, T, NT, NT_K,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, HAS_PROBE: tl.constexpr, IS_VARLEN: tl.constexpr,
                         WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, Q_OFFSET: tl.constexpr,
                         TMA: tl.constexpr = False, WS: tl.constexpr = False):
    """Q, R, O, VBAR: [B|1, NT/B, HQ, D]; K, V: [B|1, NT_K/B, HKV, D] (NT_K = NT without Q_OFFSET); LSE, TBAR:
    [HQ, NT] fp32. CU, CU_K: the queries' and (Q_OFFSET) the keys' [S+1] document offsets."""
    tl.static_assert(BM % BN == 0)
    i_m, i_h, i_b = _row_program(HQ)
    bos, L, bos_k, L_k, OFF = _segment(CU, CU_K, i_b, T, IS_VARLEN, Q_OFFSET)
    m0 = i_m * BM
    if m0 >= L:
        return
    i_kh = i_h // (HQ // HKV)
    o_m = m0 + tl.arange(0, BM)
    o_d = tl.arange(0, D)
    row_ok = o_m < L
    off_q = (bos + o_m[:, None]) * (HQ * D) + i_h * D + o_d[None, :]  # [BM, D]
    b_q = tl.load(Q + off_q, mask=row_ok[:, None], other=0.0)
    if HAS_PROBE:
        b_r = tl.load(R + off_q, mask=row_ok[:, None], other=0.0)
    else:
        b_r = b_q
    o_p = o_m + OFF  # the rows' key positions
    p_k0, p_v0, desc_k, desc_v, row0, col0 = _kv_tiles(K, V, bos_k, i_kh, NT, NT_K, HKV, D, BN, TMA, Q_OFFSET)

    acc1 = tl.zeros([BM, D], dtype=tl.float32)
    acc2 = tl.zeros([BM, D], dtype=tl.float32)
    d1 = tl.zeros([BM], dtype=tl.float32)
    d2 = tl.zeros([BM], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)

    start, a_hi, b_lo, b_hi, c_lo, end = _row_phases(m0, OFF, L_k, W, BM, BN, WINDOW, Q_OFFSET)
    if WINDOW:
        acc1, acc2, d1, d2, m_i = _fwd_inner(acc1, acc2, d1, d2, m_i, b_q, b_r, p_k0, p_v0, desc_k, desc_v, row0, col0,
                                             o_p, start, a_hi, L_k, W, qk_scale, HKV * D, D, BN, HAS_PROBE, True,
                                             WINDOW, DOT_PREC, False, False)
    acc1, acc2, d1, d2, m_i = _fwd_inner(acc1, acc2, d1, d2, m_i, b_q, b_r, p_k0, p_v0, desc_k, desc_v, row0, col0, o_p,
                                         b_lo, b_hi, L_k, W, qk_scale, HKV * D, D, BN, HAS_PROBE, False, WINDOW,
                                         DOT_PREC, TMA, WS)
    acc1, acc2, d1, d2, m_i = _fwd_inner(acc1, acc2, d1, d2, m_i, b_q, b_r, p_k0, p_v0, desc_k, desc_v, row0, col0, o_p,
                                         c_lo, end, L_k, W, qk_scale, HKV * D, D, BN, HAS_PROBE, True, WINDOW,
                                         DOT_PREC, False, False)

    # -- epilogue --
    d1 = tl.where(row_ok, d1, 1.0)
    inv = 1.0 / d1
    vbar = acc1 * inv[:, None]
    off_row = i_h.to(tl.int64) * NT + bos + o_m  # [HQ, NT] row statistics
    tl.store(LSE + off_row, m_i + tl.math.log2(d1), mask=row_ok)
    if HAS_PROBE:
        tbar = d2 * inv
        o = vbar * (1.0 + tbar)[:, None] - acc2 * inv[:, None]
        tl.store(TBAR + off_row, tbar, mask=row_ok)
        tl.store(VBAR + off_q, vbar.to(VBAR.dtype.element_ty), mask=row_ok[:, None])
    else:
        o = vbar
    tl.store(O + off_q, o.to(O.dtype.element_ty), mask=row_ok[:, None])
