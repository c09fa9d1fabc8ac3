"""Shared pieces of the streaming kernels: autotune configuration lists, segment geometry and the key-range phases.

Masking is paid only where it is needed. A query tile [m0, m0+BM) of one document of length L sees the keys
[max(0, m0-W+1), min(m0+BM, L)). Key blocks split into three phases (BN-aligned, document-relative):

    A  [start, free_lo)   masked   (left window edge; empty without a window)
    B  [free_lo, free_hi) mask-free: every row of the tile sees every key of the block
    C  [free_hi, end)     masked   (the causal diagonal, the document end)

free_hi = m0 (the first row's causal limit, needs BM % BN == 0) and free_lo is computed from the LAST row of
the tile (m0 + BM - 1 - W + 1 = m0 + BM - W): computing it from the first row would skip the window mask on
rows that need it (docs/kernels.md, "Softmax and Parallax"). When free_lo >= free_hi, C alone covers [start, end).
The column pass mirrors this over query blocks for a key tile.

Query offsets (``Q_OFFSET``, context parallelism: ``cu_seqlens_k`` next to ``cu_seqlens``): segment s holds Lq
queries and Lk >= Lq keys, aligned bottom-right as in flash-attention, so query j sits at key position
OFF + j (OFF = Lk - Lq) and sees keys n <= OFF + j (and OFF + j - n < W). The row passes run the phases above with
the key position p0 = m0 + OFF of the tile's first row in place of m0 and Lk in place of L; p0 is not BN-aligned
in general, so free_hi = p0 // BN * BN (the blocks entirely <= p0). The column pass puts its key tile into query
coordinates (n0 - OFF, negative for keys before the first query's position): its first row block
max(n0 - OFF, 0) // BM * BM, the rows that see every key of the tile from cdiv(n0 + BN - 1 - OFF, BM) * BM on, the
window's bounds shifted by -OFF. Without ``Q_OFFSET`` OFF is the constant 0 and the kernels compile to the code
they compiled to before offsets existed.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from attnlab.attention.ops.autotune import INTERPRET, candidates
from attnlab.attention.ops.tiles import GROUP_PROGRAMS, tile_program


@triton.jit
def _row_program(HQ: tl.constexpr):
    """(query tile, q head, batch row or document) of a row kernel's program in a ``tiles.tile_grid`` of (document,
    head) pairs: the longest (diagonal-heavy) tiles first, in groups of pairs (``tiles.GROUP_PROGRAMS``)."""
    rank, pair, n_m, _ = tile_program(GROUP_PROGRAMS)
    return n_m - 1 - rank, pair % HQ, pair // HQ


@triton.jit
def _segment(CU, CU_K, i_b, T, IS_VARLEN: tl.constexpr, Q_OFFSET: tl.constexpr):
    """(bos, L, bos_k, L_k, OFF) of batch row or document i_b: its first query token and query count, its first key
    token and key count, and the key position of its first query (OFF = L_k - L). CU, CU_K: [S+1] int32 offsets of
    the queries and (Q_OFFSET) of the keys; without Q_OFFSET the keys are the queries' tokens and OFF is 0."""
    if IS_VARLEN:
        bos = tl.load(CU + i_b).to(tl.int64)
        L = (tl.load(CU + i_b + 1) - tl.load(CU + i_b)).to(tl.int32)
    else:
        bos = i_b.to(tl.int64) * T
        L = T
    if Q_OFFSET:
        bos_k = tl.load(CU_K + i_b).to(tl.int64)
        L_k = (tl.load(CU_K + i_b + 1) - tl.load(CU_K + i_b)).to(tl.int32)
        off = L_k - L
    else:
        bos_k = bos
        L_k = L
        off = 0
    return bos, L, bos_k, L_k, off


