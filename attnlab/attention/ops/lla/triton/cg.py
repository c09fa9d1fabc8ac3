"""Conjugate gradients for the LLA solves, one launch per iteration, the state in global memory.

Forward (Σ_c ρ_c = μ) and backward adjoint (Σ_c u_c = y) solve with the same kernel. ``_cg_start`` writes the
state from a pass that ends with the right-hand side (``fwd._stats_kernel``, ``bwd._bwd_a_kernel``);
``_cg_step_kernel`` runs one matrix-free Σ_c·p over K and the CG update of its rows. Between launches a row's state
lives in global memory (rows as q's, [B, T, HQ, D]): r (fp32), the direction history p ([iterations, B, T, HQ, D],
operand dtype), α ([iterations − 1, B, T, HQ]) and the row scalars ([N_ROWS, B, T, HQ], ``common._RZ`` ...), so a
key loop holds only what a flash-attention loop holds (q, p, one accumulator, score tiles). x = Σ_j α_j p_j is
formed once, by the last step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnlab.attention.ops.lla.triton.common import _BN, _QP, _RID, _RZ, _THR, _q_tile, _rows, _sigma_pass


@triton.jit
def _cg_start(bvec, diag, ctr, rid, p_o, ok2, st, row_ok, R, P, CB, ROWS, n_rows, rtol2, JACOBI: tl.constexpr):
    """CG state for Σ_c x = b at x_0 = 0, solved for b/‖b‖: r, p_0, rᵀz, threshold, c·p, ‖b‖, λω,
    and the centre c the solve's steps read, k̄ in the operand dtype (CB; see ``_cg_step_kernel``).
    x is never stored during the solve: the last step sums it from the directions (``_cg_step_kernel``)."""
    bn = tl.sqrt(tl.sum(bvec * bvec, 1))
    bn = tl.where(bn > 0, bn, 1.0)
    r = bvec / bn[:, None]
    if JACOBI:
        z = r / diag
    else:
        z = r
    p = z.to(P.dtype.element_ty)
    tl.store(R + p_o, r, mask=ok2)
    tl.store(P + p_o, p, mask=ok2)
    tl.store(ROWS + _RZ * n_rows + st, tl.sum(r * z, 1), mask=row_ok)
    tl.store(ROWS + _THR * n_rows + st, rtol2 * tl.sum(r * r, 1), mask=row_ok)
    cb = ctr.to(CB.dtype.element_ty)
    tl.store(CB + p_o, cb, mask=ok2)
    tl.store(ROWS + _QP * n_rows + st, tl.sum(cb.to(tl.float32) * p.to(tl.float32), 1), mask=row_ok)
    tl.store(ROWS + _BN * n_rows + st, bn, mask=row_ok)
    tl.store(ROWS + _RID * n_rows + st, rid, mask=row_ok)


@triton.jit
def _ld(ptr, ok2, EVEN: tl.constexpr, other: tl.constexpr = 0.0):
    """A [BR, D] state tile: unmasked when the rows and channels fill every tile (EVEN)."""
    if EVEN:
        return tl.load(ptr)
    return tl.load(ptr, mask=ok2, other=other)


@triton.jit
def _st(ptr, val, ok2, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, val)
    else:
        tl.store(ptr, val, mask=ok2)


@triton.jit(do_not_specialize=["it"])  # one compile for every iteration index
def _cg_step_kernel(Q, K, DS, M, X, R, P, ALPHA, CB, DIAG, ROWS,
                    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
                    T, HQ, qk_scale, it,
                    D: tl.constexpr, G: tl.constexpr, JACOBI: tl.constexpr, PRECISE: tl.constexpr,
                    LAST: tl.constexpr, EVEN: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """CG iteration ``it`` for the rows of a query tile: Σ_c p_it streamed over K, then α, r, z, β updated and
    p_it+1 written to the next slot of the direction history P ([iterations, B, T, HQ, D]), α_it to ALPHA
    ([iterations − 1, B, T, HQ]). The LAST step needs only pᵀΣ_c p (two products per key tile instead of three),
    forms x = Σ_j α_j p_j and stores x and nothing else.

    The centre is CB, k̄ rounded to the operand dtype, in both of its uses: the loop's k·p − c·p and the update's
    Σ_j t_j k_j − (Σ_j t_j) c. Σ_c is then Σ_j w_j (k_j − c)(k_j − c)ᵀ = Σ_c + ω(k̄ − c)(k̄ − c)ᵀ, exactly for any c,
    the same matrix in every step of a solve; fp32 inputs keep c = k̄. With EVEN (T a multiple of BR, D = BD) the
    update's tiles are unmasked."""
    b, h, o_r, row_ok, ds, lo, mid1, mid2, hi, p_o, ok2, st, n_rows = _q_tile(DS, T, HQ, D, BR, BC, BD)
    q = _rows(Q + b * s_qb + h * s_qh, o_r, tl.arange(0, BD), s_qt, T, D, True)
    K += b * s_kb + (h // G) * s_kh
    slot = n_rows.to(tl.int64) * D
    P_it = P + it * slot
    p = _ld(P_it + p_o, ok2, EVEN)
    m2 = tl.load(M + st, mask=row_ok, other=0.0)
    qp = tl.load(ROWS + _QP * n_rows + st, mask=row_ok, other=0.0)
    # the last step needs only pᵀΣ_c p (for α), a row sum: two products per key tile instead of three
    acc, rs = _sigma_pass(q, p, qp, m2, K, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D, PRECISE, BR, BC, BD,
                          LAST)
    # -- the CG update: everything below is loaded after the key loop, so none of it is live inside it; each
    # [BR, D] tile is stored as soon as it is final (fewer live fp32 tiles, fewer spills) --
    rid = tl.load(ROWS + _RID * n_rows + st, mask=row_ok, other=0.0)
    # p (operand dtype) is converted where used; the update reuses the loop's p rather than loading it again.
    if LAST:
        pap = rs + rid * tl.sum(p.to(tl.float32) * p.to(tl.float32), 1)
    else:
        ap = acc - rs[:, None] * _ld(CB + p_o, ok2, EVEN).to(tl.float32) + rid[:, None] * p.to(tl.float32)
        pap = tl.sum(p.to(tl.float32) * ap, 1)
    r = _ld(R + p_o, ok2, EVEN)
    rz = tl.load(ROWS + _RZ * n_rows + st, mask=row_ok, other=0.0)
    thr = tl.load(ROWS + _THR * n_rows + st, mask=row_ok, other=0.0)
    active = (pap > 0) & (pap < float("inf")) & (tl.sum(r * r, 1) > thr)
    alpha = tl.where(active, rz / tl.where(active, pap, 1.0), 0.0)
    if LAST:
        x = alpha[:, None] * p.to(tl.float32)
        for j in range(it):
            a_j = tl.load(ALPHA + j * n_rows + st, mask=row_ok, other=0.0)
            x += a_j[:, None] * tl.load(P + j * slot + p_o, mask=ok2, other=0.0).to(tl.float32)
        tl.store(X + p_o, x, mask=ok2)
    else:
        tl.store(ALPHA + it * n_rows + st, alpha, mask=row_ok)
        r -= alpha[:, None] * ap
        _st(R + p_o, r, ok2, EVEN)
        if JACOBI:
            z = r / _ld(DIAG + p_o, ok2, EVEN, 1.0)
        else:
            z = r
        rz_new = tl.sum(r * z, 1)
        beta = tl.where(active, rz_new / tl.where(rz > 0, rz, 1.0), 0.0)
        p = tl.where(active[:, None], z + beta[:, None] * p.to(tl.float32), p.to(tl.float32)).to(p.dtype)
        _st(P_it + slot + p_o, p, ok2, EVEN)
        tl.store(ROWS + _RZ * n_rows + st, tl.where(active, rz_new, rz), mask=row_ok)
        tl.store(ROWS + _QP * n_rows + st, tl.sum(_ld(CB + p_o, ok2, EVEN).to(tl.float32) * p.to(tl.float32), 1),
                 mask=row_ok)
