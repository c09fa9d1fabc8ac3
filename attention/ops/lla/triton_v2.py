"""Blockwise LLA in Triton, v2: v1's math (``triton.py``) with every CG iteration its own launch.

v1 runs a query tile's whole solve in one program: the statistics pass, ``CG_ITERS`` streamed passes over K
and the output pass, with the CG vectors (x, r, the right-hand side, the centre k̄, the Jacobi diagonal, 5-7
fp32 [BR, D] tiles) live in registers across every key loop. On sm_90 its kernels sit at 255 registers with
1.3-4.7 KB of stack (``bench_lla.py --ptxas``) and spill inside their loops (offline SASS, local loads / stores in
loops at (64, 64, 8 warps): forward 618 / 258, dk/dv 476 / 325). v2 keeps the CG state of every
row in global memory between launches, so a key loop holds only what a flash-attention loop holds (q, the
direction p, one accumulator and the score tiles):

- forward: ``_stats_kernel`` (pass (i): m, ω, μ̃ and the CG start), ``CG_ITERS`` × ``_cg_step_kernel``
  (one matrix-free Σ·p pass over K, then the CG update of its rows), ``_out_kernel`` (pass (iii));
- backward: ``_bwd_a_kernel`` (pass A: τ, Σ c k, μ̃ and the adjoint CG start), ``CG_ITERS`` ×
  ``_cg_step_kernel``, ``_bwd_b_kernel`` (pass B: dq, u, β, dλ, and ρ, u, Δμ in the operand dtype with their
  row scalars), ``_bwd_kv_kernel`` (dk, dv: v1's products on 32-query tiles, from those precomputed operands).

H100, B4 T4096 16/8 heads D128 bf16, LLA-8 (session 11): fwd 11.86 ms (v1 21.76), fwd+bwd 29.50 ms (v1 59.82); per
fwd+bwd the 16 CG steps took 19.8 ms, dk/dv 3.7 (v1's kernel: 12.7), the four passes 5.6. Session 14, with the
direction history below, in one run against that code: fwd+bwd 27.7 ms (29.6-30.2), a CG step 1.075 ms (1.21).
Session 17: the last step of a solve needs only pᵀΣ_c p (two products per key tile): 26.5-27.1 ms (27.4-27.6).

The iterates are v1's (same normalised right-hand side, same rounded direction p, same active mask; the last
step's pᵀΣ_c p is a row sum of w·s², s = p·(k − k̄), instead of pᵀ(Σ_c p): equal in exact arithmetic), so v2
computes v1's function up to floating-point rounding. Each kernel is autotuned on its own (a row's
state does not depend on the tile that produced it); kernels that update state in place restore it while
the autotuner times them.

x is not part of the per-step state: each step writes its direction p_j to its own slot of a history and α_j to
another, and the last step forms x = Σ α_j p_j once (the same products v1 adds, in another order). That
replaced a read and a write of fp32 x in every step (0.14 ms of a 1.21 ms step, H100, session 13) with
(iterations − 1) bf16 direction slots read once. A step moves ~18 bytes per (row, head, channel) (bf16): q, p,
the centre twice (2 bytes each, the operand-dtype copy; 2 × 4 in fp32 before session 20), r in, r and the next p
out. That traffic is not hidden behind the key loops of the SM's other program: H100, B4 T4096 16/8 heads D128
bf16 (session 20), a step took 1.00 ms, its key loop alone 0.73-0.77, its update alone 0.23 (~720 MB at 3.1 TB/s,
the DRAM rate). The history costs (iterations − 1) operand-dtype copies of q while a solve runs.

State buffers ([B, T, HQ, D], rows as q's): r (fp32), the direction history ([iterations, B, T, HQ, D], operand
dtype), the steps' centre (operand dtype; holds the backward's operand-dtype ρ after its solve); x (fp32) is
written into the ρ / u output buffer by the last step; α ([iterations − 1, B, T, HQ] fp32);
per row ([9, B, T, HQ] fp32): rz = rᵀz, the stop threshold, k̄·p, ‖b‖, λω; in the backward also τ and the row
scalars of dk/dv. The forward's k̄ and Jacobi diagonal (fp32, [1 + JACOBI, B, T, HQ, D]) are kept for the
backward, whose solve therefore runs on the forward's Σ_c; pass A reads them instead of recomputing μ̃ (and
Σ w k²), and β = dO·o from the op's output. The op's outputs (o, dq, dk, dv) are written in the inputs' dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.ops.autotune import candidates
from attention.ops.lla import triton as v1
from attention.ops.lla.triton import (LOG2E, _addr, _bwd_a_pass, _bwd_b_pass, _key_tile, _kv_weights, _launch,
                                      _out_pass, _row_program, _rows, _sigma_pass, _stats_pass, _store_kv,
                                      _tile_setup)
from attention.ops.lla.triton_v0 import _centre, _strides
from attention.ops.outputs import empty, empty_like
from attention.ops.tiles import tile_grid

# row-scalar slots of the [N_ROWS, B, T, HQ] state tensor: the CG's (rz, threshold, k̄·p, ‖b‖, λω), τ from pass A,
# and what pass B hands the dk/dv kernel (λ·tr, ρ̂·q, û·q with ρ̂, û the operand-dtype vectors)
_RZ, _THR, _QP, _BN, _RID, _TAU, _LT, _RQ, _UQ = (tl.constexpr(i) for i in range(9))
N_ROWS = 9


@triton.jit
def _q_tile(DS, T, HQ, D: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """A query-tile kernel's rows (program (query tile, b·HQ + h)): batch, head, rows, doc starts, the split key
    range of ``_tile_setup``, state offsets / mask / row-scalar offsets (``_addr``) and the row-slot stride."""
    i_r, i_bh, n_bh = _row_program()
    b, h = i_bh // HQ, i_bh % HQ
    o_r, row_ok, ds, lo, mid1, mid2, hi = _tile_setup(DS, i_r, b, T, BR, BC)
    p_o, ok2, st, row_ok = _addr(b, h, o_r, T, HQ, D, BD)
    return b, h, o_r, row_ok, ds, lo, mid1, mid2, hi, p_o, ok2, st, T * n_bh  # slot stride B·T·HQ


@triton.jit
def _cg_start(bvec, diag, ctr, rid, p_o, ok2, st, row_ok, R, P, CB, ROWS, n_rows, rtol2, JACOBI: tl.constexpr):
    """CG state for Σ_c x = b at x_0 = 0, solved for b/‖b‖ (v1's ``_cg``): r, p_0, rᵀz, threshold, c·p, ‖b‖, λω,
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
    """CG iteration ``it`` for the rows of a query tile: Σ_c p_it streamed over K (v1's ``_matvec``), then α, r,
    z, β updated (v1's ``_cg_regs``, iteration body) and p_it+1 written to the next slot of the direction history
    P ([iterations, B, T, HQ, D]), α_it to ALPHA ([iterations − 1, B, T, HQ]). x = Σ α_j p_j is formed once, by the
    LAST step (which stores x and nothing else), instead of being read and written by every step.

    The centre is CB, k̄ rounded to the operand dtype, in both of its uses: the loop's k·p − c·p and the update's
    Σ_j t_j k_j − (Σ_j t_j) c. Σ_c is then Σ_j w_j (k_j − c)(k_j − c)ᵀ = Σ_c + ω(k̄ − c)(k̄ − c)ᵀ, exactly for any c,
    the same matrix in every step of a solve; fp32 inputs keep c = k̄. The update loads 2 × 2 bytes of centre per
    channel instead of 2 × 4, and with EVEN (T a multiple of BR, D = BD) its tiles are unmasked. H100, B4 T4096
    16/8 heads D128 bf16 (session 20): a step pinned at (64, 64, 4, 3) 1.00 -> 0.95 ms; in the kernel table of an
    LLA-8 fwd+bwd 0.95 -> 0.87-0.90 ms."""
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
    # p (operand dtype) is converted where used. A second load of it here is folded into the first by Triton
    # (TTGIR), and a load it cannot fold measured the same (session 20): the update uses the loop's p.
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
    rid = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=1.0) * om  # λω ridge (spec §5.3)
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
    """Forward pass (iii) (v1's output pass) from ρ_c = x‖μ‖ (x in RHO, replaced by ρ)."""
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


