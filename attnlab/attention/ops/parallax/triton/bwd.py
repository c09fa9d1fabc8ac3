"""Backward kernels (Parallax paper Appendix D, eqs. 36–41), FlashAttention-2 style two passes.

    τ_i = dO_i·o_i ,  β_i = dO_i·v̄_i ,  a_ij = dO_i·v_j ,  δ_ij = a_ij − β_i                  (36)
    g1_ij = p_ij [a_ij − τ_i + (t̄_i − t_ij) δ_ij] ,  g2_ij = −p_ij δ_ij                      (37)
    dQ_i = scale Σ_j g1_ij k_j ;  dR_i = Σ_j g2_ij k_j                                       (38), (39)
    dK_j = scale Σ_i g1_ij q_i + Σ_i g2_ij ρ_i ;  dV_j = Σ_i p_ij (1 + t̄_i − t_ij) dO_i      (40), (41)

Without a probe t = t̄ = β = 0 and these reduce to FlashAttention's (g1 = p (a − τ)).

- Row pass (``_parallax_bwd_dq_kernel``): per query tile and q head; its prologue is the preprocess (τ, β
  from the dO, o, v̄ tiles it loads anyway, stored for the column pass), then dQ and dR over key blocks.
- Column pass (``_parallax_bwd_dkv_kernel``): per key tile and KV head; loops over the q heads of the GQA
  group inside the program, so dK/dV accumulate per kv head in registers (no per-q-head buffer, no atomics).

``Q_OFFSET`` (context parallelism, ``fwd.py``): queries at CU[s] .. CU[s+1], keys at CU_K[s] .. CU_K[s+1] of K/V
([1, NT_K, HKV, D]), query j of a document at key position OFF + j (OFF = Lk − Lq). The row pass compares the rows'
key positions o_m + OFF with the keys; the column pass, per key tile of the document's Lk keys, compares the
queries with the keys' positions in query coordinates o_n − OFF. Key tiles that no query sees (a document with no
query here) store dK = dV = 0.

``TMA`` (autotune candidates at D >= 128 on sm_90+, ``common.DQ_SPECS`` / ``DKV_SPECS``): the mask-free blocks'
streamed tiles (K/V in the row pass, Q/ρ/dO in the column pass) load through device-side tensor descriptors.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnlab.attention.ops.parallax.triton.common import (_col_phases, _kv_tiles, _row_phases, _row_program, _segment,
                                                   _tile_descriptor, dkv_configs, dq_configs, prune_bwd)
from attnlab.attention.ops.tiles import GROUP_PROGRAMS, tile_program


@triton.jit
def _dq_inner(dq, dr, b_q, b_r, b_do, lse, tau, beta, tbar, p_k0, p_v0, desc_k, desc_v, row0, col0, o_m, lo, hi, L,
              W, qk_scale, STRIDE_KV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, HAS_PROBE: tl.constexpr,
              MASK: tl.constexpr, WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, USE_DESC: tl.constexpr):
    """o_m: the rows' key positions (query index + OFF); L: the document's key count."""
    o_d = tl.arange(0, D)
    for start_n in range(lo, hi, BN):
        o_n = start_n + tl.arange(0, BN)
        p_k = p_k0 + o_n[:, None] * STRIDE_KV + o_d[None, :]
        p_v = p_v0 + o_n[:, None] * STRIDE_KV + o_d[None, :]
        if USE_DESC:  # TMA tile loads (mask-free phase only)
            b_k = desc_k.load([row0 + start_n, col0])
            b_v = desc_v.load([row0 + start_n, col0])
        elif MASK:
            b_k = tl.load(p_k, mask=o_n[:, None] < L, other=0.0)
            b_v = tl.load(p_v, mask=o_n[:, None] < L, other=0.0)
        else:
            b_k = tl.load(p_k)
            b_v = tl.load(p_v)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale
        b_p = tl.math.exp2(b_s - lse[:, None])  # [BM, BN]
        if MASK:
            vis = (o_m[:, None] >= o_n[None, :]) & (o_n[None, :] < L)
            if WINDOW:
                vis = vis & (o_m[:, None] - o_n[None, :] < W)
            b_p = tl.where(vis, b_p, 0.0)
        b_a = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)  # a_ij = dO_i·v_j
        if HAS_PROBE:
            b_t = tl.dot(b_r, tl.trans(b_k), input_precision=DOT_PREC)
            b_delta = b_a - beta[:, None]
            b_g1 = b_p * (b_a - tau[:, None] + (tbar[:, None] - b_t) * b_delta)
            b_g2 = -b_p * b_delta
            dr += tl.dot(b_g2.to(b_k.dtype), b_k, input_precision=DOT_PREC)
        else:
            b_g1 = b_p * (b_a - tau[:, None])
        dq += tl.dot(b_g1.to(b_k.dtype), b_k, input_precision=DOT_PREC)
    return dq, dr


@triton.autotune(configs=dq_configs(),
                 key=["D", "HQ", "HKV", "HAS_PROBE", "IS_VARLEN", "WINDOW", "DOT_PREC", "Q_OFFSET"],
                 prune_configs_by={"early_config_prune": prune_bwd})
@triton.jit
def _parallax_bwd_dq_kernel(Q, K, V, R, O, DO, LSE, VBAR, TBAR, TAU, BETA, DQ, DR, CU, CU_K, scale, qk_scale, W, T,
                            NT, NT_K, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, HAS_PROBE: tl.constexpr, IS_VARLEN: tl.constexpr,
                            WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, Q_OFFSET: tl.constexpr,
                            TMA: tl.constexpr = False):
    """Q, R, O, DO, VBAR, DQ, DR: [B|1, NT/B, HQ, D]; K, V: [B|1, NT_K/B, HKV, D]; LSE … BETA: [HQ, NT] fp32."""
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
    off_q = (bos + o_m[:, None]) * (HQ * D) + i_h * D + o_d[None, :]
    off_row = i_h.to(tl.int64) * NT + bos + o_m
    b_q = tl.load(Q + off_q, mask=row_ok[:, None], other=0.0)
    b_do = tl.load(DO + off_q, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + off_row, mask=row_ok, other=0.0)
    # -- preprocess (eq. 36): τ = dO·o, β = dO·v̄ --
    b_o = tl.load(O + off_q, mask=row_ok[:, None], other=0.0)
    tau = tl.sum(b_do.to(tl.float32) * b_o.to(tl.float32), 1)
    tl.store(TAU + off_row, tau, mask=row_ok)
    if HAS_PROBE:
        b_r = tl.load(R + off_q, mask=row_ok[:, None], other=0.0)
        b_vbar = tl.load(VBAR + off_q, mask=row_ok[:, None], other=0.0)
        beta = tl.sum(b_do.to(tl.float32) * b_vbar.to(tl.float32), 1)
        tl.store(BETA + off_row, beta, mask=row_ok)
        tbar = tl.load(TBAR + off_row, mask=row_ok, other=0.0)
    else:
        b_r = b_q
        beta = tau
        tbar = tau
    o_p = o_m + OFF  # the rows' key positions
    p_k0, p_v0, desc_k, desc_v, row0, col0 = _kv_tiles(K, V, bos_k, i_kh, NT, NT_K, HKV, D, BN, TMA, Q_OFFSET)
    dq = tl.zeros([BM, D], dtype=tl.float32)
    dr = tl.zeros([BM, D], dtype=tl.float32)

    start, a_hi, b_lo, b_hi, c_lo, end = _row_phases(m0, OFF, L_k, W, BM, BN, WINDOW, Q_OFFSET)
    if WINDOW:
        dq, dr = _dq_inner(dq, dr, b_q, b_r, b_do, lse, tau, beta, tbar, p_k0, p_v0, desc_k, desc_v, row0, col0,
                           o_p, start, a_hi, L_k, W, qk_scale, HKV * D, D, BN, HAS_PROBE, True, WINDOW, DOT_PREC,
                           False)
    dq, dr = _dq_inner(dq, dr, b_q, b_r, b_do, lse, tau, beta, tbar, p_k0, p_v0, desc_k, desc_v, row0, col0,
                       o_p, b_lo, b_hi, L_k, W, qk_scale, HKV * D, D, BN, HAS_PROBE, False, WINDOW, DOT_PREC, TMA)
    dq, dr = _dq_inner(dq, dr, b_q, b_r, b_do, lse, tau, beta, tbar, p_k0, p_v0, desc_k, desc_v, row0, col0,
                       o_p, c_lo, end, L_k, W, qk_scale, HKV * D, D, BN, HAS_PROBE, True, WINDOW, DOT_PREC, False)
    tl.store(DQ + off_q, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    if HAS_PROBE:
        tl.store(DR + off_q, dr.to(DR.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkv_inner(dk, dv, b_k, b_v, Q, R, DO, LSE, TBAR, TAU, BETA, desc_q, desc_r, desc_do, row0, col0, o_n, lo, hi,
               L, W, scale, qk_scale, HQ: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, HAS_PROBE: tl.constexpr,
               MASK: tl.constexpr, WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, LONG_OFF: tl.constexpr,
               USE_DESC: tl.constexpr):
    """Q, R, DO point at (document start, q head); LSE … BETA at that head's row of the document, so the
    per-tile offsets fit int32 (fewer address registers in the loop than int64) unless LONG_OFF. o_n: the keys'
    positions in query coordinates (key index − OFF); L: the document's query count.

    EARLY (probe, D ≥ 128): K·Rᵀ and V·dOᵀ are issued right after K·Qᵀ, before the exponentials, which they
    overlap; it paid at D = 128 and not at D = 64, which keeps the late issue."""
    EARLY: tl.constexpr = D >= 128
    o_d = tl.arange(0, D)
    for start_m in range(lo, hi, BM):
        o_m = start_m + tl.arange(0, BM)
        if LONG_OFF:  # (longest document + BN)·HQ·D ≥ 2^31
            o_m = o_m.to(tl.int64)
        off_q = o_m[:, None] * (HQ * D) + o_d[None, :]  # [BM, D]
        off_row = o_m
        if MASK:  # rows past the document end load as zeros and contribute nothing (dO = 0)
            row_ok = o_m < L
            b_q = tl.load(Q + off_q, mask=row_ok[:, None], other=0.0)
            b_do = tl.load(DO + off_q, mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + off_row, mask=row_ok, other=0.0)
            tau = tl.load(TAU + off_row, mask=row_ok, other=0.0)
        else:
            if USE_DESC:  # TMA tile loads (mask-free phase only)
                b_q = desc_q.load([row0 + start_m, col0])
                b_do = desc_do.load([row0 + start_m, col0])
            else:
                b_q = tl.load(Q + off_q)
                b_do = tl.load(DO + off_q)
            lse = tl.load(LSE + off_row)
            tau = tl.load(TAU + off_row)
        # transposed orientation: [BN keys, BM queries]
        b_st = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC)
        if HAS_PROBE:
            if MASK:
                b_r = tl.load(R + off_q, mask=row_ok[:, None], other=0.0)
                beta = tl.load(BETA + off_row, mask=row_ok, other=0.0)
                tbar = tl.load(TBAR + off_row, mask=row_ok, other=0.0)
            else:
                if USE_DESC:
                    b_r = desc_r.load([row0 + start_m, col0])
                else:
                    b_r = tl.load(R + off_q)
                beta = tl.load(BETA + off_row)
                tbar = tl.load(TBAR + off_row)
            if EARLY:  # all three score products before the exponentials: they overlap them
                b_tt = tl.dot(b_k, tl.trans(b_r), input_precision=DOT_PREC)
                b_at = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC)
        b_pt = tl.math.exp2(b_st * qk_scale - lse[None, :])
        if MASK:
            vis = (o_m[None, :] >= o_n[:, None]) & (o_m[None, :] < L)
            if WINDOW:
                vis = vis & (o_m[None, :] - o_n[:, None] < W)
            b_pt = tl.where(vis, b_pt, 0.0)
        if HAS_PROBE:  # without EARLY, ordered so few [BN, BM] tiles are live at once: P, t̄ − t, then a; g1 reuses g2
            if not EARLY:
                b_tt = tl.dot(b_k, tl.trans(b_r), input_precision=DOT_PREC)
            b_dt = tbar[None, :] - b_tt  # t̄_i − t_ij
            dv += tl.dot((b_pt * (1.0 + b_dt)).to(b_do.dtype), b_do, input_precision=DOT_PREC)  # s_ij of eq. (8)
            if not EARLY:
                b_at = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC)  # a_ij = dO_i·v_j
            b_g2 = b_pt * (beta[None, :] - b_at)  # −p δ
            b_g1 = b_pt * (b_at - tau[None, :]) - b_dt * b_g2  # p (a − τ + (t̄ − t) δ)
            dk += tl.dot(b_g2.to(b_r.dtype), b_r, input_precision=DOT_PREC)
            dk += tl.dot((b_g1 * scale).to(b_q.dtype), b_q, input_precision=DOT_PREC)
        else:  # dk is scaled once in the epilogue
            dv += tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=DOT_PREC)
            b_at = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC)
            dk += tl.dot((b_pt * (b_at - tau[None, :])).to(b_q.dtype), b_q, input_precision=DOT_PREC)
    return dk, dv


@triton.autotune(configs=dkv_configs(),
                 key=["D", "HQ", "HKV", "HAS_PROBE", "IS_VARLEN", "WINDOW", "DOT_PREC", "Q_OFFSET"],
                 prune_configs_by={"early_config_prune": prune_bwd})
@triton.jit
def _parallax_bwd_dkv_kernel(Q, K, V, R, DO, LSE, TBAR, TAU, BETA, DK, DV, CU, CU_K, scale, qk_scale, W, T, NT,
                             HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, HAS_PROBE: tl.constexpr, IS_VARLEN: tl.constexpr,
                             WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, LONG_OFF: tl.constexpr,
                             Q_OFFSET: tl.constexpr, TMA: tl.constexpr = False):
    """Q, R, DO: [B|1, NT/B, HQ, D]; K, V, DK, DV: [B|1, ·, HKV, D] (q's tokens, or with Q_OFFSET the keys' own,
    segmented by CU_K); LSE … BETA: [HQ, NT] fp32."""
    tl.static_assert(BN % BM == 0)
    i_n, pair, _, _ = tile_program(GROUP_PROGRAMS)  # key tile 0 sees the most query rows: heaviest first
    i_kh = pair % HKV
    i_b = pair // HKV
    bos, L, bos_k, L_k, OFF = _segment(CU, CU_K, i_b, T, IS_VARLEN, Q_OFFSET)
    n0 = i_n * BN
    if n0 >= L_k:
        return
    o_n = n0 + tl.arange(0, BN)
    o_d = tl.arange(0, D)
    col_ok = o_n < L_k
    off_kv = (bos_k + o_n[:, None]) * (HKV * D) + i_kh * D + o_d[None, :]
    b_k = tl.load(K + off_kv, mask=col_ok[:, None], other=0.0)
    b_v = tl.load(V + off_kv, mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, D], dtype=tl.float32)
    start, a_hi, b_lo, b_hi, c_lo, end = _col_phases(n0, OFF, L, W, BM, BN, WINDOW, Q_OFFSET)
    o_nq = o_n - OFF  # the keys' positions in query coordinates
    G: tl.constexpr = HQ // HKV
    desc_q = _tile_descriptor(Q, NT, HQ * D, BM, D, TMA)
    desc_do = _tile_descriptor(DO, NT, HQ * D, BM, D, TMA)
    desc_r = _tile_descriptor(R, NT, HQ * D, BM, D, TMA and HAS_PROBE)
    row0 = bos.to(tl.int32)
    for g in range(G):  # the q heads of this kv head's group
        i_h = i_kh * G + g
        p_q, p_r, p_do = (Q + (bos * HQ + i_h) * D, R + (bos * HQ + i_h) * D, DO + (bos * HQ + i_h) * D)
        off_row = i_h.to(tl.int64) * NT + bos
        p_lse, p_tbar, p_tau, p_beta = LSE + off_row, TBAR + off_row, TAU + off_row, BETA + off_row
        dk, dv = _dkv_inner(dk, dv, b_k, b_v, p_q, p_r, p_do, p_lse, p_tbar, p_tau, p_beta, desc_q, desc_r, desc_do,
                            row0, i_h * D, o_nq, start, a_hi, L, W, scale, qk_scale, HQ, D, BM, HAS_PROBE, True,
                            WINDOW, DOT_PREC, LONG_OFF, False)
        dk, dv = _dkv_inner(dk, dv, b_k, b_v, p_q, p_r, p_do, p_lse, p_tbar, p_tau, p_beta, desc_q, desc_r, desc_do,
                            row0, i_h * D, o_nq, b_lo, b_hi, L, W, scale, qk_scale, HQ, D, BM, HAS_PROBE, False,
                            WINDOW, DOT_PREC, LONG_OFF, TMA)
        dk, dv = _dkv_inner(dk, dv, b_k, b_v, p_q, p_r, p_do, p_lse, p_tbar, p_tau, p_beta, desc_q, desc_r, desc_do,
                            row0, i_h * D, o_nq, c_lo, end, L, W, scale, qk_scale, HQ, D, BM, HAS_PROBE, True,
                            WINDOW, DOT_PREC, LONG_OFF, False)
    if not HAS_PROBE:  # the softmax column pass leaves the scale of dK = scale·Σ g1 q to here
        dk *= scale
    tl.store(DK + off_kv, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + off_kv, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])
