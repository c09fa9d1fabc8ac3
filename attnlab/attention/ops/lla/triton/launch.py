"""Host side of the LLA kernels: tile lists and autotuners, state buffers, and the forward / backward launches."""

from __future__ import annotations

import torch
import triton

from attnlab.attention.ops.autotune import candidates
from attnlab.attention.ops.lla.triton import common
from attnlab.attention.ops.lla.triton.bwd import _bwd_a_kernel, _bwd_b_kernel, _bwd_kv_kernel
from attnlab.attention.ops.lla.triton.cg import _cg_step_kernel
from attnlab.attention.ops.lla.triton.common import LOG2E, N_ROWS, _cfg, _launch, _strides
from attnlab.attention.ops.lla.triton.fwd import _out_kernel, _stats_kernel
from attnlab.attention.ops.outputs import empty, empty_like
from attnlab.attention.ops.tiles import tile_grid

# ----- tiles: each kernel autotuned on its own, per (D, G, JACOBI, PRECISE, dtypes), never per T -----
# Each list holds the two or three fastest tiles of its kernel at B4 T4096 16/8 heads D128 bf16 on an H100, fastest
# first (ATTNLAB_AUTOTUNE=first keeps that one); how they were chosen is in docs/kernels.md ("LLA").
# The CG step holds what a flash-attention forward holds (q, p, one [BR, D] fp32 accumulator, score tiles).
STEP_CONFIGS = [_cfg(64, 64, 4, 3), _cfg(64, 64, 4), _cfg(128, 64, 8, 3)]
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
# dk/dv: BC (keys) is the M dimension of every product, BR (queries) the N or K dimension; 64-query tiles spill
# inside the loop on sm_90.
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
    """q: [B, T, HQ, D]; k, v: [B, T, HKV, D] (bf16/fp16/fp32: the dot operand dtype); lam: [B, T, HQ] fp32;
    doc_start: [B, T] int32. Returns out [B, T, HQ, D] in q's dtype, then what the backward reads: centre
    [1 + jacobi, B, T, HQ, D] fp32 (k̄, and the Jacobi diagonal), ρ [B, T, HQ, D] fp32, δ, m (log2 units),
    ω [B, T, HQ] fp32. ``block_r``/``block_c`` pin a tile (None: autotuned)."""
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
    const = {"D": D, "G": HQ // HKV, "PRECISE": common.PRECISE, "BD": max(16, triton.next_power_of_2(D))}
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


def lla_bwd_triton(q, k, v, lam, doc_start, doc_end, centre, do, rho, delta, m, om, scale, cg_iters, jacobi, rtol,
                   block_r=None, block_c=None):
    """The forward's inputs and statistics and do [B, T, HQ, D]. Returns dq [B, T, HQ, D], dk, dv [B, T, HKV, D] in
    the dtypes of q, k, v and dlam [B, T, HQ] fp32. The gradient is the k̄-centred one of ``chunk.py`` (``bwd.py``)."""
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    do = do.to(q.dtype).contiguous()
    dq = empty_like(q)
    u = torch.empty_like(rho)
    dlam = empty(B, T, HQ, device=q.device, dtype=torch.float32)
    r, p, alpha, rows, cb = _cg_buffers(q, cg_iters)
    ctr, diag = _centre_views(centre)
    block = None if block_r is None else (block_r, block_c)
    qk_scale = scale * LOG2E
    const = {"D": D, "G": HQ // HKV, "BD": max(16, triton.next_power_of_2(D))}
    strides = _strides(q, k, lam)
    grid = lambda br, bc: tile_grid(triton.cdiv(T, br), B * HQ)  # noqa: E731
    # the solve's x goes into u's buffer
    _launch(_bwd_a_tuned, _bwd_a_kernel, grid, block,
            (q, k, v, lam, doc_start, do, m, om, r, p, ctr, cb, diag, rows, *strides, T, HQ, qk_scale, rtol**2),
            {**const, "JACOBI": jacobi, "PRECISE": common.PRECISE})
    _solve(q, k, doc_start, m, u, r, p, alpha, cb, diag, rows, strides, qk_scale, cg_iters, jacobi, block,
           {**const, "PRECISE": common.PRECISE})
    rb, ub = cb, p[0]  # ρ_c, u in the operand dtype (the solve's centre and first direction are free now)
    _launch(_bwd_b_tuned, _bwd_b_kernel, grid, block,
            (q, k, v, doc_start, do, rho, delta, m, om, ctr, rows, dq, u, dlam, rb, ub, *strides[:6],
             T, HQ, scale, qk_scale), const)
    dk, dv = empty_like(k), empty_like(v)
    _launch(_kv_tuned, _bwd_kv_kernel, lambda br, bc: tile_grid(triton.cdiv(T, bc), B * HKV), block,
            (q, k, v, doc_start, doc_end, do, m, om, rows, rb, ub, dk, dv, *strides[:6], T, HQ, HKV, scale, qk_scale),
            const)
    return dq, dk, dv, dlam
