"""Blockwise LLA in Triton (FlashLLA, spec ``lla.md`` §5-6, errata fixed, λω ridge, exact backward).

Three kernels, each a program per (query or key tile, batch, head); no T×T and no T×d×d tensor exists:

- ``_lla_fwd_kernel``: pass (i) online statistics m, ω, μ̃ (and the Jacobi diagonal) over the key tiles;
  pass (ii) CG for ρ (``CG_ITERS`` streamed passes over K, the matrix-free Σ·p of eq. 13, keys centred at
  k̄ and Sherman–Morrison back: ``naive.from_centred``); pass (iii)
  output (eq. 16, in the centred form). Writes o, ρ, δ, m, ω.
- ``_lla_bwd_q_kernel``: pass A accumulates μ̃, τ = Σ c and Σ c k; the adjoint CG solve for u; pass B
  accumulates F·K for dq. Writes dq, u, β and dλ.
- ``_lla_bwd_kv_kernel``: per key tile (all q heads of its GQA group, all query tiles below the diagonal):
  dk and dv.

The math is the one of ``chunked.py`` (its docstring derives it). All accumulators are fp32; tiles are
loaded in fp32 and multiplied with ``tl.dot`` (TF32 tensor cores on GPU). Varlen documents enter as
``doc_start``/``doc_end`` per token ([B, T] int32): query i sees keys doc_start[i] ≤ j ≤ i.
Layout [B, T, H, D] with unit stride on D; D is padded to a power of two with zero masks (padded
coordinates stay exactly 0 through CG).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.ops.outputs import empty, empty_like

@triton.jit
def _weights(q, k, o_r, o_c, ds, m, scale, T):
    """w = exp(scale·q kᵀ − m) on the visible (row, key) pairs, 0 elsewhere. [BR, BC]."""
    s = tl.dot(q, tl.trans(k)) * scale
    ok = (o_c[None, :] <= o_r[:, None]) & (o_c[None, :] >= ds[:, None]) & (o_c[None, :] < T)
    return tl.where(ok, tl.exp(s - m[:, None]), 0.0)


@triton.jit
def _load_rows(P, o_t, o_d, s_t, ok_t, D):
    return tl.load(P + o_t[:, None] * s_t + o_d[None, :], mask=ok_t[:, None] & (o_d[None, :] < D), other=0.0).to(tl.float32)


@triton.jit
def _matvec(p, q, ctr, rid, m, ds, o_r, K, s_kt, lo, hi, scale, T, D, BC: tl.constexpr, BD: tl.constexpr):
    """Σ p for the rows of the tile (eq. 13 with the keys centred at ``ctr``: the weights come from q), streaming
    K once."""
    o_d = tl.arange(0, BD)
    cp = tl.sum(ctr * p, 1)
    ap = tl.zeros_like(p)
    rs = tl.zeros_like(cp)
    for start in range(lo, hi, BC):  # centred projections first (naive.sigma_matvec)
        o_c = start + tl.arange(0, BC)
        k = _load_rows(K, o_c, o_d, s_kt, o_c < T, D)
        w = _weights(q, k, o_r, o_c, ds, m, scale, T)
        t = w * (tl.dot(p, tl.trans(k)) - cp[:, None])
        ap += tl.dot(t, k)
        rs += tl.sum(t, 1)
    return ap - rs[:, None] * ctr + rid[:, None] * p


@triton.jit
def _cg(b, diag, q, ctr, rid, m, ds, o_r, K, s_kt, lo, hi, scale, rtol2, T, D,
        CG_ITERS: tl.constexpr, JACOBI: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Batched (Jacobi-)CG for Σ_c x_i = b_i (keys centred at ``ctr`` = k̄), x_0 = 0, with the active mask of
    Algorithm 2."""
    x = tl.zeros_like(b)
    r = b
    if JACOBI:
        z = r / diag
    else:
        z = r
    p = z
    rz = tl.sum(r * z, 1)
    thresh = rtol2 * tl.sum(b * b, 1)
    for _ in range(CG_ITERS):
        ap = _matvec(p, q, ctr, rid, m, ds, o_r, K, s_kt, lo, hi, scale, T, D, BC, BD)
        pap = tl.sum(p * ap, 1)
        active = (pap > 0) & (pap < float("inf")) & (tl.sum(r * r, 1) > thresh)
        alpha = tl.where(active, rz / tl.where(active, pap, 1.0), 0.0)
        x += alpha[:, None] * p
        r -= alpha[:, None] * ap
        if JACOBI:
            z = r / diag
        else:
            z = r
        rz_new = tl.sum(r * z, 1)
        beta = tl.where(active, rz_new / tl.where(rz > 0, rz, 1.0), 0.0)
        p = tl.where(active[:, None], z + beta[:, None] * p, p)
        rz = tl.where(active, rz_new, rz)
    return x