@triton.jit
def _phases(start, free_lo, free_hi, end):
    """The three phases' (A, B, C) bounds from the first masked block, the mask-free range and the end. Returns
    (start, a_hi, b_lo, b_hi, c_lo, end)."""
    has_free = (free_lo < free_hi).to(tl.int32)
    a_hi = has_free * free_lo + (1 - has_free) * start  # no mask-free block: A empty, C = [start, end)
    b_lo = has_free * free_lo
    b_hi = has_free * free_hi
    c_lo = has_free * free_hi + (1 - has_free) * start
    return start, a_hi, b_lo, b_hi, c_lo, end


@triton.jit
def _row_phases(m0, OFF, L_k, W, BM: tl.constexpr, BN: tl.constexpr, WINDOW: tl.constexpr,
                Q_OFFSET: tl.constexpr):
    """Key-block phases (A, B, C above) for the query tile starting at m0 (query-local), whose rows sit at key
    positions m0 + OFF onwards, over L_k keys. Returns 6 bounds."""
    p0 = m0 + OFF  # key position of the tile's first row
    end = tl.minimum(p0 + BM, L_k)
    if Q_OFFSET:
        free_hi = p0 // BN * BN  # p0 >= 0: blocks entirely <= p0
    else:
        free_hi = p0  # BM % BN == 0, so m0 is BN-aligned
    if WINDOW:
        start = tl.maximum(p0 - W + 1, 0) // BN * BN
        free_lo = tl.maximum(tl.cdiv(tl.maximum(p0 + BM - W, 0), BN) * BN, start)
    else:
        start = 0
        free_lo = 0
    return _phases(start, free_lo, free_hi, end)


@triton.jit
def _col_phases(n0, OFF, L, W, BM: tl.constexpr, BN: tl.constexpr, WINDOW: tl.constexpr, Q_OFFSET: tl.constexpr):
    """Query-block phases for the key tile [n0, n0+BN) over L queries: rows i with j <= i + OFF < j + W
    (BN % BM == 0). With an offset the tile's first rows may lie before the first query (n0 - OFF < 0): those
    bounds are clamped to 0 before they are divided (Triton's division truncates toward zero). The window's bounds
    need no clamp: where negative, the rows' range is empty and no row is mask-free (free_hi <= 0 <= free_lo)
    however the division rounds."""
    if Q_OFFSET:
        start = tl.maximum(n0 - OFF, 0) // BM * BM  # the block of the first row that sees key n0
    else:
        start = n0  # BM-aligned since BN % BM == 0
    if WINDOW:
        end = tl.minimum(L, n0 + BN - 1 + W - OFF)
        free_hi = tl.minimum(L // BM * BM, (n0 + W - OFF) // BM * BM)
    else:
        end = L
        free_hi = L // BM * BM  # unmasked loads need full row blocks
    if Q_OFFSET:
        free_lo = tl.cdiv(tl.maximum(n0 + BN - 1 - OFF, 0), BM) * BM  # rows that see the tile's last key
    else:
        free_lo = n0 + BN  # rows past the diagonal block see every key of the tile
    return _phases(start, free_lo, free_hi, end)


@triton.jit
def _tile_descriptor(A, NT, WIDTH: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr):
    """A device-side TMA descriptor of [ROWS, D] tiles over the [tokens, WIDTH] view of A (A itself without TMA).
    Used by the mask-free loops only: a descriptor does not stop at a document's end."""
    if TMA:
        desc = tl.make_tensor_descriptor(A, shape=[NT, WIDTH], strides=[WIDTH, 1], block_shape=[ROWS, D])
    else:
        desc = A
    return desc


@triton.jit
def _kv_tiles(K, V, bos_k, i_kh, NT, NT_K, HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr,
              Q_OFFSET: tl.constexpr):
    """What a row pass streams its K/V tiles from: pointers at (the segment's first key, kv head ``i_kh``), their
    descriptors over the key tokens (NT_K with query offsets, else the queries' NT) and the descriptors' coordinates
    of that key and head. Returns (p_k0, p_v0, desc_k, desc_v, row0, col0)."""
    p_k0 = K + bos_k * (HKV * D) + i_kh * D
    p_v0 = V + bos_k * (HKV * D) + i_kh * D
    nt_k = NT_K if Q_OFFSET else NT
    desc_k = _tile_descriptor(K, nt_k, HKV * D, BN, D, TMA)
    desc_v = _tile_descriptor(V, nt_k, HKV * D, BN, D, TMA)
    return p_k0, p_v0, desc_k, desc_v, bos_k.to(tl.int32), i_kh * D


def spec_kwargs(spec, names) -> dict:
    """Kernel meta-parameters of a (tile0, tile1, warps, stages[, tma, ws]) tuple (ws: the forward only)."""
    kw = dict(zip(names, spec[:2]))
    if len(spec) == 6:
        kw["TMA"] = bool(spec[4])
        if spec[5]:
            kw["WS"] = True
    return kw


def configs(spec, names):
    """triton.Configs from (tile0, tile1, warps, stages[, tma, ws]) tuples."""
    return candidates([triton.Config(spec_kwargs(s, names), num_warps=s[2], num_stages=s[3]) for s in spec])


# (BM, BN, warps, stages). Kept small: autotuning compiles every entry once per key (no T in the key).
# The short lists hold the winners of the wide sweep below (``PARALLAX_WIDE_TUNE=1``; T=4096, 16/8 heads, D=64/128,
# probe and softmax) plus one neighbour.
FWD_SPECS = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3, 1, 1),
             (128, 128, 8, 3, 1, 1)]
