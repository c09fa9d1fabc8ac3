"""Shared pieces of the LLA kernels: row/key tile setup, the streamed key passes, the state layout, launching.

Every kernel is a program per (query tile, batch·head) (``_row_program``, heaviest tile first) or per (key tile,
batch·kv head) (``_key_tile``), streaming K (and V) in tiles of BC keys. A query tile's key range is split into a
masked head [lo, mid1) (document starts), a mask-free body [mid1, mid2) and a masked diagonal [mid2, hi)
(``_tile_setup``), so the causal / document / length masks are paid only where they bite; each ``_*_pass``
runs its ``_*_tiles`` loop over the three pieces.

Numerics (docs/kernels.md, "LLA"): tensor-core operands in the input dtype (bf16 in training), fp32
accumulation; the weights w_j = exp(scale·q·k_j − m) are computed in exp2 with log2(e) folded into ``qk_scale``,
m kept in log2 units. The CG vectors, row scalars (ω, τ, δ) and every accumulator are fp32.
Layout [B, T, H, D] with unit stride on D; D is padded to a power of two BD with zero masks (padded coordinates
stay exactly 0 through CG).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from attnlab.attention.ops.tiles import GROUP_PROGRAMS, TAIL_PROGRAMS, tile_program

LOG2E = 1.4426950408889634

PRECISE = False
"""True: fp32 (TF32 on GPU) weights in the statistics product, fp32 t in the Σ·p product and fp32 ρ and scores in
the output pass. bf16 roundings of the score numerators are amplified by Σ|a|/δ on ill-conditioned rows; this
switch measures how much (tests compare both). Read at call time; part of the autotune key."""

# row-scalar slots of the [N_ROWS, B, T, HQ] state tensor: the CG's (rz, threshold, k̄·p, ‖b‖, λω), τ = Σ w γ from
# pass A, and what pass B hands the dk/dv kernel (S = Σ_j p_j ∂L/∂p_j, k̄·ρ̂_c, k̄·û with ρ̂_c, û the operand-dtype
# vectors)
_RZ, _THR, _QP, _BN, _RID, _TAU, _DPS, _RQ, _UQ = (tl.constexpr(i) for i in range(9))
N_ROWS = 9


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
def _kv_rows(K, V, start, s_kt, T, D: tl.constexpr, MASK: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """The key tile [start, start + BC): its indices and its K and V rows ([BC, BD], zero padded)."""
    o_c = start + tl.arange(0, BC)
    o_d = tl.arange(0, BD)
    return o_c, _rows(K, o_c, o_d, s_kt, T, D, MASK), _rows(V, o_c, o_d, s_kt, T, D, MASK)


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
def _out_tiles(acc, den, q, rho, rq, m2, K, V, s_kt, o_r, ds, a, b, qk_scale, T, D: tl.constexpr,
               MASK: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    for start in range(a, b, BC):
        o_c, k, v = _kv_rows(K, V, start, s_kt, T, D, MASK, BC, BD)
        w = _w(q, k, qk_scale, m2, o_r, o_c, ds, T, MASK)
        a_ = (w * (1 - (tl.dot(rho, tl.trans(k.to(rho.dtype))) - rq[:, None]))).to(rho.dtype)
        acc += tl.dot(a_, v.to(rho.dtype))
        den += tl.sum(a_.to(tl.float32), 1)
    return acc, den


@triton.jit
def _bwd_a_tiles(tau, ck, q, g, m2, K, V, s_kt, o_r, ds, a, b, qk_scale, T, D: tl.constexpr,
                 PRECISE: tl.constexpr, MASK: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    for start in range(a, b, BC):
        o_c, k, v = _kv_rows(K, V, start, s_kt, T, D, MASK, BC, BD)
        c = tl.dot(g, tl.trans(v))  # issued before the exponentials, which it overlaps
        w = _w(q, k, qk_scale, m2, o_r, o_c, ds, T, MASK)
        c = c * w
        if PRECISE:
            kf = k.to(tl.float32)
        else:
            c = c.to(k.dtype)
            kf = k
        tau += tl.sum(c.to(tl.float32), 1)
        ck += tl.dot(c, kf)
    return tau, ck


@triton.jit
def _bwd_b_tiles(acc, sw, q, g, rc_b, u_b, rq, uq, gv, m2, K, V, s_kt, o_r, ds, a, b, qk_scale, T,
                 D: tl.constexpr, MASK: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    for start in range(a, b, BC):
        o_c, k, v = _kv_rows(K, V, start, s_kt, T, D, MASK, BC, BD)
        w = _w(q, k, qk_scale, m2, o_r, o_c, ds, T, MASK)
        yr = tl.dot(rc_b, tl.trans(k)) - rq[:, None]  # y·ρ_c
        yu = tl.dot(u_b, tl.trans(k)) - uq[:, None]  # y·u
        gam = tl.dot(g, tl.trans(v))
        t = (w * (gam * (1 - yr) + (yu + gv[:, None]) * yr - yu)).to(k.dtype)  # w_j ∂L/∂p_j
        acc += tl.dot(t, k)
        sw += tl.sum(t.to(tl.float32), 1)  # the rounded t: acc − sw·k̄ is then exactly Σ_j t_j y_j
    return acc, sw


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
def _bwd_a_pass(q, g, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T, D: tl.constexpr,
                PRECISE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Backward pass A: τ = Σ_j c_j and Σ_j c_j k_j with c_j = w_j (dO·v_j)."""
    tau = tl.zeros([BR], tl.float32)
    ck = tl.zeros([BR, BD], tl.float32)
    tau, ck = _bwd_a_tiles(tau, ck, q, g, m2, K, V, s_kt, o_r, ds, lo, mid1, qk_scale, T, D, PRECISE, True, BC, BD)
    tau, ck = _bwd_a_tiles(tau, ck, q, g, m2, K, V, s_kt, o_r, ds, mid1, mid2, qk_scale, T, D, PRECISE, False, BC, BD)
    tau, ck = _bwd_a_tiles(tau, ck, q, g, m2, K, V, s_kt, o_r, ds, mid2, hi, qk_scale, T, D, PRECISE, True, BC, BD)
    return tau, ck


