"""LLA backward: pass A and the adjoint CG start, pass B (dq, dλ), and the dk/dv kernel (docs/kernels.md, "LLA").

The adjoint solve between A and B is ``cg._cg_step_kernel`` on the forward's Σ_c (its k̄ and Jacobi diagonal are
kept from the forward). The math is the one of ``attnlab/attention/ops/lla/chunk.py``, whose docstring derives it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnlab.attention.ops.lla.triton.cg import _cg_start
from attnlab.attention.ops.lla.triton.common import (_BN, _LT, _RQ, _TAU, _UQ, _addr, _bwd_a_pass, _bwd_b_pass,
                                                     _key_tile, _kv_weights, _q_tile, _rows, _store_kv)


@triton.jit
def _bwd_a_kernel(Q, K, V, LAM, DS, O, DO, DELTA, M, OMEGA, R, P, CTR, CB, DIAG, ROWS, BETA,
                  s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                  T, HQ, qk_scale, rtol2,
                  D: tl.constexpr, G: tl.constexpr, JACOBI: tl.constexpr, PRECISE: tl.constexpr,
                  BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Backward pass A (τ = Σ c, Σ c k and β = dO·o/δ, from the op's output O) and the CG start for Σ_c u_c = y.
    The centre k̄ and the Jacobi diagonal are the forward's (CTR, DIAG)."""
    b, h, o_r, row_ok, ds, lo, mid1, mid2, hi, p_o, ok2, st, n_rows = _q_tile(DS, T, HQ, D, BR, BC, BD)
    o_d = tl.arange(0, BD)
    q = _rows(Q + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True)
    g = _rows(DO + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True)
    K += b * s_kb + (h // G) * s_kh
    V += b * s_kb + (h // G) * s_kh
    inv_d = 1.0 / tl.load(DELTA + st, mask=row_ok, other=1.0)
    m2 = tl.load(M + st, mask=row_ok, other=0.0)
    beta = tl.sum(g.to(tl.float32) * tl.load(O + p_o, mask=ok2, other=0.0).to(tl.float32), 1) * inv_d
    g = g.to(q.dtype)
    tau, ck = _bwd_a_pass(q, g, inv_d, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D, PRECISE, BR, BC,
                          BD)
    om = tl.load(OMEGA + st, mask=row_ok, other=1.0)
    rid = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=1.0) * om
    ctr = tl.load(CTR + p_o, mask=ok2, other=0.0)
    if JACOBI:
        diag = tl.load(DIAG + p_o, mask=ok2, other=1.0)
    else:
        diag = ctr
    tl.store(BETA + st, beta, mask=row_ok)
    tl.store(ROWS + _TAU * n_rows + st, tau, mask=row_ok)
    _cg_start(ck - tau[:, None] * q.to(tl.float32), diag, ctr, rid, p_o, ok2, st, row_ok, R, P, CB, ROWS, n_rows,
              rtol2, JACOBI)


@triton.jit
def _bwd_b_kernel(Q, K, V, LAM, DS, DO, RHO, DELTA, M, OMEGA, CTR, ROWS, BETA, DQ, U, DLAM, RB, UB, DMB,
                  s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                  T, HQ, scale, qk_scale,
                  D: tl.constexpr, G: tl.constexpr,
                  BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Backward pass B from u_c = x‖y‖ (x in U, replaced by u = Σ⁻¹y): dq, dλ; and for the dk/dv kernel
    ρ, u and Δμ = 2βρ − u in the operand dtype (RB, UB, DMB) with the row scalars λ·tr, ρ̂·q, û·q."""
    b, h, o_r, row_ok, ds, lo, mid1, mid2, hi, p_o, ok2, st, n_rows = _q_tile(DS, T, HQ, D, BR, BC, BD)
    o_d = tl.arange(0, BD)
    q = _rows(Q + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True)
    g = _rows(DO + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True).to(q.dtype)
    K += b * s_kb + (h // G) * s_kh
    V += b * s_kb + (h // G) * s_kh
    inv_d = 1.0 / tl.load(DELTA + st, mask=row_ok, other=1.0)
    m2 = tl.load(M + st, mask=row_ok, other=0.0)
    om = tl.load(OMEGA + st, mask=row_ok, other=1.0)
    beta = tl.load(BETA + st, mask=row_ok, other=0.0)
    lam = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=1.0)
    qf = q.to(tl.float32)
    om1 = tl.where(om > 0, om, 1.0)
    rho = tl.load(RHO + p_o, mask=ok2, other=0.0)
    u = tl.load(U + p_o, mask=ok2, other=0.0) * tl.load(ROWS + _BN * n_rows + st, mask=row_ok, other=1.0)[:, None]
    mu = om[:, None] * (tl.load(CTR + p_o, mask=ok2, other=0.0) - qf)
    u -= rho * (tl.sum(mu * u, 1) / om1)[:, None]  # Σ⁻¹y from Σ_c⁻¹y (Sherman–Morrison)
    tl.store(U + p_o, u, mask=ok2)
    trg = tl.sum(u * rho, 1) - beta * tl.sum(rho * rho, 1)
    rho_b = rho.to(q.dtype)
    u_b = u.to(q.dtype)
    rq = tl.sum(rho_b.to(tl.float32) * qf, 1)
    uq = tl.sum(u_b.to(tl.float32) * qf, 1)
    lt = lam * trg
    tl.store(RB + p_o, rho_b, mask=ok2)
    tl.store(UB + p_o, u_b, mask=ok2)
    tl.store(ROWS + _LT * n_rows + st, lt, mask=row_ok)
    tl.store(ROWS + _RQ * n_rows + st, rq, mask=row_ok)
    tl.store(ROWS + _UQ * n_rows + st, uq, mask=row_ok)
    acc, umu = _bwd_b_pass(q, g, rho_b, u_b, rq, uq, beta, inv_d, lt, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi,
                           qk_scale, T, D, BR, BC, BD)
    rho = tl.load(RHO + p_o, mask=ok2, other=0.0)  # reloaded: not live through the loop
    u = tl.load(U + p_o, mask=ok2, other=0.0)
    tau = tl.load(ROWS + _TAU * n_rows + st, mask=row_ok, other=0.0)
    dmu = 2 * beta[:, None] * rho - u
    tl.store(DMB + p_o, dmu.to(DMB.dtype.element_ty), mask=ok2)
    dq = scale * acc + tau[:, None] * rho - (1.0 / inv_d)[:, None] * dmu - umu[:, None] * rho
    tl.store(DQ + p_o, dq.to(DQ.dtype.element_ty), mask=ok2)
    tl.store(DLAM + st, trg * om, mask=row_ok)


@triton.jit
def _bwd_kv_kernel(Q, K, V, DS, DE, DO, M, DELTA, BETA, ROWS, RB, UB, DMB, DK, DV,
                   s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
                   T, HQ, HKV, scale, qk_scale,
                   D: tl.constexpr, G: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """dk, dv of a key tile over all q heads of its GQA group and all query tiles of its documents at or below the
    diagonal, tiles held transposed ([key, query]) so no operand is transposed. The vectors ρ, u, Δμ come in the
    operand dtype and their row scalars precomputed (pass B), and each [key, query] tile is consumed as soon as it is
    complete, so the loop holds two accumulators, the key/value tiles and ~6 score tiles."""
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
            rb = tl.load(RB + p_o, mask=ok2, other=0.0)  # k·ρ issued before the exponentials
            zr = tl.dot(k, tl.trans(rb)) - tl.load(ROWS + _RQ * n_rows + st, mask=row_ok, other=0.0)[None, :]
            w = _kv_weights(k, q, qk_scale, m2, o_c, o_r, ds, start, c0, T, row_ok, col_ok, BR, BC)  # [BC keys, BR queries]
            inv_d = 1.0 / tl.load(DELTA + st, mask=row_ok, other=1.0)
            wn = w * (1 - zr)
            a = wn * inv_d[None, :]
            g = _rows(DO + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True)
            dv = tl.dot(a.to(g.dtype), g, dv)
            dk = _dk_tile(dk, k, v, q, g, w, zr, wn, a, rb, inv_d, st, p_o, ok2, row_ok, n_rows, ROWS, UB, DMB, BETA,
                          scale)
    _store_kv(DK, DV, dk, dv, b, hk, o_c, col_ok, o_d, T, HKV, D)


@triton.jit
def _dk_tile(dk, k, v, q, g, w, zr, wn, a, rb, inv_d, st, p_o, ok2, row_ok, n_rows, ROWS, UB, DMB, BETA, scale):
    """dk += the [key, query] tile's contribution (f·q + wn·Δμ + x·ρ)."""
    gam = tl.dot(v, tl.trans(g))
    zu = tl.dot(k, tl.trans(tl.load(UB + p_o, mask=ok2, other=0.0))) \
        - tl.load(ROWS + _UQ * n_rows + st, mask=row_ok, other=0.0)[None, :]
    beta = tl.load(BETA + st, mask=row_ok, other=0.0)[None, :]
    lt = tl.load(ROWS + _LT * n_rows + st, mask=row_ok, other=0.0)[None, :]
    f = scale * (gam * a + w * (2 * beta * zr - zu + zu * zr - beta * (1 + zr * zr) + lt))
    dk = tl.dot(f.to(q.dtype), q, dk)
    dk = tl.dot(wn.to(q.dtype), tl.load(DMB + p_o, mask=ok2, other=0.0), dk)
    dk = tl.dot((w * (zu - gam * inv_d[None, :])).to(q.dtype), rb, dk)
    return dk
