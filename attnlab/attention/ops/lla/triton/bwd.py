"""LLA backward: pass A and the adjoint CG start, pass B (dq, dλ), and the dk/dv kernel (docs/kernels.md, "LLA").

The adjoint solve between A and B is ``cg._cg_step_kernel`` on the forward's Σ_c (its k̄ and Jacobi diagonal are
kept from the forward). The math is the k̄-centred one of ``attnlab/attention/ops/lla/chunk.py``, whose docstring
derives it (per row: p_j = w_j/ω, y_j = k_j − k̄, ρ_c = A⁻¹(k̄ − q), γ_j = g·v_j, ḡ = Σ_j p_j γ_j, u = A⁻¹ Σ_j p_j γ_j y_j);
nothing divides by the small δ. ρ_c = ρ·ω/δ is read back from the forward's ρ and δ (one product per row, exact to
rounding: the forward stored ρ = ρ_c/t and δ = ω/t with the same t).
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnlab.attention.ops.lla.triton.cg import _cg_start
from attnlab.attention.ops.lla.triton.common import (_BN, _DPS, _RQ, _TAU, _UQ, _addr, _bwd_a_pass, _bwd_b_pass,
                                                     _key_tile, _kv_weights, _q_tile, _rows, _store_kv)


@triton.jit
def _bwd_a_kernel(Q, K, V, LAM, DS, DO, M, OMEGA, R, P, CTR, CB, DIAG, ROWS,
                  s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                  T, HQ, qk_scale, rtol2,
                  D: tl.constexpr, G: tl.constexpr, JACOBI: tl.constexpr, PRECISE: tl.constexpr,
                  BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Backward pass A (τ = Σ_j w_j γ_j and Σ_j w_j γ_j k_j) and the CG start for Σ_c u = Σ_j w_j γ_j y_j
    (= ω h, so the solve's x·‖b‖ is u = A⁻¹h). The centre k̄ and the Jacobi diagonal are the forward's (CTR, DIAG)."""
    b, h, o_r, row_ok, ds, lo, mid1, mid2, hi, p_o, ok2, st, n_rows = _q_tile(DS, T, HQ, D, BR, BC, BD)
    o_d = tl.arange(0, BD)
    q = _rows(Q + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True)
    g = _rows(DO + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True).to(q.dtype)
    K += b * s_kb + (h // G) * s_kh
    V += b * s_kb + (h // G) * s_kh
    m2 = tl.load(M + st, mask=row_ok, other=0.0)
    tau, ck = _bwd_a_pass(q, g, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D, PRECISE, BR, BC, BD)
    om = tl.load(OMEGA + st, mask=row_ok, other=1.0)
    rid = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=1.0) * om
    ctr = tl.load(CTR + p_o, mask=ok2, other=0.0)
    if JACOBI:
        diag = tl.load(DIAG + p_o, mask=ok2, other=1.0)
    else:
        diag = ctr
    tl.store(ROWS + _TAU * n_rows + st, tau, mask=row_ok)
    _cg_start(ck - tau[:, None] * ctr, diag, ctr, rid, p_o, ok2, st, row_ok, R, P, CB, ROWS, n_rows, rtol2, JACOBI)


@triton.jit
def _bwd_b_kernel(Q, K, V, DS, DO, RHO, DELTA, M, OMEGA, CTR, ROWS, DQ, U, DLAM, RB, UB,
                  s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
                  T, HQ, scale, qk_scale,
                  D: tl.constexpr, G: tl.constexpr,
                  BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Backward pass B from u = x‖b‖ (x in U, replaced by u): dq = u + scale·Σ_j p_j (∂L/∂p_j − S) k_j with
    S = Σ_j p_j ∂L/∂p_j, dλ = u·ρ_c; and for the dk/dv kernel ρ_c, u in the operand dtype (RB, UB) with the row
    scalars k̄·ρ̂_c, k̄·û and S (ḡ = τ/ω the dk/dv kernel forms itself)."""
    b, h, o_r, row_ok, ds, lo, mid1, mid2, hi, p_o, ok2, st, n_rows = _q_tile(DS, T, HQ, D, BR, BC, BD)
    o_d = tl.arange(0, BD)
    q = _rows(Q + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True)
    g = _rows(DO + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True).to(q.dtype)
    K += b * s_kb + (h // G) * s_kh
    V += b * s_kb + (h // G) * s_kh
    m2 = tl.load(M + st, mask=row_ok, other=0.0)
    om = tl.load(OMEGA + st, mask=row_ok, other=1.0)
    inv_om = 1.0 / tl.where(om > 0, om, 1.0)
    t = om / tl.load(DELTA + st, mask=row_ok, other=1.0)  # 1 + (k̄ − q)·ρ_c
    rc = tl.load(RHO + p_o, mask=ok2, other=0.0) * t[:, None]
    u = tl.load(U + p_o, mask=ok2, other=0.0) * tl.load(ROWS + _BN * n_rows + st, mask=row_ok, other=1.0)[:, None]
    tl.store(U + p_o, u, mask=ok2)
    tl.store(DLAM + st, tl.sum(u * rc, 1), mask=row_ok)
    ctr = tl.load(CTR + p_o, mask=ok2, other=0.0)
    gv = tl.load(ROWS + _TAU * n_rows + st, mask=row_ok, other=0.0) * inv_om  # ḡ = g·v̄
    rc_b = rc.to(q.dtype)
    u_b = u.to(q.dtype)
    rq = tl.sum(rc_b.to(tl.float32) * ctr, 1)
    uq = tl.sum(u_b.to(tl.float32) * ctr, 1)
    tl.store(RB + p_o, rc_b, mask=ok2)
    tl.store(UB + p_o, u_b, mask=ok2)
    tl.store(ROWS + _RQ * n_rows + st, rq, mask=row_ok)
    tl.store(ROWS + _UQ * n_rows + st, uq, mask=row_ok)
    acc, sw = _bwd_b_pass(q, g, rc_b, u_b, rq, uq, gv, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D,
                          BR, BC, BD)
    tl.store(ROWS + _DPS * n_rows + st, sw * inv_om, mask=row_ok)
    u = tl.load(U + p_o, mask=ok2, other=0.0)  # reloaded: not live through the loop
    ctr = tl.load(CTR + p_o, mask=ok2, other=0.0)
    dq = u + (scale * inv_om)[:, None] * (acc - sw[:, None] * ctr)
    tl.store(DQ + p_o, dq.to(DQ.dtype.element_ty), mask=ok2)


@triton.jit
def _bwd_kv_kernel(Q, K, V, DS, DE, DO, M, OMEGA, ROWS, RB, UB, DK, DV,
                   s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
                   T, HQ, HKV, scale, qk_scale,
                   D: tl.constexpr, G: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """dk, dv of a key tile over all q heads of its GQA group and all query tiles of its documents at or below the
    diagonal, tiles held transposed ([key, query]) so no operand is transposed. ρ_c and u come in the operand dtype
    with their row scalars precomputed (pass B), and each [key, query] tile is consumed as soon as it is complete, so
    the loop holds two accumulators, the key/value tiles and ~6 score tiles."""
    b, hk, c0, o_c, col_ok, o_d, q_lo, q_hi, k, v, n_kv = _key_tile(DE, K, V, s_kb, s_kt, s_kh, T, HKV, D, BR, BC,
                                                                       BD)
    n_rows = T * HQ * n_kv // HKV  # B·T·HQ
    dk = tl.zeros([BC, BD], tl.float32)
    dv = tl.zeros([BC, BD], tl.float32)
    for hg in range(G):
        h = hk * G + hg
        for start in range(q_lo, q_hi, BR):
            o_r = start + tl.arange(0, BR)
            p_o, ok2, st, row_ok = _addr(b, h, o_r, T, HQ, D, BD)
            ds = tl.load(DS + b * T + o_r, mask=row_ok, other=T)
            m2 = tl.load(M + st, mask=row_ok, other=0.0)
            q = _rows(Q + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True)
            rb = tl.load(RB + p_o, mask=ok2, other=0.0)  # k·ρ_c issued before the exponentials
            yr = tl.dot(k, tl.trans(rb)) - tl.load(ROWS + _RQ * n_rows + st, mask=row_ok, other=0.0)[None, :]
            w = _kv_weights(k, q, qk_scale, m2, o_c, o_r, ds, start, c0, T, row_ok, col_ok, BR, BC)  # [BC keys, BR queries]
            inv_om = 1.0 / tl.load(OMEGA + st, mask=row_ok, other=1.0)[None, :]
            p = w * inv_om
            s = p * (1 - yr)  # the scores
            g = _rows(DO + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True)
            dv = tl.dot(s.to(g.dtype), g, dv)
            dk = _dk_tile(dk, k, v, q, g, p, yr, s, inv_om, rb, st, p_o, ok2, row_ok, n_rows, ROWS, UB, scale)
    _store_kv(DK, DV, dk, dv, b, hk, o_c, col_ok, o_d, T, HKV, D)


@triton.jit
def _dk_tile(dk, k, v, q, g, p, yr, s, inv_om, rb, st, p_o, ok2, row_ok, n_rows, ROWS, UB, scale):
    """dk += the [key, query] tile's contribution p (y·u − γ + ḡ) ρ_c − s u + scale·p (∂L/∂p − S) q."""
    gam = tl.dot(v, tl.trans(g))
    ub = tl.load(UB + p_o, mask=ok2, other=0.0)
    yu = tl.dot(k, tl.trans(ub)) - tl.load(ROWS + _UQ * n_rows + st, mask=row_ok, other=0.0)[None, :]
    gv = tl.load(ROWS + _TAU * n_rows + st, mask=row_ok, other=0.0)[None, :] * inv_om  # ḡ = g·v̄
    sp = tl.load(ROWS + _DPS * n_rows + st, mask=row_ok, other=0.0)[None, :]
    dl = p * (gam * (1 - yr) + (yu + gv) * yr - yu - sp)
    dk = tl.dot((scale * dl).to(q.dtype), q, dk)
    dk = tl.dot((p * (yu - gam + gv)).to(q.dtype), rb, dk)
    dk = tl.dot((-s).to(q.dtype), ub, dk)
    return dk
