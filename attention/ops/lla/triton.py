"""Blockwise LLA in Triton, v1 (FlashLLA, spec ``lla.md`` §5-6, errata fixed, λω ridge, exact backward).

Three kernels, each a program per (query or key tile, batch, head); no T×T and no T×d×d tensor exists:

- ``_lla_fwd_kernel``: pass (i) online statistics m, ω, μ̃ (and the Jacobi diagonal) over the key tiles;
  pass (ii) CG for ρ (``CG_ITERS`` streamed passes over K, matrix-free Σ·p); pass (iii) output (eq. 16).
  Writes o, ρ, δ, m (log2 units), ω.
- ``_lla_bwd_q_kernel``: pass A accumulates τ = Σ c and Σ c k; the adjoint CG solve for u; pass B
  accumulates F·K (and u·μ) for dq. Writes dq, u, β and dλ.
- ``_lla_bwd_kv_kernel``: per key tile (all q heads of its GQA group, all query tiles of its documents at or
  below the diagonal): dk and dv, with the tiles held transposed ([key, query]) so no operand is transposed
  for the dk/dv products.

The math is the one of ``chunked.py`` (its docstring derives it). Differences to v0 (``triton_v0.py``), all
for speed on tensor cores:

- tensor-core operands in the input dtype (bf16 → bf16 wgmma at twice the TF32 rate, half the registers
  and shared memory), fp32 accumulation; everything outside the dots (CG vectors x, r, the row scalars,
  ω, τ, δ) stays fp32. Rounded operands: the weight products w⊙(·) (as P in flash attention), the CG
  direction p (the rounded p *is* the direction: x and r are updated with the same rounded p that Σ
  multiplied, so CG stays consistent), ρ, u and Δμ in the z·ρ / z·u products. fp32 inputs keep fp32 dots.
- matvec in centred form Σp = Σ_j t_j k_j − (Σ_j t_j) q + λω p with t_j = w_j(k_j·p − q·p): μ̃ is not
  needed inside CG (fewer live registers), and t is rounded once so Σ·p is exactly Σ_j t̂_j z_j.
- δ is the fp32 sum of the rounded score numerators used for P@V (= ω − μ·ρ in exact arithmetic for any
  ρ), so the output is an exact affine combination of the v_j (scores sum to 1) even in bf16.
- backward: z·Δμ = 2β z·ρ − z·u (one GEMM less per tile in both kernels); u·μ = Σ_j w_j z_j·u is summed
  in pass B, so pass A needs no μ̃ GEMM (3 instead of 4 GEMMs, 4 with Jacobi).
- masks (causal, document start, T) only on the key tiles that need them: the key range of a query tile is
  split into masked head [lo, mid1), unmasked body [mid1, mid2), masked diagonal [mid2, hi).
- exp2 with log2(e) folded into the logit scale; heaviest tiles first: the query tiles of one (batch, head) after
  another's but for a last group of pairs, the dk/dv key tiles in groups of (batch, kv head) pairs
  (``attention/ops/tiles.py``).
- tiles autotuned per (D, G, CG_ITERS, JACOBI, dtypes), not per T; ``block=(BR, BC)`` pins a tile.

Varlen documents enter as ``doc_start``/``doc_end`` per token ([B, T] int32): query i sees keys
doc_start[i] ≤ j ≤ i. Layout [B, T, H, D] with unit stride on D; D is padded to a power of two with zero
masks (padded coordinates stay exactly 0 through CG).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attention.ops.autotune import candidates
from attention.ops.lla.triton_v0 import _centre, _strides
from attention.ops.outputs import empty, empty_like
from attention.ops.tiles import GROUP_PROGRAMS, TAIL_PROGRAMS, tile_grid, tile_program

LOG2E = 1.4426950408889634


@triton.jit
def _rows(P, o_t, o_d, s_t, T, D: tl.constexpr, MASK: tl.constexpr):
    """Rows o_t of a [T, D] slab (stride s_t), native dtype, zero padded. [len(o_t), BD]."""
    ptr = P + o_t[:, None] * s_t + o_d[None, :]
    if MASK:
        return tl.load(ptr, mask=(o_t[:, None] < T) & (o_d[None, :] < D), other=0.0)
    elif D == o_d.shape[0]:  # interior tile, D a power of two: no mask at all
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=o_d[None, :] < D, other=0.0)


@triton.jit
def _w(q, k, qk_scale, m2, o_r, o_c, ds, T, MASK: tl.constexpr):
    """w = 2^(qk_scale·q kᵀ − m2) (= exp(scale q·k − m)), 0 on invisible pairs. [BR, BC] fp32."""
    s = tl.dot(q, tl.trans(k)) * qk_scale - m2[:, None]
    if MASK:
        ok = (o_c[None, :] <= o_r[:, None]) & (o_c[None, :] >= ds[:, None]) & (o_c[None, :] < T)
        s = tl.where(ok, s, float("-inf"))
    return tl.exp2(s)


@triton.jit
def _stats_tiles(q, K, s_kt, o_r, ds, m2, om, mut, ksq, a, b, qk_scale, T, D: tl.constexpr,
                 JACOBI: tl.constexpr, PRECISE: tl.constexpr, MASK: tl.constexpr, BC: tl.constexpr,
                 BD: tl.constexpr):
    o_d = tl.arange(0, BD)
    for start in range(a, b, BC):
        o_c = start + tl.arange(0, BC)
        k = _rows(K, o_c, o_d, s_kt, T, D, MASK)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASK:
            ok = (o_c[None, :] <= o_r[:, None]) & (o_c[None, :] >= ds[:, None]) & (o_c[None, :] < T)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m2, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m2 - m_safe)
        if PRECISE:  # fp32 weights (TF32 dots on GPU)
            p = tl.exp2(s - m_safe[:, None])
            kf = k.to(tl.float32)
        else:
            p = tl.exp2(s - m_safe[:, None]).to(k.dtype)
            kf = k
        om = om * alpha + tl.sum(p.to(tl.float32), 1)
        mut = mut * alpha[:, None] + tl.dot(p, kf)
        if JACOBI:
            ksq = ksq * alpha[:, None] + tl.dot(p, kf * kf)
        m2 = m_new
    return m2, om, mut, ksq


@triton.jit
def _sigma_tiles(acc, rs, q, p, qp, m2, K, s_kt, o_r, ds, a, b, qk_scale, T, D: tl.constexpr,
                 PRECISE: tl.constexpr, MASK: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                 QUAD: tl.constexpr = False):
    """acc += Σ_j t_j k_j, rs += Σ_j t_j with t_j = w_j (k_j·p − q·p), over key tiles [a, b).
    QUAD: only rs += Σ_j t_j (k_j·p − q·p) = pᵀΣ_c p − λω‖p‖² (two products per tile, acc untouched)."""
    o_d = tl.arange(0, BD)
    for start in range(a, b, BC):
        o_c = start + tl.arange(0, BC)
        k = _rows(K, o_c, o_d, s_kt, T, D, MASK)
        w = _w(q, k, qk_scale, m2, o_r, o_c, ds, T, MASK)
        s = tl.dot(p, tl.trans(k)) - qp[:, None]
        t = w * s
        if QUAD:
            rs += tl.sum(t * s, 1)
        elif PRECISE:  # fp32 t (TF32 dot on GPU)
            acc += tl.dot(t, k.to(tl.float32))
            rs += tl.sum(t, 1)
        else:
            t = t.to(k.dtype)
            acc += tl.dot(t, k)
            rs += tl.sum(t.to(tl.float32), 1)
    return acc, rs


@triton.jit
def _matvec(p, q, ctr, rid, m2, ds, o_r, K, s_kt, lo, mid1, mid2, hi, qk_scale, T, D: tl.constexpr,
            PRECISE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Σ_c p (eq. 13 in the centred form, keys centred at ``ctr`` = k̄, ``lla.naive.from_centred``; the weights come
    from q) for the rows of the tile, streaming K once. p: [BR, BD] operand dtype."""
    qp = tl.sum(ctr * p.to(tl.float32), 1)
    acc, rs = _sigma_pass(q, p, qp, m2, K, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D, PRECISE, BR, BC, BD)
    return acc - rs[:, None] * ctr + rid[:, None] * p.to(tl.float32)


