"""LLA forward: pass (i) statistics and the CG start, pass (iii) output (docs/kernels.md, "LLA").

The solve between them is ``cg._cg_step_kernel``. ρ is solved in the k̄-centred form Σ_c ρ_c = μ (Sherman–Morrison
back to ρ, as in docs/kernels.md, LLA), which keeps δ = ω − μ·ρ > 0 under truncated CG.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnlab.attention.ops.lla.triton.cg import _cg_start
from attnlab.attention.ops.lla.triton.common import _BN, _centre, _out_pass, _q_tile, _rows, _stats_pass


@triton.jit
def _stats_kernel(Q, K, LAM, DS, M, OMEGA, R, P, CTR, CB, DIAG, ROWS,
                  s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                  T, HQ, qk_scale, rtol2,
                  D: tl.constexpr, G: tl.constexpr, JACOBI: tl.constexpr, PRECISE: tl.constexpr,
                  BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Forward pass (i) (online m, ω, μ̃, Jacobi diagonal) and the CG start for Σ_c ρ_c = μ."""
    b, h, o_r, row_ok, ds, lo, mid1, mid2, hi, p_o, ok2, st, n_rows = _q_tile(DS, T, HQ, D, BR, BC, BD)
    q = _rows(Q + b * s_qb + h * s_qh, o_r, tl.arange(0, BD), s_qt, T, D, True)
    K += b * s_kb + (h // G) * s_kh
    m2, om, mut, ksq = _stats_pass(q, K, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D, JACOBI, PRECISE, BR, BC, BD)
    rid = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=1.0) * om  # λω ridge (docs/mechanisms.md, LLA)
    om1, ctr, diag = _centre(mut, om, ksq, rid)
    tl.store(M + st, m2, mask=row_ok)
    tl.store(OMEGA + st, om, mask=row_ok)
    tl.store(CTR + p_o, ctr, mask=ok2)
    if JACOBI:
        tl.store(DIAG + p_o, diag, mask=ok2)
    _cg_start(mut - om[:, None] * q.to(tl.float32), diag, ctr, rid, p_o, ok2, st, row_ok, R, P, CB, ROWS, n_rows,
              rtol2, JACOBI)


@triton.jit
def _out_kernel(Q, K, V, DS, M, OMEGA, CTR, ROWS, O, RHO, DELTA,
                s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
                T, HQ, qk_scale,
                D: tl.constexpr, G: tl.constexpr, PRECISE: tl.constexpr,
                BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Forward pass (iii) (LLA paper eq. 16, centred) from ρ_c = x‖μ‖ (x in RHO, replaced by ρ). Writes o in q's
    dtype, ρ and δ (fp32). δ is the fp32 sum of the rounded score numerators used for P@V, so the output is an
    exact affine combination of the v_j even in bf16."""
    b, h, o_r, row_ok, ds, lo, mid1, mid2, hi, p_o, ok2, st, n_rows = _q_tile(DS, T, HQ, D, BR, BC, BD)
    q = _rows(Q + b * s_qb + h * s_qh, o_r, tl.arange(0, BD), s_qt, T, D, True)
    K += b * s_kb + (h // G) * s_kh
    V += b * s_kb + (h // G) * s_kh
    m2 = tl.load(M + st, mask=row_ok, other=0.0)
    om = tl.load(OMEGA + st, mask=row_ok, other=0.0)
    bn = tl.load(ROWS + _BN * n_rows + st, mask=row_ok, other=1.0)
    rho = tl.load(RHO + p_o, mask=ok2, other=0.0) * bn[:, None]
    ctr = tl.load(CTR + p_o, mask=ok2, other=0.0)
    om1 = tl.where(om > 0, om, 1.0)
    t1 = 1 + om * tl.sum((ctr - q.to(tl.float32)) * rho, 1) / om1  # 1 + μ·ρ_c/ω, μ = ω(k̄ − q)
    if PRECISE:
        rho_b = rho
    else:
        rho_b = rho.to(q.dtype)
    rq = tl.sum(rho_b.to(tl.float32) * ctr, 1)
    acc, den = _out_pass(q, rho_b, rq, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D, BR, BC, BD)
    tl.store(O + p_o, (acc / den[:, None]).to(O.dtype.element_ty), mask=ok2)  # the op's output, in q's dtype
    rho = tl.load(RHO + p_o, mask=ok2, other=0.0) * (bn / t1)[:, None]  # reloaded: not live through the loop
    tl.store(RHO + p_o, rho, mask=ok2)
    tl.store(DELTA + st, om / t1, mask=row_ok)