@triton.jit
def _centre(mut, om, ksq, rid):
    """ω guarded for empty padding rows (1 there), k̄ = μ̃/ω and the Jacobi diagonal of Σ_c: Σ_j w k² − ω k̄² + ridge."""
    om1 = tl.where(om > 0, om, 1.0)
    ctr = mut / om1[:, None]
    return om1, ctr, ksq - mut * ctr + rid[:, None]


@triton.jit
def _tile_setup(DS, i_r, b, T, BR: tl.constexpr, BC: tl.constexpr):
    o_r = i_r * BR + tl.arange(0, BR)
    row_ok = o_r < T
    ds = tl.load(DS + b * T + o_r, mask=row_ok, other=0)
    lo = tl.min(tl.where(row_ok, ds, T), 0)
    lo = (lo // BC) * BC
    hi = tl.minimum((i_r + 1) * BR, T)
    return o_r, row_ok, ds, lo, hi


@triton.jit
def _stats(q, ds, o_r, K, s_kt, lo, hi, scale, T, D, JACOBI: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
           BD: tl.constexpr):
    """Pass (i): online max m, ω, μ̃ and Σ_j w_j k_j² (Jacobi)."""
    o_d = tl.arange(0, BD)
    m = tl.full([BR], float("-inf"), tl.float32)
    om = tl.zeros([BR], tl.float32)
    mut = tl.zeros([BR, BD], tl.float32)
    ksq = tl.zeros([BR, BD], tl.float32)
    for start in range(lo, hi, BC):
        o_c = start + tl.arange(0, BC)
        k = _load_rows(K, o_c, o_d, s_kt, o_c < T, D)
        s = tl.dot(q, tl.trans(k)) * scale
        ok = (o_c[None, :] <= o_r[:, None]) & (o_c[None, :] >= ds[:, None]) & (o_c[None, :] < T)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.where(ok, tl.exp(s - m_safe[:, None]), 0.0)
        om = om * alpha + tl.sum(p, 1)
        mut = mut * alpha[:, None] + tl.dot(p, k)
        if JACOBI:
            ksq = ksq * alpha[:, None] + tl.dot(p, k * k)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    return m, om, mut, ksq


@triton.jit
def _lla_fwd_kernel(Q, K, V, LAM, DS, O, RHO, DELTA, M, OMEGA,
                    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                    T, HQ, D, scale, rtol2,
                    G: tl.constexpr, CG_ITERS: tl.constexpr, JACOBI: tl.constexpr,
                    BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    i_r, i_bh = tl.program_id(0), tl.program_id(1)
    b, h = i_bh // HQ, i_bh % HQ
    o_r, row_ok, ds, lo, hi = _tile_setup(DS, i_r, b, T, BR, BC)
    o_d = tl.arange(0, BD)
    Q += b * s_qb + h * s_qh
    K += b * s_kb + (h // G) * s_kh
    V += b * s_kb + (h // G) * s_kh
    q = _load_rows(Q, o_r, o_d, s_qt, row_ok, D)
    lam = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=1.0)
    m, om, mut, ksq = _stats(q, ds, o_r, K, s_kt, lo, hi, scale, T, D, JACOBI, BR, BC, BD)
    rid = lam * om  # λω ridge (spec §5.3): the output does not depend on m
    mu = mut - om[:, None] * q
    om1, ctr, diag = _centre(mut, om, ksq, rid)
    rho = _cg(mu, diag, q, ctr, rid, m, ds, o_r, K, s_kt, lo, hi, scale, rtol2, T, D, CG_ITERS, JACOBI, BC,
              BD)  # ρ_c = Σ_c⁻¹μ, then Sherman–Morrison (naive.from_centred)
    rq = tl.sum(rho * ctr, 1)  # output from ρ_c: s_j = w_j (1 − (k_j − k̄)·ρ_c) / ω (no 1/δ amplification)
    acc = tl.zeros([BR, BD], tl.float32)
    for start in range(lo, hi, BC):  # pass (iii), eq. 16
        o_c = start + tl.arange(0, BC)
        k = _load_rows(K, o_c, o_d, s_kt, o_c < T, D)
        v = _load_rows(V, o_c, o_d, s_kt, o_c < T, D)
        w = _weights(q, k, o_r, o_c, ds, m, scale, T)
        acc += tl.dot(w * (1 - (tl.dot(rho, tl.trans(k)) - rq[:, None])), v)
    o = acc / om1[:, None]
    t1 = 1 + tl.sum(mu * rho, 1) / om1
    rho = rho / t1[:, None]
    delta = om / t1
    st = (b * T + o_r) * HQ + h  # [B, T, HQ] fp32 row statistics
    p_o = (b * T + o_r[:, None]) * HQ * D + h * D + o_d[None, :]
    ok2 = row_ok[:, None] & (o_d[None, :] < D)
    tl.store(O + p_o, o, mask=ok2)
    tl.store(RHO + p_o, rho, mask=ok2)
    tl.store(DELTA + st, delta, mask=row_ok)
    tl.store(M + st, m, mask=row_ok)
    tl.store(OMEGA + st, om, mask=row_ok)


@triton.jit
def _lla_bwd_q_kernel(Q, K, V, LAM, DS, O, DO, RHO, DELTA, M, OMEGA, DQ, U, BETA, DLAM,
                      s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                      T, HQ, D, scale, rtol2,
                      G: tl.constexpr, CG_ITERS: tl.constexpr, JACOBI: tl.constexpr,
                      BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    i_r, i_bh = tl.program_id(0), tl.program_id(1)
    b, h = i_bh // HQ, i_bh % HQ
    o_r, row_ok, ds, lo, hi = _tile_setup(DS, i_r, b, T, BR, BC)
    o_d = tl.arange(0, BD)
    Q += b * s_qb + h * s_qh
    DO += b * s_qb + h * s_qh
    K += b * s_kb + (h // G) * s_kh
    V += b * s_kb + (h // G) * s_kh
    q = _load_rows(Q, o_r, o_d, s_qt, row_ok, D)
    g = _load_rows(DO, o_r, o_d, s_qt, row_ok, D)
    st = (b * T + o_r) * HQ + h
    p_o = (b * T + o_r[:, None]) * HQ * D + h * D + o_d[None, :]
    ok2 = row_ok[:, None] & (o_d[None, :] < D)
    o = tl.load(O + p_o, mask=ok2, other=0.0)
    rho = tl.load(RHO + p_o, mask=ok2, other=0.0)
    delta = tl.load(DELTA + st, mask=row_ok, other=1.0)
    m = tl.load(M + st, mask=row_ok, other=0.0)
    lam = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=1.0)
    beta = tl.sum(g * o, 1) / delta
    rq = tl.sum(rho * q, 1)
    # -- pass A: ω, μ̃, Jacobi diagonal, τ = Σ c, Σ c k --
    om = tl.zeros([BR], tl.float32)
    tau = tl.zeros([BR], tl.float32)
    mut = tl.zeros([BR, BD], tl.float32)
    ksq = tl.zeros([BR, BD], tl.float32)
    ck = tl.zeros([BR, BD], tl.float32)
    for start in range(lo, hi, BC):
        o_c = start + tl.arange(0, BC)
        k = _load_rows(K, o_c, o_d, s_kt, o_c < T, D)
        v = _load_rows(V, o_c, o_d, s_kt, o_c < T, D)
        w = _weights(q, k, o_r, o_c, ds, m, scale, T)
        c = tl.dot(g, tl.trans(v)) * w / delta[:, None]
        om += tl.sum(w, 1)
        tau += tl.sum(c, 1)
        mut += tl.dot(w, k)
        ck += tl.dot(c, k)
        if JACOBI:
            ksq += tl.dot(w, k * k)
    rid = lam * om
    mu = mut - om[:, None] * q
    om1, ctr, diag = _centre(mut, om, ksq, rid)
    y = ck - tau[:, None] * q
    u = _cg(y, diag, q, ctr, rid, m, ds, o_r, K, s_kt, lo, hi, scale, rtol2, T, D, CG_ITERS, JACOBI, BC, BD)
    u -= rho * (tl.sum(mu * u, 1) / om1)[:, None]  # Σ⁻¹y (naive.solve_via_centred)
    dmu = 2 * beta[:, None] * rho - u
    trg = tl.sum(u * rho, 1) - beta * tl.sum(rho * rho, 1)
    uq = tl.sum(u * q, 1)
    dq_ = tl.sum(dmu * q, 1)
    # -- pass B: Σ_j F_ij k_j --
    acc = tl.zeros([BR, BD], tl.float32)
    for start in range(lo, hi, BC):
        o_c = start + tl.arange(0, BC)
        k = _load_rows(K, o_c, o_d, s_kt, o_c < T, D)
        v = _load_rows(V, o_c, o_d, s_kt, o_c < T, D)
        w = _weights(q, k, o_r, o_c, ds, m, scale, T)
        zr = tl.dot(rho, tl.trans(k)) - rq[:, None]
        zu = tl.dot(u, tl.trans(k)) - uq[:, None]
        zd = tl.dot(dmu, tl.trans(k)) - dq_[:, None]
        gam = tl.dot(g, tl.trans(v))
        f = gam * w * (1 - zr) / delta[:, None] + w * (
            zd + zu * zr - beta[:, None] * (1 + zr * zr) + (lam * trg)[:, None])
        acc += tl.dot(f, k)
    dq = scale * acc + tau[:, None] * rho - delta[:, None] * dmu - tl.sum(u * mu, 1)[:, None] * rho
    tl.store(DQ + p_o, dq, mask=ok2)
    tl.store(U + p_o, u, mask=ok2)
    tl.store(BETA + st, beta, mask=row_ok)
    tl.store(DLAM + st, trg * om, mask=row_ok)


@triton.jit
def _lla_bwd_kv_kernel(Q, K, V, LAM, DS, DE, DO, RHO, DELTA, M, U, BETA, DK, DV,
                       s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_lb, s_lt, s_lh,
                       T, HQ, HKV, D, scale,
                       G: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    b, hk = i_bh // HKV, i_bh % HKV
    o_c = i_c * BC + tl.arange(0, BC)
    col_ok = o_c < T
    o_d = tl.arange(0, BD)
    de = tl.load(DE + b * T + o_c, mask=col_ok, other=0)
    q_lo = ((i_c * BC) // BR) * BR
    q_hi = tl.max(de, 0)  # queries of the same documents only
    k = _load_rows(K + b * s_kb + hk * s_kh, o_c, o_d, s_kt, col_ok, D)
    v = _load_rows(V + b * s_kb + hk * s_kh, o_c, o_d, s_kt, col_ok, D)
    dk = tl.zeros([BC, BD], tl.float32)
    dv = tl.zeros([BC, BD], tl.float32)
    for hg in range(G):
        h = hk * G + hg
        for start in range(q_lo, q_hi, BR):
            o_r = start + tl.arange(0, BR)
            row_ok = o_r < T
            ds = tl.load(DS + b * T + o_r, mask=row_ok, other=T)
            q = _load_rows(Q + b * s_qb + h * s_qh, o_r, o_d, s_qt, row_ok, D)
            g = _load_rows(DO + b * s_qb + h * s_qh, o_r, o_d, s_qt, row_ok, D)
            st = (b * T + o_r) * HQ + h
            p_o = (b * T + o_r[:, None]) * HQ * D + h * D + o_d[None, :]
            ok2 = row_ok[:, None] & (o_d[None, :] < D)
            rho = tl.load(RHO + p_o, mask=ok2, other=0.0)
            u = tl.load(U + p_o, mask=ok2, other=0.0)
            delta = tl.load(DELTA + st, mask=row_ok, other=1.0)
            m = tl.load(M + st, mask=row_ok, other=0.0)
            beta = tl.load(BETA + st, mask=row_ok, other=0.0)
            lam = tl.load(LAM + b * s_lb + o_r * s_lt + h * s_lh, mask=row_ok, other=0.0)
            dmu = 2 * beta[:, None] * rho - u
            trg = tl.sum(u * rho, 1) - beta * tl.sum(rho * rho, 1)
            w = _weights(q, k, o_r, o_c, ds, m, scale, T)
            w = tl.where(row_ok[:, None], w, 0.0)
            zr = tl.dot(rho, tl.trans(k)) - tl.sum(rho * q, 1)[:, None]
            zu = tl.dot(u, tl.trans(k)) - tl.sum(u * q, 1)[:, None]
            zd = tl.dot(dmu, tl.trans(k)) - tl.sum(dmu * q, 1)[:, None]
            gam = tl.dot(g, tl.trans(v))
            wn = w * (1 - zr)
            a = wn / delta[:, None]
            c = gam * w / delta[:, None]
            f = gam * a + w * (zd + zu * zr - beta[:, None] * (1 + zr * zr) + (lam * trg)[:, None])
            dk += scale * tl.dot(tl.trans(f), q) + tl.dot(tl.trans(wn), dmu) + tl.dot(tl.trans(w * zu - c), rho)
            dv += tl.dot(tl.trans(a), g)
    p_k = (b * T + o_c[:, None]) * HKV * D + hk * D + o_d[None, :]
    ok2 = col_ok[:, None] & (o_d[None, :] < D)
    tl.store(DK + p_k, dk, mask=ok2)
    tl.store(DV + p_k, dv, mask=ok2)


def _strides(q, k, lam):
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            lam.stride(0), lam.stride(1), lam.stride(2))


def lla_fwd_triton(q, k, v, lam, doc_start, scale, cg_iters, jacobi, rtol, block_r, block_c):
    """q: [B, T, HQ, D]; k, v: [B, T, HKV, D]; lam: [B, T, HQ] fp32; doc_start: [B, T] int32.
    Returns out [B, T, HQ, D] in q's dtype, then o, rho: [B, T, HQ, D] fp32; delta, m, omega: [B, T, HQ] fp32."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    o = empty(B, T, HQ, D, device=q.device, dtype=torch.float32)
    rho, delta, m, om = empty_like(o), *(empty(B, T, HQ, device=q.device, dtype=torch.float32) for _ in range(3))
    BD = max(16, triton.next_power_of_2(D))
    grid = (triton.cdiv(T, block_r), B * HQ)
    _lla_fwd_kernel[grid](q, k, v, lam, doc_start, o, rho, delta, m, om, *_strides(q, k, lam),
                          T, HQ, D, scale, rtol**2, G=HQ // HKV, CG_ITERS=cg_iters, JACOBI=jacobi,
                          BR=block_r, BC=block_c, BD=BD, num_warps=4 if BD <= 64 else 8)
    return o.to(q.dtype, copy=True), o, rho, delta, m, om


def lla_bwd_triton(q, k, v, lam, doc_start, doc_end, out, o, do, rho, delta, m, om, scale, cg_iters, jacobi, rtol,
                   block_r, block_c):
    """The forward's outputs (out is not read). Returns dq [B, T, HQ, D], dk, dv [B, T, HKV, D] (fp32) and dlam
    [B, T, HQ]."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    BD = max(16, triton.next_power_of_2(D))
    dq = empty_like(o)
    u = torch.empty_like(o)
    beta, dlam = o.new_empty(B, T, HQ), empty(B, T, HQ, device=q.device, dtype=torch.float32)
    nw = 4 if BD <= 64 else 8
    _lla_bwd_q_kernel[(triton.cdiv(T, block_r), B * HQ)](
        q, k, v, lam, doc_start, o, do, rho, delta, m, om, dq, u, beta, dlam, *_strides(q, k, lam),
        T, HQ, D, scale, rtol**2, G=HQ // HKV, CG_ITERS=cg_iters, JACOBI=jacobi, BR=block_r, BC=block_c, BD=BD,
        num_warps=nw)
    dk = empty(B, T, HKV, D, device=q.device, dtype=torch.float32)
    dv = empty_like(dk)
    _lla_bwd_kv_kernel[(triton.cdiv(T, block_c), B * HKV)](
        q, k, v, lam, doc_start, doc_end, do, rho, delta, m, u, beta, dk, dv, *_strides(q, k, lam),
        T, HQ, HKV, D, scale, G=HQ // HKV, BR=block_r, BC=block_c, BD=BD, num_warps=nw)
    return dq, dk, dv, dlam