# The 8-warp entries (64, 64, 8, 2) of DQ_SPECS and (64, 32, 8, 2) of DKV_SPECS are the low-spill candidates of the
# note below; the (…, 1, 0) entries are TMA twins (note further below).
DQ_SPECS = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 8, 2), (128, 64, 8, 3, 1, 0),
            (64, 64, 4, 2, 1, 0)]
DKV_SPECS = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 3), (64, 32, 8, 2),
             (64, 64, 4, 2, 1, 0), (64, 32, 4, 3)]  # (BN, BM, ...)
# The 8-warp and BM = 32 entries are candidates against the backward's register spills at D = 128 with a probe:
# 8 warps halve each thread's share of the two [BM|BN, D] fp32 accumulators, BM = 32 halves every score tile
# (offline counts: ``benchmarks/profile_attention.py --spills``; ``benchmarks/bench_attention.py --tune-report`` times
# each kernel alone to re-pick the lists).
# Forward entries may add (kv_tma, ws): K/V tiles of the mask-free key blocks by TMA (device-side descriptors) and a
# warp-specialised loop; they paid at D = 128 only. Warp specialisation does not compile at 4 warps (Triton 3.6).
# ``prune_fwd`` keeps the TMA/WS entries at D >= 128 and sm_90+ only, and on sm_90 drops the plain twin of a TMA + WS
# entry (its docstring). Backward entries may add (tma, 0): the row pass's K/V tiles, or the column pass's Q/ρ/dO
# tiles, of the mask-free blocks by TMA, pruned like the forward's; a warp-specialised backward loop gained too
# little at 8 warps and does not compile at the 4-warp picks, so the backward kernels have no WS.
TUNE_EXTRA_FWD = [(64, 64, 8, 3), (128, 32, 8, 3)]
TUNE_EXTRA_DQ = [(64, 64, 8, 2), (64, 32, 8, 2), (128, 32, 8, 2)]
TUNE_EXTRA_DKV = [(64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2), (128, 32, 8, 2)]
# PARALLAX_WIDE_TUNE=1 (benchmarks/bench_attention.py --sweep): a wider list, to pick the short lists above.
WIDE_FWD = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
            (64, 64, 4, 4), (128, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (128, 32, 8, 4), (64, 32, 4, 4)]
WIDE_BWD = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2),
            (128, 32, 8, 3), (64, 32, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2), (32, 32, 4, 3)]
if os.environ.get("PARALLAX_WIDE_TUNE", "0") == "1":
    FWD_SPECS = list(dict.fromkeys(WIDE_FWD + TUNE_EXTRA_FWD))
    DQ_SPECS = list(dict.fromkeys(WIDE_BWD + TUNE_EXTRA_DQ))
    DKV_SPECS = list(dict.fromkeys(WIDE_BWD + TUNE_EXTRA_DKV))