@triton.jit
def _bwd_a_kernel(Q, K, V, LAM, DS, O, DO, DELTA, M, OMEGA, R, P, CTR, CB, DIAG, ROWS, BETA,
                  s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                  T, HQ, qk_scale, rtol2,
                  D: tl.constexpr, G: tl.constexpr, JACOBI: tl.constexpr, PRECISE: tl.constexpr,
                  BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Backward pass A (v1's τ = Σ c, Σ c k and β, from the op's output O) and the CG start for Σ_c u_c = y. The
    centre k̄ and the Jacobi diagonal are the forward's (CTR, DIAG): v1 recomputed μ̃ here, one product per key tile
    more."""
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
    tau, ck, _, _ = _bwd_a_pass(q, g, inv_d, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D, JACOBI,
                                PRECISE, BR, BC, BD, False)
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
    """Backward pass B (v1's) from u_c = x‖y‖ (x in U, replaced by u = Σ⁻¹y): dq, dλ; and for the dk/dv kernel
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
    """dk, dv of a key tile over all q heads of its GQA group and all query tiles of its documents at or below
    the diagonal (v1's ``_lla_bwd_kv_kernel``, same products). The vectors ρ, u, Δμ come in the operand dtype
    and their row scalars precomputed (pass B), and each [key, query] tile is consumed as soon as it is
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
            rb = tl.load(RB + p_o, mask=ok2, other=0.0)  # k·ρ issued before the exponentials (3.58 -> 3.52 ms)
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
    """dk += the [key, query] tile's contribution (v1's f·q + wn·Δμ + x·ρ)."""
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


# ----- tiles: each kernel autotuned on its own, per (D, G, JACOBI, PRECISE, dtypes), never per T -----

def _cfg(br, bc, w, s=2):
    return triton.Config({"BR": br, "BC": bc}, num_warps=w, num_stages=s)


# The CG step holds what a flash-attention forward holds (q, p, one [BR, D] fp32 accumulator, score tiles).
# H100, same shape, ms per launch: (64, 64, 4, 3 stages) 1.21, (64, 64, 4, 2) 1.28, (128, 64, 8, 3) 1.34,
# (128, 64, 8, 2) 1.49, (64, 32, 4) 1.50, (128, 32, 8) 1.76, (64, 64, 8) 2.31, (64, 128, 8) 2.24.
STEP_CONFIGS = [_cfg(64, 64, 4, 3), _cfg(64, 64, 4), _cfg(128, 64, 8, 3)]
# The passes' lists: each kernel pinned on the arguments of an LLA-8 fwd+bwd (H100, B4 T4096 16/8 heads D128 bf16,
# session 19, ms, two reps; `.gpu/exp_lla_tiles.py`), the two or three fastest, the fastest first:
# stats (64, 64, 4, 3) 0.753 / 0.728, (64, 64, 4, 2) 0.791 / 0.786, (128, 64, 8, 3) 0.859 / 0.832;
# output (64, 64, 4, 2) 1.068 / 1.050, (128, 64, 8, 3) 1.094 / 1.051, (64, 32, 4, 3) 1.122 / 1.101;
# pass A (64, 32, 4, 3) 1.021 / 0.964, (64, 64, 4, 2) 1.051 / 1.041, (128, 64, 8, 3) 1.049 / 1.087;
# pass B (128, 64, 8, 3) 1.941 / 1.892, (64, 32, 4, 3) 1.950 / 1.918, (128, 64, 8, 2) 2.035 / 2.045.
# (64, 64, 8, 2), first in the list these replaced, took 1.8-3.4 ms in every pass.
STATS_CONFIGS = [_cfg(64, 64, 4, 3), _cfg(64, 64, 4)]
OUT_CONFIGS = [_cfg(64, 64, 4), _cfg(128, 64, 8, 3)]
BWD_A_CONFIGS = [_cfg(64, 32, 4, 3), _cfg(64, 64, 4)]
BWD_B_CONFIGS = [_cfg(128, 64, 8, 3), _cfg(64, 32, 4, 3)]
_KEY = ["D", "G", "JACOBI", "PRECISE"]
_STATE = ["R", "ROWS"]  # what a step updates in place (it writes the next direction and α to their own slots)
# EVEN: a tile's state rows and channels all exist, so the update's tiles need no masks
_step_kernel = triton.heuristics({"EVEN": lambda a: a["T"] % a["BR"] == 0 and a["D"] == a["BD"]})(_cg_step_kernel)
_step_tuned = triton.autotune(candidates(STEP_CONFIGS), key=_KEY, restore_value=_STATE)(_step_kernel)
_stats_tuned = triton.autotune(candidates(STATS_CONFIGS), key=_KEY)(_stats_kernel)
_out_tuned = triton.autotune(candidates(OUT_CONFIGS), key=["D", "G", "PRECISE"], restore_value=["RHO"])(_out_kernel)
_bwd_a_tuned = triton.autotune(candidates(BWD_A_CONFIGS), key=_KEY)(_bwd_a_kernel)
_bwd_b_tuned = triton.autotune(candidates(BWD_B_CONFIGS), key=["D", "G"], restore_value=["U"])(_bwd_b_kernel)
# dk/dv: BC (keys) is the M dimension of every product, BR (queries) the N or K dimension
# H100, B4 T4096 16/8 heads D128 bf16, ms per launch (session 11): (32, 64, 4) 3.59, (32, 128, 8) 4.05,
# (64, 64, 8) 11.3 (v1's kernel, autotuned: 12.6-13.0 across calls). 64-query tiles spill inside the loop (offline sm_90 SASS);
# dk and dv in two launches measured slower (1.59 + 3.06 ms at their best tiles).
KV_CONFIGS = [_cfg(32, 64, 4), _cfg(32, 128, 8)]
_kv_tuned = triton.autotune(candidates(KV_CONFIGS), key=["D", "G"])(_bwd_kv_kernel)


def _cg_buffers(q, cg_iters):
    """The CG residual r (fp32), the direction history p (operand dtype, one slot per iteration), α (fp32, one slot
    per iteration but the last), the row scalars and the steps' centre (operand dtype)."""
    B, T, HQ, D = q.shape
    r = torch.empty(B, T, HQ, D, device=q.device, dtype=torch.float32)
    p = torch.empty(max(cg_iters, 1), B, T, HQ, D, device=q.device, dtype=q.dtype)
    alpha = torch.empty(max(cg_iters - 1, 1), B, T, HQ, device=q.device, dtype=torch.float32)
    return r, p, alpha, r.new_empty(N_ROWS, B, T, HQ), torch.empty_like(q)


def _centre_views(centre):
    """k̄ and the Jacobi diagonal (k̄ stands in without Jacobi) in the forward's ``centre`` [1 or 2, B, T, HQ, D]."""
    return centre[0], centre[-1]


def _solve(q, k, ds, m, x, r, p, alpha, cb, diag, rows, strides, qk_scale, cg_iters, jacobi, block, const):
    """``cg_iters`` CG steps on the state (r, p[0], rows) that ``_stats_kernel`` / ``_bwd_a_kernel`` started;
    the last one writes x."""
    B, T, HQ, D = q.shape
    if cg_iters == 0:
        x.zero_()
        return
    grid = lambda br, bc: tile_grid(triton.cdiv(T, br), B * HQ)  # noqa: E731
    for it in range(cg_iters):
        _launch(_step_tuned, _step_kernel, grid, block,
                (q, k, ds, m, x, r, p, alpha, cb, diag, rows, *strides[:6], T, HQ, qk_scale, it),
                {**const, "JACOBI": jacobi, "LAST": it == cg_iters - 1})


def lla_fwd_triton(q, k, v, lam, doc_start, scale, cg_iters, jacobi, rtol, block_r=None, block_c=None):
    """v1's contract, but the second output is centre [1 + jacobi, B, T, HQ, D] fp32 (k̄, and the Jacobi diagonal)
    where v1's is its fp32 o: v1's backward reads o and recomputes k̄, this one reads out and the forward's k̄ (one
    product per key tile fewer in pass A, and no fp32 copy of o kept for the backward)."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    out = empty(B, T, HQ, D, device=q.device, dtype=q.dtype)
    rho = empty(B, T, HQ, D, device=q.device, dtype=torch.float32)
    delta, m, om = (empty(B, T, HQ, device=q.device, dtype=torch.float32) for _ in range(3))
    r, p, alpha, rows, cb = _cg_buffers(q, cg_iters)
    centre = empty(1 + bool(jacobi), B, T, HQ, D, device=q.device, dtype=torch.float32)
    ctr, diag = _centre_views(centre)
    block = None if block_r is None else (block_r, block_c)
    qk_scale = scale * LOG2E
    const = {"D": D, "G": HQ // HKV, "PRECISE": v1.PRECISE, "BD": max(16, triton.next_power_of_2(D))}
    strides = _strides(q, k, lam)
    grid = lambda br, bc: tile_grid(triton.cdiv(T, br), B * HQ)  # noqa: E731
    # the solve's x goes into rho's buffer
    _launch(_stats_tuned, _stats_kernel, grid, block,
            (q, k, lam, doc_start, m, om, r, p, ctr, cb, diag, rows, *strides, T, HQ, qk_scale, rtol**2),
            {**const, "JACOBI": jacobi})
    _solve(q, k, doc_start, m, rho, r, p, alpha, cb, diag, rows, strides, qk_scale, cg_iters, jacobi, block, const)
    _launch(_out_tuned, _out_kernel, grid, block,
            (q, k, v, doc_start, m, om, ctr, rows, out, rho, delta, *strides[:6], T, HQ, qk_scale), const)
    return out, centre, rho, delta, m, om


def lla_bwd_triton(q, k, v, lam, doc_start, doc_end, out, centre, do, rho, delta, m, om, scale, cg_iters, jacobi,
                   rtol, block_r=None, block_c=None):
    """v1's contract (centre in the place of v1's o). Returns dq [B, T, HQ, D], dk, dv [B, T, HKV, D] in the dtypes
    of q, k, v and dlam [B, T, HQ] fp32."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    do = do.to(q.dtype).contiguous()
    dq = empty_like(q)
    u = torch.empty_like(rho)
    beta, dlam = rho.new_empty(B, T, HQ), empty(B, T, HQ, device=q.device, dtype=torch.float32)
    r, p, alpha, rows, cb = _cg_buffers(q, cg_iters)
    ctr, diag = _centre_views(centre)
    block = None if block_r is None else (block_r, block_c)
    qk_scale = scale * LOG2E
    const = {"D": D, "G": HQ // HKV, "BD": max(16, triton.next_power_of_2(D))}
    strides = _strides(q, k, lam)
    grid = lambda br, bc: tile_grid(triton.cdiv(T, br), B * HQ)  # noqa: E731
    # the solve's x goes into u's buffer
    _launch(_bwd_a_tuned, _bwd_a_kernel, grid, block,
            (q, k, v, lam, doc_start, out, do, delta, m, om, r, p, ctr, cb, diag, rows, beta, *strides,
             T, HQ, qk_scale, rtol**2),
            {**const, "JACOBI": jacobi, "PRECISE": v1.PRECISE})
    _solve(q, k, doc_start, m, u, r, p, alpha, cb, diag, rows, strides, qk_scale, cg_iters, jacobi, block,
           {**const, "PRECISE": v1.PRECISE})
    p = p[0]  # Δμ goes into the first direction slot
    rb, ub = cb, torch.empty_like(p)  # ρ, u in the operand dtype (the solve's centre is free now)
    _launch(_bwd_b_tuned, _bwd_b_kernel, grid, block,
            (q, k, v, lam, doc_start, do, rho, delta, m, om, ctr, rows, beta, dq, u, dlam, rb, ub, p, *strides,
             T, HQ, scale, qk_scale), const)
    dk, dv = empty_like(k), empty_like(v)
    _launch(_kv_tuned, _bwd_kv_kernel, lambda br, bc: tile_grid(triton.cdiv(T, bc), B * HKV), block,
            (q, k, v, doc_start, doc_end, do, m, delta, beta, rows, rb, ub, p, dk, dv, *strides[:6],
             T, HQ, HKV, scale, qk_scale), const)
    return dq, dk, dv, dlam
