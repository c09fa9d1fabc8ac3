"""Decode kernel: a few new query tokens against a fixed-shape KV cache (docs/kernels.md, "Softmax and Parallax").

Only K and V are cached; ρ comes with the new tokens. One program per (KV split, batch row, kv head) stacks
the G·TQ query rows of the GQA group into one tile (K/V read once per kv head), streams its slice of the cache
and writes the partials (m, d1, d2, O1, O2) in fp32, which are then merged:

    M = max_s m_s ; w_s = 2^(m_s − M) ; d1 = Σ w_s d1_s ; d2 = Σ w_s d2_s ; O1 = Σ w_s O1_s ; O2 = Σ w_s O2_s
    o = O1/d1 · (1 + d2/d1) − O2/d1

Fused merge (one launch; slower than two launches at small batches, see ``ops.DECODE_MERGE``): after storing its
partials, each program of a (batch row, kv head) bumps that row's int32 counter with an acquire-release atomic; the
program that sees S − 1 (the last to finish) reads every split's partials back from L2, merges them online (the same
rescaling as the main loop) and writes o, then resets the counter to 0, so the workspace is all zeros between calls
(CUDA-graph capturable, no memset launch). Two-launch path (``merge="kernel"``, the default):
``_parallax_decode_merge_kernel`` merges after the split kernel.

The number of splits depends only on static shapes (batch, heads, cache capacity, SM count), never on the
per-sequence lengths, so a call is CUDA-graph capturable. With a single split the kernel writes o directly
(no partials, no counter).
Query token t of row b sits at position ``seqlens[b] − TQ + t`` (the new tokens are already in the cache).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _parallax_decode_kernel(Q, R, K, V, SEQLENS, O, PM, PD1, PD2, PO1, PO2, CNT, qk_scale, W, CHUNK,
                            B, LMAX, TQ: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                            BR: tl.constexpr, BN: tl.constexpr, HAS_PROBE: tl.constexpr, WINDOW: tl.constexpr,
                            SPLIT: tl.constexpr, FUSED_MERGE: tl.constexpr, DOT_PREC: tl.constexpr,
                            RR: tl.constexpr = 2, SC: tl.constexpr = 1, LONG_OFF: tl.constexpr = False,
                            PDL: tl.constexpr = False):
    """Grid (S, B·HKV). CNT: int32 [≥ B·HKV] zeros, used only when SPLIT and FUSED_MERGE (RR, SC: see
    ``_merge_splits``). K/V tile offsets within a cache row are int32 unless LONG_OFF (LMAX·HKV·D ≥ 2^31).
    PDL: let the merge kernel (launched as a programmatic dependent) launch now; it waits for this grid's
    partials itself (``gdc_wait``), so its launch latency hides behind this kernel."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    G: tl.constexpr = HQ // HKV
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HKV
    i_kh = i_bh % HKV
    L = tl.load(SEQLENS + i_b).to(tl.int32)
    o_r = tl.arange(0, BR)  # row = g * TQ + t
    row_ok = o_r < G * TQ
    i_t = o_r % TQ
    i_h = i_kh * G + o_r // TQ
    pos = L - TQ + i_t  # absolute position of each query row
    o_d = tl.arange(0, D)
    off_q = ((i_b * TQ + i_t[:, None]).to(tl.int64) * HQ + i_h[:, None]) * D + o_d[None, :]  # [BR, D]
    b_q = tl.load(Q + off_q, mask=row_ok[:, None], other=0.0)
    if HAS_PROBE:
        b_r = tl.load(R + off_q, mask=row_ok[:, None], other=0.0)

    lo = i_s * CHUNK
    hi = tl.minimum(lo + CHUNK, L)
    if WINDOW:  # skip blocks entirely left of the oldest query's window
        lo = tl.maximum(lo, tl.maximum(L - TQ - W + 1, 0) // BN * BN)
    p_k0 = K + (i_b.to(tl.int64) * LMAX * HKV + i_kh) * D  # this (batch row, kv head) of the cache
    p_v0 = V + (i_b.to(tl.int64) * LMAX * HKV + i_kh) * D
    acc1 = tl.zeros([BR, D], dtype=tl.float32)
    acc2 = tl.zeros([BR, D], dtype=tl.float32)
    d1 = tl.zeros([BR], dtype=tl.float32)
    d2 = tl.zeros([BR], dtype=tl.float32)
    m_i = tl.full([BR], float("-inf"), dtype=tl.float32)
    for start_n in range(lo, hi, BN):
        o_n = start_n + tl.arange(0, BN)
        if LONG_OFF:
            off = o_n[:, None].to(tl.int64) * (HKV * D) + o_d[None, :]
        else:
            off = o_n[:, None] * (HKV * D) + o_d[None, :]  # [BN, D] int32: fewer address registers
        b_k = tl.load(p_k0 + off, mask=o_n[:, None] < hi, other=0.0)
        b_v = tl.load(p_v0 + off, mask=o_n[:, None] < hi, other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale  # [BR, BN]
        vis = (o_n[None, :] <= pos[:, None]) & (o_n[None, :] < hi)
        if WINDOW:
            vis = vis & (pos[:, None] - o_n[None, :] < W)
        b_s = tl.where(vis, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_sub)
        b_p = tl.math.exp2(b_s - m_sub[:, None])
        d1 = d1 * alpha + tl.sum(b_p, 1)
        acc1 = acc1 * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
        if HAS_PROBE:
            b_p2 = b_p * tl.dot(b_r, tl.trans(b_k), input_precision=DOT_PREC)
            d2 = d2 * alpha + tl.sum(b_p2, 1)
            acc2 = acc2 * alpha[:, None] + tl.dot(b_p2.to(b_v.dtype), b_v, input_precision=DOT_PREC)
        m_i = m_new

    if SPLIT:
        off_p = ((i_s * B + i_b) * TQ + i_t).to(tl.int64) * HQ + i_h  # partials [S, B, TQ, HQ]
        tl.store(PM + off_p, m_i, mask=row_ok)
        tl.store(PD1 + off_p, d1, mask=row_ok)
        tl.store(PO1 + off_p[:, None] * D + o_d[None, :], acc1, mask=row_ok[:, None])
        if HAS_PROBE:
            tl.store(PD2 + off_p, d2, mask=row_ok)
            tl.store(PO2 + off_p[:, None] * D + o_d[None, :], acc2, mask=row_ok[:, None])
        if FUSED_MERGE:
            n_split = tl.num_programs(0)
            tl.debug_barrier()  # all threads' partial stores happen before the release below
            n_done = tl.atomic_add(CNT + i_bh, 1, sem="acq_rel")  # old value: splits finished before this one
            if n_done == n_split - 1:  # last to finish: every other split's partials are visible
                _merge_splits(O, PM, PD1, PD2, PO1, PO2, i_b, i_kh, n_split, B, TQ, HQ, HKV, D, RR, SC, HAS_PROBE)
                tl.atomic_xchg(CNT + i_bh, 0)  # back to zero for the next call (graph replay)
    else:
        inv = 1.0 / tl.where(d1 > 0, d1, 1.0)
        o = acc1 * inv[:, None]
        if HAS_PROBE:
            o = o * (1.0 + d2 * inv)[:, None] - acc2 * inv[:, None]
        tl.store(O + off_q, o.to(O.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits(O, PM, PD1, PD2, PO1, PO2, i_b, i_kh, n_split, B, TQ: tl.constexpr, HQ: tl.constexpr,
                  HKV: tl.constexpr, D: tl.constexpr, RR: tl.constexpr, SC: tl.constexpr, HAS_PROBE: tl.constexpr):
    """Fused path: merge the n_split partials of the G·TQ query rows of (i_b, i_kh) and write o.

    Loads SC splits at once ([SC, RR, D] tiles: one L2 round trip for up to SC splits, not one per split) and
    merges chunks online with the main loop's rescaling. RR: G·TQ rounded up to a power of two.
    """
    G: tl.constexpr = HQ // HKV
    o_r = tl.arange(0, RR)
    row_ok = o_r < G * TQ
    i_t = o_r % TQ
    i_h = i_kh * G + o_r // TQ
    o_d = tl.arange(0, D)
    o_c = tl.arange(0, SC)
    m = tl.full([RR], float("-inf"), dtype=tl.float32)
    d1 = tl.zeros([RR], dtype=tl.float32)
    d2 = tl.zeros([RR], dtype=tl.float32)
    o1 = tl.zeros([RR, D], dtype=tl.float32)
    o2 = tl.zeros([RR, D], dtype=tl.float32)
    for s0 in range(0, n_split, SC):
        ok = ((s0 + o_c) < n_split)[:, None] & row_ok[None, :]  # [SC, RR]
        off_p = (((s0 + o_c[:, None]) * B + i_b) * TQ + i_t[None, :]).to(tl.int64) * HQ + i_h[None, :]
        off_o = off_p[:, :, None] * D + o_d[None, None, :]  # [SC, RR, D]
        # .cg: read at L2 (the coherence point), never a stale L1 line
        m_s = tl.load(PM + off_p, mask=ok, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(m_s, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: weights 0, no NaN
        alpha = tl.math.exp2(m - m_sub)  # [RR]
        w = tl.math.exp2(m_s - m_sub[None, :])  # [SC, RR]; 0 for masked / empty splits
        d1 = d1 * alpha + tl.sum(w * tl.load(PD1 + off_p, mask=ok, other=0.0, cache_modifier=".cg"), 0)
        p1 = tl.load(PO1 + off_o, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        o1 = o1 * alpha[:, None] + tl.sum(w[:, :, None] * p1, 0)
        if HAS_PROBE:
            d2 = d2 * alpha + tl.sum(w * tl.load(PD2 + off_p, mask=ok, other=0.0, cache_modifier=".cg"), 0)
            p2 = tl.load(PO2 + off_o, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            o2 = o2 * alpha[:, None] + tl.sum(w[:, :, None] * p2, 0)
        m = m_new
    inv = 1.0 / tl.where(d1 > 0, d1, 1.0)
    o = o1 * inv[:, None]
    if HAS_PROBE:
        o = o * (1.0 + d2 * inv)[:, None] - o2 * inv[:, None]
    off_out = ((i_b * TQ + i_t[:, None]).to(tl.int64) * HQ + i_h[:, None]) * D + o_d[None, :]  # [RR, D]
    tl.store(O + off_out, o.to(O.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _parallax_decode_merge_kernel(O, PM, PD1, PD2, PO1, PO2, NROWS, S: tl.constexpr, BS: tl.constexpr,
                                  D: tl.constexpr, BD: tl.constexpr, HAS_PROBE: tl.constexpr,
                                  PDL: tl.constexpr = False):
    """Grid (B·TQ·HQ, D // BD): one output row's channels [i_d·BD, (i_d + 1)·BD) from the S splits' partials."""
    if PDL:  # launched before the split kernel finished: wait for its grid to complete and its stores to land
        tl.extra.cuda.gdc_wait()
    i_row = tl.program_id(0).to(tl.int64)  # over B * TQ * HQ
    o_s = tl.arange(0, BS)
    s_ok = o_s < S
    off = o_s.to(tl.int64) * NROWS + i_row
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m = tl.load(PM + off, mask=s_ok, other=float("-inf"))
    m_max = tl.max(m, 0)
    w = tl.where(s_ok & (m > float("-inf")), tl.math.exp2(m - m_max), 0.0)  # [BS]
    d1 = tl.sum(w * tl.load(PD1 + off, mask=s_ok, other=0.0), 0)
    o1 = tl.sum(w[:, None] * tl.load(PO1 + off[:, None] * D + o_d[None, :], mask=s_ok[:, None], other=0.0), 0)
    inv = 1.0 / d1
    o = o1 * inv
    if HAS_PROBE:
        d2 = tl.sum(w * tl.load(PD2 + off, mask=s_ok, other=0.0), 0)
        o2 = tl.sum(w[:, None] * tl.load(PO2 + off[:, None] * D + o_d[None, :], mask=s_ok[:, None], other=0.0), 0)
        o = o * (1.0 + d2 * inv) - o2 * inv
    tl.store(O + i_row * D + o_d, o.to(O.dtype.element_ty))