INTERPRET_FWD = [(16, 16, 1, 1)]
INTERPRET_BWD = [(16, 16, 1, 1)]


def fwd_configs():
    return configs(INTERPRET_FWD if INTERPRET else FWD_SPECS, ("BM", "BN"))


def dq_configs():
    return configs(INTERPRET_BWD if INTERPRET else DQ_SPECS, ("BM", "BN"))


def dkv_configs():
    return configs(INTERPRET_BWD if INTERPRET else DKV_SPECS, ("BN", "BM"))


def _capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability; None without one (the interpreter, CPU tests)."""
    import torch

    return None if INTERPRET or not torch.cuda.is_available() else torch.cuda.get_device_capability()


def _tma_ws(c) -> bool:
    return bool(c.kwargs.get("TMA") or c.kwargs.get("WS"))


def _tma_ws_dropped(c, D: int, capability: tuple[int, int] | None) -> bool:
    """A TMA / warp-specialised candidate goes below D = 128 (plain tiles measured faster there) and below sm_90."""
    return _tma_ws(c) and (D < 128 or (capability is not None and capability < (9, 0)))


def _tile(c) -> tuple[int, int, int, int]:
    return c.kwargs["BM"], c.kwargs["BN"], c.num_warps, c.num_stages


def prune_fwd(configs, named_args, capability: tuple[int, int] | None = None, **kwargs):
    """Drop tiles whose two [BM, D] fp32 accumulators (probe) or [BN, D] tiles would spill at large D, and the
    TMA / warp-specialised variants below D = 128, where the plain tiles measured faster (one compile fewer each).

    ``capability`` (default: the current CUDA device's, None without one): below sm_90 the TMA / warp-specialised
    variants go (no TMA hardware). On sm_90 a plain tile goes when its TMA + warp-specialised twin is kept: the
    twin of the Parallax D=128 forward tile was the faster in nearly every paired timing on H100s, while the
    autotuner, timing both at the first call, picked the plain one about half of the time (timing noise)."""
    D, probe = kwargs.get("D", named_args.get("D")), kwargs.get("HAS_PROBE", named_args.get("HAS_PROBE"))
    capability = _capability() if capability is None else capability
    out = []
    for c in configs:
        bm, bn = c.kwargs["BM"], c.kwargs["BN"]
        if _tma_ws_dropped(c, D, capability):
            continue
        if D >= 128 and probe and bn > 64:
            continue
        if D >= 256 and (bm > 64 or bn > 32):
            continue
        out.append(c)
    if capability is not None and capability[0] == 9:
        twins = {_tile(c) for c in out if c.kwargs.get("TMA") and c.kwargs.get("WS")}
        out = [c for c in out if _tma_ws(c) or _tile(c) not in twins]
    return out or configs[-1:]


def prune_bwd(configs, named_args, capability: tuple[int, int] | None = None, **kwargs):
    """Drop tiles that spill at large D (probe: BM·BN ≥ 128², D ≥ 256: tiles > 64), and the TMA twins below D = 128
    or sm_90 (``capability``: as in ``prune_fwd``)."""
    D = kwargs.get("D", named_args.get("D"))
    capability = _capability() if capability is None else capability
    configs = [c for c in configs if not _tma_ws_dropped(c, D, capability)] or configs
    if D >= 128 and kwargs.get("HAS_PROBE", named_args.get("HAS_PROBE")):
        configs = [c for c in configs if c.kwargs["BM"] * c.kwargs["BN"] < 128 * 128] or configs
    out = [c for c in configs if not (D >= 256 and (c.kwargs["BM"] > 64 or c.kwargs["BN"] > 64))]
    if D >= 256:
        out = [c for c in out if c.num_stages <= 2] or [triton.Config(dict(c.kwargs), num_warps=4, num_stages=1)
                                                         for c in configs[:1]]
    return out or configs[-1:]