@triton.jit
def _bwd_b_pass(q, g, rc_b, u_b, rq, uq, gv, m2, K, V, s_kt, o_r, ds, lo, mid1, mid2, hi, qk_scale, T,
                D: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """Backward pass B: Σ_j w_j (∂L/∂p_j) k_j and Σ_j w_j ∂L/∂p_j."""
    acc = tl.zeros([BR, BD], tl.float32)
    sw = tl.zeros([BR], tl.float32)
    acc, sw = _bwd_b_tiles(acc, sw, q, g, rc_b, u_b, rq, uq, gv, m2, K, V, s_kt, o_r, ds, lo, mid1, qk_scale, T, D,
                           True, BC, BD)
    acc, sw = _bwd_b_tiles(acc, sw, q, g, rc_b, u_b, rq, uq, gv, m2, K, V, s_kt, o_r, ds, mid1, mid2, qk_scale, T, D,
                           False, BC, BD)
    acc, sw = _bwd_b_tiles(acc, sw, q, g, rc_b, u_b, rq, uq, gv, m2, K, V, s_kt, o_r, ds, mid2, hi, qk_scale, T, D,
                           True, BC, BD)
    return acc, sw


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
def _centre(mut, om, ksq, rid):
    """ω guarded for empty padding rows (1 there), k̄ = μ̃/ω and the Jacobi diagonal of Σ_c: Σ_j w k² − ω k̄² + ridge."""
    om1 = tl.where(om > 0, om, 1.0)
    ctr = mut / om1[:, None]
    return om1, ctr, ksq - mut * ctr + rid[:, None]


@triton.jit
def _q_tile(DS, T, HQ, D: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """A query-tile kernel's rows (program (query tile, b·HQ + h)): batch, head, rows, doc starts, the split key
    range of ``_tile_setup``, state offsets / mask / row-scalar offsets (``_addr``) and the row-slot stride."""
    i_r, i_bh, n_bh = _row_program()
    b, h = i_bh // HQ, i_bh % HQ
    o_r, row_ok, ds, lo, mid1, mid2, hi = _tile_setup(DS, i_r, b, T, BR, BC)
    p_o, ok2, st, row_ok = _addr(b, h, o_r, T, HQ, D, BD)
    return b, h, o_r, row_ok, ds, lo, mid1, mid2, hi, p_o, ok2, st, T * n_bh  # slot stride B·T·HQ


def _strides(q, k, lam):
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            lam.stride(0), lam.stride(1), lam.stride(2))


def _cfg(br, bc, w, s=2):
    return triton.Config({"BR": br, "BC": bc}, num_warps=w, num_stages=s)


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