@triton.jit
def _cg(b, diag, q, ctr, rid, m2, ds, o_r, K, s_kt, lo, mid1, mid2, hi, qk_scale, rtol2, T, X, RS, p_o, ok2,
        D: tl.constexpr, CG_ITERS: tl.constexpr, JACOBI: tl.constexpr, PRECISE: tl.constexpr,
        SCRATCH: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Batched (Jacobi-)CG for Σ_i x_i = b_i, x_0 = 0, active mask of Algorithm 2. The direction p is kept
    in the operand dtype; x and r are updated with that same (rounded) p and its exact product Σp.
    Solved for b/‖b‖ (CG is scale-equivariant) so p stays O(1) in bf16/fp16 whatever ω is.
    SCRATCH: x and r live in global memory (X, RS at offsets p_o: this tile's own rows, L2-resident) between
    iterations, so only p, q and the Σp accumulator are live during the key loop (no register spills)."""
    bn = tl.sqrt(tl.sum(b * b, 1))
    bn = tl.where(bn > 0, bn, 1.0)
    b = b / bn[:, None]
    if SCRATCH:
        x = _cg_scratch(b, diag, q, ctr, rid, m2, ds, o_r, K, s_kt, lo, mid1, mid2, hi, qk_scale, rtol2, T, X, RS,
                        p_o, ok2, D, CG_ITERS, JACOBI, PRECISE, BR, BC, BD)
    else:
        x = _cg_regs(b, diag, q, ctr, rid, m2, ds, o_r, K, s_kt, lo, mid1, mid2, hi, qk_scale, rtol2, T,
                     D, CG_ITERS, JACOBI, PRECISE, BR, BC, BD)
    return x * bn[:, None]


@triton.jit
def _cg_regs(b, diag, q, ctr, rid, m2, ds, o_r, K, s_kt, lo, mid1, mid2, hi, qk_scale, rtol2, T,
             D: tl.constexpr, CG_ITERS: tl.constexpr, JACOBI: tl.constexpr, PRECISE: tl.constexpr,
             BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """_cg with x and r in registers."""
    x = tl.zeros_like(b)
    r = b
    if JACOBI:
        z = r / diag
    else:
        z = r
    p = z.to(q.dtype)
    rz = tl.sum(r * z, 1)
    thresh = rtol2 * tl.sum(b * b, 1)
    for _ in range(CG_ITERS):
        ap = _matvec(p, q, ctr, rid, m2, ds, o_r, K, s_kt, lo, mid1, mid2, hi, qk_scale, T, D, PRECISE, BR, BC, BD)
        pf = p.to(tl.float32)
        pap = tl.sum(pf * ap, 1)
        active = (pap > 0) & (pap < float("inf")) & (tl.sum(r * r, 1) > thresh)
        alpha = tl.where(active, rz / tl.where(active, pap, 1.0), 0.0)
        x += alpha[:, None] * pf
        r -= alpha[:, None] * ap
        if JACOBI:
            z = r / diag
        else:
            z = r
        rz_new = tl.sum(r * z, 1)
        beta = tl.where(active, rz_new / tl.where(rz > 0, rz, 1.0), 0.0)
        p = tl.where(active[:, None], z + beta[:, None] * pf, pf).to(q.dtype)
        rz = tl.where(active, rz_new, rz)
    return x


@triton.jit
def _cg_scratch(b, diag, q, ctr, rid, m2, ds, o_r, K, s_kt, lo, mid1, mid2, hi, qk_scale, rtol2, T, X, RS, p_o, ok2,
                D: tl.constexpr, CG_ITERS: tl.constexpr, JACOBI: tl.constexpr, PRECISE: tl.constexpr,
                BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """_cg with x and r in global scratch (same iterates)."""
    tl.store(X + p_o, tl.zeros_like(b), mask=ok2)
    tl.store(RS + p_o, b, mask=ok2)
    if JACOBI:
        z0 = b / diag
    else:
        z0 = b
    p = z0.to(q.dtype)
    rz = tl.sum(b * z0, 1)
    rr = tl.sum(b * b, 1)
    thresh = rtol2 * rr
    tl.debug_barrier()
    for _ in range(CG_ITERS):
        ap = _matvec(p, q, ctr, rid, m2, ds, o_r, K, s_kt, lo, mid1, mid2, hi, qk_scale, T, D, PRECISE, BR, BC, BD)
        pf = p.to(tl.float32)
        pap = tl.sum(pf * ap, 1)
        active = (pap > 0) & (pap < float("inf")) & (rr > thresh)
        alpha = tl.where(active, rz / tl.where(active, pap, 1.0), 0.0)
        xi = tl.load(X + p_o, mask=ok2, other=0.0) + alpha[:, None] * pf
        tl.store(X + p_o, xi, mask=ok2)
        ri = tl.load(RS + p_o, mask=ok2, other=0.0) - alpha[:, None] * ap
        tl.store(RS + p_o, ri, mask=ok2)
        if JACOBI:
            zi = ri / diag
        else:
            zi = ri
        rz_new = tl.sum(ri * zi, 1)
        rr = tl.sum(ri * ri, 1)
        beta = tl.where(active, rz_new / tl.where(rz > 0, rz, 1.0), 0.0)
        p = tl.where(active[:, None], zi + beta[:, None] * pf, pf).to(q.dtype)
        rz = tl.where(active, rz_new, rz)
        tl.debug_barrier()  # scratch written above is read by other threads next iteration
    return tl.load(X + p_o, mask=ok2, other=0.0)


@triton.jit
def _addr(b, h, o_r, T, HQ, D: tl.constexpr, BD: tl.constexpr):
    """Offsets of a tile's rows in the [B, T, HQ, D] state / output buffers, their mask, and the row-scalar
    offsets in [B, T, HQ]."""
    o_d = tl.arange(0, BD)
    row_ok = o_r < T
    p_o = (b * T + o_r[:, None]) * HQ * D + h * D + o_d[None, :]
    ok2 = row_ok[:, None] & (o_d[None, :] < D)
    return p_o, ok2, (b * T + o_r) * HQ + h, row_ok


@triton.jit
def _key_tile(DE, K, V, s_kb, s_kt, s_kh, T, HKV, D: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
              BD: tl.constexpr):
    """A dk/dv kernel's key tile (program (key tile, b·HKV + kv head), in groups of pairs, ``tiles.GROUP_PROGRAMS``):
    batch, kv head, first key, keys, their mask, channels, the query range [q_lo, q_hi) that can see them (their
    documents, from the diagonal's query tile on), the key / value rows, and the number of (batch, kv head) pairs."""
    i_c, i_bh, _, n_bh = tile_program(GROUP_PROGRAMS)  # key tile 0 sees the most queries: heaviest first
    b, hk = i_bh // HKV, i_bh % HKV
    c0 = i_c * BC
    o_c = c0 + tl.arange(0, BC)
    col_ok = o_c < T
    o_d = tl.arange(0, BD)
    de = tl.load(DE + b * T + o_c, mask=col_ok, other=0)
    q_lo = (c0 // BR) * BR
    q_hi = tl.max(de, 0)  # queries of the same documents only
    k = _rows(K + b * s_kb + hk * s_kh, o_c, o_d, s_kt, T, D, True)
    v = _rows(V + b * s_kb + hk * s_kh, o_c, o_d, s_kt, T, D, True)
    return b, hk, c0, o_c, col_ok, o_d, q_lo, q_hi, k, v, n_bh


@triton.jit
def _store_kv(DK, DV, dk, dv, b, hk, o_c, col_ok, o_d, T, HKV, D: tl.constexpr):
    """dk, dv of a key tile into the [B, T, HKV, D] gradients."""
    p_k = (b * T + o_c[:, None]) * HKV * D + hk * D + o_d[None, :]
    ok2 = col_ok[:, None] & (o_d[None, :] < D)
    tl.store(DK + p_k, dk.to(DK.dtype.element_ty), mask=ok2)
    tl.store(DV + p_k, dv.to(DV.dtype.element_ty), mask=ok2)


@triton.jit
def _row_program():
    """(query tile, b·H + h, B·H) of a row kernel's program: the heaviest (last) tile first, one (batch, head) pair's
    tiles after another's but for a last group of pairs (``tiles.TAIL_PROGRAMS``)."""
    rank, i_bh, n_t, n_bh = tile_program(TAIL_PROGRAMS, True)
    return n_t - 1 - rank, i_bh, n_bh


@triton.jit
def _tile_setup(DS, i_r, b, T, BR: tl.constexpr, BC: tl.constexpr):
    """Query tile i_r's rows and its key range split [lo, mid1) masked, [mid1, mid2) unmasked,
    [mid2, hi) masked (every bound but hi a multiple of BC)."""
    row0 = i_r * BR
    o_r = row0 + tl.arange(0, BR)
    row_ok = o_r < T
    ds = tl.load(DS + b * T + o_r, mask=row_ok, other=0)
    lo = (tl.min(tl.where(row_ok, ds, T), 0) // BC) * BC
    hi = tl.minimum(row0 + BR, T)
    full_lo = tl.cdiv(tl.max(ds, 0), BC) * BC  # tiles from here on see no document start
    full_hi = ((row0 + 1) // BC) * BC  # tiles below here are entirely causal-visible
    mid1 = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid2 = tl.maximum(tl.minimum(full_hi, hi), mid1)
    return o_r, row_ok, ds, lo, mid1, mid2, hi


@triton.jit
def _out_tiles(acc, den, q, rho, rq, m2, K, V, s_kt, o_r, ds, a, b, qk_scale, T, D: tl.constexpr,
               MASK: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    o_d = tl.arange(0, BD)
    for start in range(a, b, BC):
        o_c = start + tl.arange(0, BC)
        k = _rows(K, o_c, o_d, s_kt, T, D, MASK)
        v = _rows(V, o_c, o_d, s_kt, T, D, MASK)
        w = _w(q, k, qk_scale, m2, o_r, o_c, ds, T, MASK)
        a_ = (w * (1 - (tl.dot(rho, tl.trans(k.to(rho.dtype))) - rq[:, None]))).to(rho.dtype)
        acc += tl.dot(a_, v.to(rho.dtype))
        den += tl.sum(a_.to(tl.float32), 1)
    return acc, den


@triton.jit
def _lla_fwd_kernel(Q, K, V, LAM, DS, O, RHO, DELTA, M, OMEGA,
                    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                    T, HQ, qk_scale, rtol2,
                    D: tl.constexpr, G: tl.constexpr, CG_ITERS: tl.constexpr, JACOBI: tl.constexpr, PRECISE: tl.constexpr,
                    SCRATCH: tl.constexpr,
                    BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    i_r, i_bh, _ = _row_program()
    b, h = i_bh // HQ, i_bh % HQ
    o_r, row_ok, ds, lo, mid1, mid2, hi = _tile_setup(DS, i_r, b, T, BR, BC)
    o_d = tl.arange(0, BD)
    Q += b * s_qb + h * s_qh
    K += b * s_kb + (h // G) * s_kh
    V += b * s_kb + (h // G) * s_kh
    q = _rows(Q, o_r, o_d, s_qt, T, D, True)
    lam = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=1.0)
    # -- pass (i): statistics --
    m2, om, mut, ksq = _stats_pass(q, K, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D, JACOBI, PRECISE, BR, BC, BD)
    rid = lam * om  # λω ridge (spec §5.3): the output does not depend on m
    qf = q.to(tl.float32)
    mu = mut - om[:, None] * qf
    om1, ctr, diag = _centre(mut, om, ksq, rid)  # diag is read only under JACOBI (ksq stays 0 otherwise)
    # -- pass (ii): CG --
    p_o = (b * T + o_r[:, None]) * HQ * D + h * D + o_d[None, :]
    ok2 = row_ok[:, None] & (o_d[None, :] < D)
    rho = _cg(mu, diag, q, ctr, rid, m2, ds, o_r, K, s_kt, lo, mid1, mid2, hi, qk_scale, rtol2, T, RHO, O, p_o, ok2,
              D, CG_ITERS, JACOBI, PRECISE, SCRATCH, BR, BC, BD)  # scratch: x in RHO, r in O
    # -- pass (iii): output, eq. 16; δ = Σ_j of the very score numerators used (= ω − μ·ρ exactly) --
    if PRECISE:  # fp32 ρ and scores: Σ_j a_j = δ ≪ Σ_j |a_j| on ill-conditioned rows, bf16 a_j lose o
        rho_b = rho
    else:
        rho_b = rho.to(q.dtype)
    rq = tl.sum(rho_b.to(tl.float32) * ctr, 1)  # scores w_j (1 − (k_j − k̄)·ρ_c): Σ_j = ω, no 1/δ amplification
    acc, den = _out_pass(q, rho_b, rq, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D, BR, BC, BD)
    o = acc / den[:, None]
    t1 = 1 + tl.sum(mu * rho, 1) / om1  # ρ_c = Σ_c⁻¹μ -> ρ = Σ⁻¹μ, δ = ω − μ·ρ (Sherman–Morrison)
    rho = rho / t1[:, None]
    den = om / t1
    st = (b * T + o_r) * HQ + h  # [B, T, HQ] fp32 row statistics (computed here: not live through the passes)
    tl.store(O + p_o, o, mask=ok2)
    tl.store(RHO + p_o, rho, mask=ok2)
    tl.store(DELTA + st, den, mask=row_ok)
    tl.store(M + st, m2, mask=row_ok)
    tl.store(OMEGA + st, om, mask=row_ok)


@triton.jit
def _bwd_a_tiles(tau, ck, mut, ksq, q, g, inv_d, m2, K, V, s_kt, o_r, ds, a, b, qk_scale, T, D: tl.constexpr,
                 JACOBI: tl.constexpr, PRECISE: tl.constexpr, MASK: tl.constexpr, BC: tl.constexpr,
                 BD: tl.constexpr, MUT: tl.constexpr = True):
    o_d = tl.arange(0, BD)
    for start in range(a, b, BC):
        o_c = start + tl.arange(0, BC)
        k = _rows(K, o_c, o_d, s_kt, T, D, MASK)
        v = _rows(V, o_c, o_d, s_kt, T, D, MASK)
        c = tl.dot(g, tl.trans(v))  # issued before the exponentials, which it overlaps (H100: pass A 1.43 -> 1.29 ms)
        w = _w(q, k, qk_scale, m2, o_r, o_c, ds, T, MASK)
        c = c * w * inv_d[:, None]
        if PRECISE:
            kf = k.to(tl.float32)
            wb = w
        else:
            c = c.to(k.dtype)
            kf = k
            wb = w.to(k.dtype)
        tau += tl.sum(c.to(tl.float32), 1)
        ck += tl.dot(c, kf)
        if MUT:  # recomputed here unless the forward's k̄ (and diagonal) are at hand (v2)
            mut += tl.dot(wb, kf)  # k̄ = μ̃/ω centres the CG matrix
            if JACOBI:
                ksq += tl.dot(wb, kf * kf)
    return tau, ck, mut, ksq


@triton.jit
def _bwd_b_tiles(acc, umu, q, g, rho_b, u_b, rq, uq, beta, inv_d, lt, m2, K, V, s_kt, o_r, ds, a, b, qk_scale, T,
                 D: tl.constexpr, MASK: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    o_d = tl.arange(0, BD)
    for start in range(a, b, BC):
        o_c = start + tl.arange(0, BC)
        k = _rows(K, o_c, o_d, s_kt, T, D, MASK)
        v = _rows(V, o_c, o_d, s_kt, T, D, MASK)
        w = _w(q, k, qk_scale, m2, o_r, o_c, ds, T, MASK)
        zr = tl.dot(rho_b, tl.trans(k)) - rq[:, None]
        zu = tl.dot(u_b, tl.trans(k)) - uq[:, None]
        gam = tl.dot(g, tl.trans(v))
        # z·Δμ = 2β z·ρ − z·u
        f = w * (gam * (1 - zr) * inv_d[:, None] + 2 * beta[:, None] * zr - zu + zu * zr
                 - beta[:, None] * (1 + zr * zr) + lt[:, None])
        acc += tl.dot(f.to(k.dtype), k)
        umu += tl.sum(w * zu, 1)
    return acc, umu


# ----- one pass over a query tile's key range: masked head [lo, mid1), unmasked body [mid1, mid2), masked
# diagonal [mid2, hi) (``_tile_setup``); v1 and v2 (``triton_v2.py``) run every pass through these -----

@triton.jit
def _stats_pass(q, K, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D: tl.constexpr, JACOBI: tl.constexpr,
                PRECISE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Pass (i): row max m (log2 units, 0 on empty rows), ω, μ̃ and Σ_j w_j k_j² (Jacobi; 0 otherwise)."""
    m2 = tl.full([BR], float("-inf"), tl.float32)
    om = tl.zeros([BR], tl.float32)
    mut = tl.zeros([BR, BD], tl.float32)
    ksq = tl.zeros([BR, BD], tl.float32)
    m2, om, mut, ksq = _stats_tiles(q, K, s_kt, o_r, ds, m2, om, mut, ksq, lo, mid1, qk_scale, T, D, JACOBI, PRECISE, True, BC, BD)
    m2, om, mut, ksq = _stats_tiles(q, K, s_kt, o_r, ds, m2, om, mut, ksq, mid1, mid2, qk_scale, T, D, JACOBI, PRECISE, False, BC, BD)
    m2, om, mut, ksq = _stats_tiles(q, K, s_kt, o_r, ds, m2, om, mut, ksq, mid2, hi, qk_scale, T, D, JACOBI, PRECISE, True, BC, BD)
    return tl.where(m2 == float("-inf"), 0.0, m2), om, mut, ksq


@triton.jit
def _sigma_pass(q, p, qp, m2, K, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D: tl.constexpr,
                PRECISE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                QUAD: tl.constexpr = False):
    """(Σ_j t_j k_j, Σ_j t_j) with t_j = w_j (k_j·p − qp) over the whole key range; QUAD: (0, Σ_j t_j (k_j·p − qp))."""
    acc = tl.zeros([BR, BD], tl.float32)
    rs = tl.zeros([BR], tl.float32)
    acc, rs = _sigma_tiles(acc, rs, q, p, qp, m2, K, s_kt, o_r, ds, lo, mid1, qk_scale, T, D, PRECISE, True, BC, BD,
                           QUAD)
    acc, rs = _sigma_tiles(acc, rs, q, p, qp, m2, K, s_kt, o_r, ds, mid1, mid2, qk_scale, T, D, PRECISE, False, BC, BD,
                           QUAD)
    acc, rs = _sigma_tiles(acc, rs, q, p, qp, m2, K, s_kt, o_r, ds, mid2, hi, qk_scale, T, D, PRECISE, True, BC, BD,
                           QUAD)
    return acc, rs


@triton.jit
def _out_pass(q, rho, rq, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D: tl.constexpr,
              BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Pass (iii): (Σ_j a_j v_j, Σ_j a_j) with the score numerators a_j = w_j (1 − (k_j·ρ − rq))."""
    acc = tl.zeros([BR, BD], tl.float32)
    den = tl.zeros([BR], tl.float32)
    acc, den = _out_tiles(acc, den, q, rho, rq, m2, K, V, s_kt, o_r, ds, lo, mid1, qk_scale, T, D, True, BC, BD)
    acc, den = _out_tiles(acc, den, q, rho, rq, m2, K, V, s_kt, o_r, ds, mid1, mid2, qk_scale, T, D, False, BC, BD)
    acc, den = _out_tiles(acc, den, q, rho, rq, m2, K, V, s_kt, o_r, ds, mid2, hi, qk_scale, T, D, True, BC, BD)
    return acc, den


@triton.jit
def _bwd_a_pass(q, g, inv_d, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D: tl.constexpr,
                JACOBI: tl.constexpr, PRECISE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                MUT: tl.constexpr = True):
    """Backward pass A: τ = Σ c, Σ c k, and with MUT μ̃ and the Jacobi sum (zeros without)."""
    tau = tl.zeros([BR], tl.float32)
    ck = tl.zeros([BR, BD], tl.float32)
    mut = tl.zeros([BR, BD], tl.float32)
    ksq = tl.zeros([BR, BD], tl.float32)
    tau, ck, mut, ksq = _bwd_a_tiles(tau, ck, mut, ksq, q, g, inv_d, m2, K, V, s_kt, o_r, ds, lo, mid1, qk_scale, T,
                                     D, JACOBI, PRECISE, True, BC, BD, MUT)
    tau, ck, mut, ksq = _bwd_a_tiles(tau, ck, mut, ksq, q, g, inv_d, m2, K, V, s_kt, o_r, ds, mid1, mid2, qk_scale,
                                     T, D, JACOBI, PRECISE, False, BC, BD, MUT)
    tau, ck, mut, ksq = _bwd_a_tiles(tau, ck, mut, ksq, q, g, inv_d, m2, K, V, s_kt, o_r, ds, mid2, hi, qk_scale, T,
                                     D, JACOBI, PRECISE, True, BC, BD, MUT)
    return tau, ck, mut, ksq


@triton.jit
def _bwd_b_pass(q, g, rho_b, u_b, rq, uq, beta, inv_d, lt, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T,
                D: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Backward pass B: Σ_j F_ij k_j and u·μ."""
    acc = tl.zeros([BR, BD], tl.float32)
    umu = tl.zeros([BR], tl.float32)
    acc, umu = _bwd_b_tiles(acc, umu, q, g, rho_b, u_b, rq, uq, beta, inv_d, lt, m2, K, V, s_kt, o_r, ds, lo, mid1,
                            qk_scale, T, D, True, BC, BD)
    acc, umu = _bwd_b_tiles(acc, umu, q, g, rho_b, u_b, rq, uq, beta, inv_d, lt, m2, K, V, s_kt, o_r, ds, mid1,
                            mid2, qk_scale, T, D, False, BC, BD)
    acc, umu = _bwd_b_tiles(acc, umu, q, g, rho_b, u_b, rq, uq, beta, inv_d, lt, m2, K, V, s_kt, o_r, ds, mid2, hi,
                            qk_scale, T, D, True, BC, BD)
    return acc, umu


@triton.jit
def _kv_weights(k, q, qk_scale, m2, o_c, o_r, ds, start, c0, T, row_ok, col_ok, BR: tl.constexpr, BC: tl.constexpr):
    """w transposed ([BC keys, BR queries]) for the dk/dv kernels; masks only tiles that need it."""
    s = tl.dot(k, tl.trans(q)) * qk_scale - m2[None, :]
    need = (start < c0 + BC - 1) | (tl.max(ds, 0) > c0) | (start + BR > T) | (c0 + BC > T)
    if need:
        ok = (o_c[:, None] <= o_r[None, :]) & (o_c[:, None] >= ds[None, :]) & row_ok[None, :] & col_ok[:, None]
        s = tl.where(ok, s, float("-inf"))
    return tl.exp2(s)


@triton.jit
def _lla_bwd_q_kernel(Q, K, V, LAM, DS, O, DO, RHO, DELTA, M, OMEGA, DQ, U, BETA, DLAM,
                      s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                      T, HQ, scale, qk_scale, rtol2,
                      D: tl.constexpr, G: tl.constexpr, CG_ITERS: tl.constexpr, JACOBI: tl.constexpr, PRECISE: tl.constexpr,
                    SCRATCH: tl.constexpr,
                      BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    i_r, i_bh, _ = _row_program()
    b, h = i_bh // HQ, i_bh % HQ
    o_r, row_ok, ds, lo, mid1, mid2, hi = _tile_setup(DS, i_r, b, T, BR, BC)
    o_d = tl.arange(0, BD)
    Q += b * s_qb + h * s_qh
    DO += b * s_qb + h * s_qh
    K += b * s_kb + (h // G) * s_kh
    V += b * s_kb + (h // G) * s_kh
    q = _rows(Q, o_r, o_d, s_qt, T, D, True)
    g = _rows(DO, o_r, o_d, s_qt, T, D, True)
    p_o, ok2, st, row_ok = _addr(b, h, o_r, T, HQ, D, BD)
    o = tl.load(O + p_o, mask=ok2, other=0.0)
    delta = tl.load(DELTA + st, mask=row_ok, other=1.0)
    m2 = tl.load(M + st, mask=row_ok, other=0.0)
    om = tl.load(OMEGA + st, mask=row_ok, other=1.0)
    lam = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=1.0)
    inv_d = 1.0 / delta
    beta = tl.sum(g.to(tl.float32) * o, 1) * inv_d
    g = g.to(q.dtype)
    # -- pass A: τ = Σ c, Σ c k (and μ̃, Jacobi diagonal) --
    tau, ck, mut, ksq = _bwd_a_pass(q, g, inv_d, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D, JACOBI,
                                    PRECISE, BR, BC, BD)
    rid = lam * om
    qf = q.to(tl.float32)
    y = ck - tau[:, None] * qf
    om1, ctr, diag = _centre(mut, om, ksq, rid)
    u = _cg(y, diag, q, ctr, rid, m2, ds, o_r, K, s_kt, lo, mid1, mid2, hi, qk_scale, rtol2, T, U, DQ, p_o, ok2,
            D, CG_ITERS, JACOBI, PRECISE, SCRATCH, BR, BC, BD)  # scratch: x in U, r in DQ
    rho = tl.load(RHO + p_o, mask=ok2, other=0.0)
    u -= rho * (tl.sum((mut - om[:, None] * qf) * u, 1) / om1)[:, None]  # Σ⁻¹y from Σ_c⁻¹y (Sherman–Morrison)
    g = _rows(DO, o_r, o_d, s_qt, T, D, True).to(q.dtype)  # reloaded: not kept live through CG
    tl.store(U + p_o, u, mask=ok2)
    trg = tl.sum(u * rho, 1) - beta * tl.sum(rho * rho, 1)
    rho_b = rho.to(q.dtype)
    u_b = u.to(q.dtype)
    rq = tl.sum(rho_b.to(tl.float32) * qf, 1)
    uq = tl.sum(u_b.to(tl.float32) * qf, 1)
    # -- pass B: Σ_j F_ij k_j and u·μ = Σ_j w_ij z_ij·u --
    acc, umu = _bwd_b_pass(q, g, rho_b, u_b, rq, uq, beta, inv_d, lam * trg, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2,
                           hi, qk_scale, T, D, BR, BC, BD)
    dmu = 2 * beta[:, None] * rho - u
    dq = scale * acc + tau[:, None] * rho - delta[:, None] * dmu - umu[:, None] * rho
    tl.store(DQ + p_o, dq, mask=ok2)
    tl.store(BETA + st, beta, mask=row_ok)
    tl.store(DLAM + st, trg * om, mask=row_ok)


@triton.jit
def _lla_bwd_kv_kernel(Q, K, V, LAM, DS, DE, DO, RHO, DELTA, M, U, BETA, DK, DV,
                       s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                       T, HQ, HKV, scale, qk_scale,
                       D: tl.constexpr, G: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    b, hk, c0, o_c, col_ok, o_d, q_lo, q_hi, k, v, _ = _key_tile(DE, K, V, s_kb, s_kt, s_kh, T, HKV, D, BR, BC, BD)
    dk = tl.zeros([BC, BD], tl.float32)
    dv = tl.zeros([BC, BD], tl.float32)
    for hg in range(G):
        h = hk * G + hg
        for start in range(q_lo, q_hi, BR):
            o_r = start + tl.arange(0, BR)
            p_o, ok2, st, row_ok = _addr(b, h, o_r, T, HQ, D, BD)
            ds = tl.load(DS + b * T + o_r, mask=row_ok, other=T)
            q = _rows(Q + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True)
            g = _rows(DO + b * s_qb + h * s_qh, o_r, o_d, s_qt, T, D, True).to(q.dtype)
            rho = tl.load(RHO + p_o, mask=ok2, other=0.0)
            u = tl.load(U + p_o, mask=ok2, other=0.0)
            inv_d = 1.0 / tl.load(DELTA + st, mask=row_ok, other=1.0)
            m2 = tl.load(M + st, mask=row_ok, other=0.0)
            beta = tl.load(BETA + st, mask=row_ok, other=0.0)
            lam = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=0.0)
            lt = lam * (tl.sum(u * rho, 1) - beta * tl.sum(rho * rho, 1))
            rho_b = rho.to(q.dtype)
            u_b = u.to(q.dtype)
            dmu_b = (2 * beta[:, None] * rho - u).to(q.dtype)
            qf = q.to(tl.float32)
            rq = tl.sum(rho_b.to(tl.float32) * qf, 1)
            uq = tl.sum(u_b.to(tl.float32) * qf, 1)
            w = _kv_weights(k, q, qk_scale, m2, o_c, o_r, ds, start, c0, T, row_ok, col_ok, BR, BC)  # [BC keys, BR queries]
            zr = tl.dot(k, tl.trans(rho_b)) - rq[None, :]
            zu = tl.dot(k, tl.trans(u_b)) - uq[None, :]
            gam = tl.dot(v, tl.trans(g))
            wn = w * (1 - zr)
            a = wn * inv_d[None, :]
            f = gam * a + w * (2 * beta[None, :] * zr - zu + zu * zr - beta[None, :] * (1 + zr * zr) + lt[None, :])
            x = w * zu - gam * w * inv_d[None, :]
            dk += scale * tl.dot(f.to(q.dtype), q) + tl.dot(wn.to(q.dtype), dmu_b) + tl.dot(x.to(q.dtype), rho_b)
            dv += tl.dot(a.to(q.dtype), g)
    _store_kv(DK, DV, dk, dv, b, hk, o_c, col_ok, o_d, T, HKV, D)


PRECISE = False
"""True: fp32 (TF32 on GPU) weights in the statistics GEMM, fp32 t in the Σ·p GEMM t@K (and c@K in the
backward), and fp32 ρ and scores a_j in the output pass (z·ρ and P@V). These roundings dominate the error:
on ill-conditioned rows δ = Σ_j a_j ≪ Σ_j |a_j|, so bf16 a_j (relative 2⁻⁹) are amplified by Σ|a|/δ.
CPU interpreter, bf16 (dots emulated exactly), T=200, D=64, λ=1, 16 CG, tiles (64, 64), o vs float64:
default 9.5e-2, PRECISE 1.8e-3 (v0 fp32: 1.6e-3). The backward keeps bf16 operands (dv 1.5e-1 there).
Read at call time; part of the autotune key."""


SCRATCH = False
"""True: the CG vectors x and r of a query tile live in global memory (its own output rows, L2-resident)
between iterations instead of registers. Off: an offline sm_90 compile (ptxas, no GPU) gave larger stack
frames with it (forward (64, 64, 8 warps): 2360 vs 1224 bytes; bwd_q: 3536 vs 2376). Kept for A/B on a GPU.
Read at call time; part of the autotune key."""


# ----- tiles: autotuned per (D, G, CG_ITERS, JACOBI, dtypes), never per T -----

def _cfg(br, bc, w, s=2):
    return triton.Config({"BR": br, "BC": bc}, num_warps=w, num_stages=s)


# BR = 64 rows keep the fp32 CG state (x, r, Σp: 3 × [64, 128] fp32) at 32 registers each with 8 warps.
# Two configs per kernel (6 compiles on the first call). Offline sm_90 compiles (D = 128, 8 CG iterations;
# registers / stack bytes): fwd (64, 64, 8w) 255 / 1224, (64, 32, 8w) 255 / 560, (64, 64, 4w) 255 / 3952,
# (128, 64, 8w) 255 / 2064; bwd_q (64, 64, 8w) 255 / 2376, (64, 32, 8w) 255 / 1760; kv (64, 64, 8w) 255 / 1688,
# (32, 64, 8w) 255 / 536, (64, 64, 4w) 255 / 3832, (64, 32, 8w) no wgmma (the key tile is the M dimension there).
# v0 fwd (32, 32, 8w): 255 / 64 but mma.sync TF32 (no wgmma); the v1 configs below all use bf16 wgmma.
# Re-check with `python scripts/bench_lla.py --ptxas 64x64x8,64x32x8` (no GPU needed).
FWD_CONFIGS = [_cfg(64, 64, 8), _cfg(64, 32, 8)]
KV_CONFIGS = [_cfg(64, 64, 8), _cfg(32, 64, 8)]  # BR = query tile, BC = key tile (BC >= 64 for wgmma)
_KEY = ["D", "G", "CG_ITERS", "JACOBI", "PRECISE", "SCRATCH"]
_fwd_tuned = triton.autotune(candidates(FWD_CONFIGS), key=_KEY)(_lla_fwd_kernel)
_bwd_q_tuned = triton.autotune(candidates(FWD_CONFIGS), key=_KEY)(_lla_bwd_q_kernel)
_bwd_kv_tuned = triton.autotune(candidates(KV_CONFIGS), key=["D", "G"])(_lla_bwd_kv_kernel)


def _launch(tuned, raw, grid_of, block, args, kwargs):
    """block=None: autotuned (fixed (32, 32) under TRITON_INTERPRET); else (BR, BC) pinned."""
    if block is None and os.environ.get("TRITON_INTERPRET") == "1":
        block = (32, 32)
    if block is None:
        tuned[lambda meta: grid_of(meta["BR"], meta["BC"])](*args, **kwargs)
        return
    br, bc = block
    nw = 8 if max(br, bc) * kwargs["BD"] >= 64 * 128 else 4
    raw[grid_of(br, bc)](*args, **kwargs, BR=br, BC=bc, num_warps=nw, num_stages=2)


def lla_fwd_triton(q, k, v, lam, doc_start, scale, cg_iters, jacobi, rtol, block_r=None, block_c=None):
    """q: [B, T, HQ, D]; k, v: [B, T, HKV, D] (bf16/fp16/fp32: the dot operand dtype); lam: [B, T, HQ] fp32;
    doc_start: [B, T] int32. Returns out [B, T, HQ, D] in q's dtype, then what the backward reads: o, rho
    [B, T, HQ, D] fp32; delta, m (log2 units), omega [B, T, HQ] fp32 (the contract of every Triton module)."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    o = empty(B, T, HQ, D, device=q.device, dtype=torch.float32)
    rho, delta, m, om = empty_like(o), *(empty(B, T, HQ, device=q.device, dtype=torch.float32) for _ in range(3))
    BD = max(16, triton.next_power_of_2(D))
    block = None if block_r is None else (block_r, block_c)
    _launch(_fwd_tuned, _lla_fwd_kernel, lambda br, bc: tile_grid(triton.cdiv(T, br), B * HQ), block,
            (q, k, v, lam, doc_start, o, rho, delta, m, om, *_strides(q, k, lam), T, HQ, scale * LOG2E, rtol**2),
            {"D": D, "G": HQ // HKV, "CG_ITERS": cg_iters, "JACOBI": jacobi, "PRECISE": PRECISE, "SCRATCH": SCRATCH, "BD": BD})
    return o.to(q.dtype, copy=True), o, rho, delta, m, om  # a new tensor: an op's outputs may not alias


def lla_bwd_triton(q, k, v, lam, doc_start, doc_end, out, o, do, rho, delta, m, om, scale, cg_iters, jacobi, rtol,
                   block_r=None, block_c=None):
    """The forward's outputs (out is not read: this backward reads its fp32 o); do: [B, T, HQ, D] (any float dtype;
    cast to q's for the dots). Returns dq [B, T, HQ, D], dk, dv
    [B, T, HKV, D] (fp32) and dlam [B, T, HQ]."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    BD = max(16, triton.next_power_of_2(D))
    do = do.to(q.dtype).contiguous()
    dq = empty_like(o)
    u = torch.empty_like(o)
    beta, dlam = o.new_empty(B, T, HQ), empty(B, T, HQ, device=q.device, dtype=torch.float32)
    block = None if block_r is None else (block_r, block_c)
    _launch(_bwd_q_tuned, _lla_bwd_q_kernel, lambda br, bc: tile_grid(triton.cdiv(T, br), B * HQ), block,
            (q, k, v, lam, doc_start, o, do, rho, delta, m, om, dq, u, beta, dlam, *_strides(q, k, lam),
             T, HQ, scale, scale * LOG2E, rtol**2),
            {"D": D, "G": HQ // HKV, "CG_ITERS": cg_iters, "JACOBI": jacobi, "PRECISE": PRECISE, "SCRATCH": SCRATCH, "BD": BD})
    dk = empty(B, T, HKV, D, device=q.device, dtype=torch.float32)
    dv = empty_like(dk)
    _launch(_bwd_kv_tuned, _lla_bwd_kv_kernel, lambda br, bc: tile_grid(triton.cdiv(T, bc), B * HKV), block,
            (q, k, v, lam, doc_start, doc_end, do, rho, delta, m, u, beta, dk, dv, *_strides(q, k, lam),
             T, HQ, HKV, scale, scale * LOG2E),
            {"D": D, "G": HQ // HKV, "BD": BD})
    return dq, dk, dv, dlam
