"""torch.library custom ops around the Triton kernels (opaque to torch.compile: no graph break).

- ``attnlab::parallax_fwd``    (q, k, v, r?, cu_seqlens?, scale, max_seqlen, cu_seqlens_k?, max_seqlen_k, window)
                                -> (o, lse, vbar, tbar)
- ``attnlab::parallax_bwd``    (do, q, k, v, r?, o, lse, vbar, tbar, ...) -> (dq, dk, dv, dr)
- ``attnlab::parallax_decode`` (q, k_cache, v_cache, seqlens, r?, scale, window, num_splits, fused_merge) -> o

Autograd is registered on ``fwd`` (``register_autograd``); ``fake`` kernels give the shapes for tracing. Eager
calls outside any dispatch mode run the same forward and backward through an ``autograd.Function`` instead, without
the op's dispatch layers (``attend``).
Tensors use the ``[B, T, H, D]`` layout; with ``cu_seqlens`` the batch is one flattened row (B = 1).
Row statistics (lse in log2 units, t̄, τ, β) are fp32 ``[HQ, B*T]``.
Query offsets (context parallelism): with ``cu_seqlens_k`` [S+1] next to ``cu_seqlens`` [S+1], k and v are
``[1, Nk, HKV, D]`` with their own segment offsets (Nk != Nq = B*T in general; segment s: Lk >= Lq), and query j
of a segment sits at key position Lk − Lq + j, seeing the keys up to it (bottom-right causal, as flash-attention
aligns Tq != Tk); dk, dv have k's shape, and keys that no query sees get zero gradients. ``max_seqlen_k``: the
longest key segment (0: computed, a host sync). Without ``cu_seqlens_k`` the kernels compile without the offset
(``Q_OFFSET``).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton

from attnlab.attention.ops.autotune import compile_candidates
from attnlab.attention.ops.custom_ops import attnlab_op
from attnlab.attention.ops.fla_launch import FastLaunch
from attnlab.attention.ops.outputs import empty, empty_like
from attnlab.attention.ops.parallax.triton.bwd import _parallax_bwd_dkv_kernel, _parallax_bwd_dq_kernel
from attnlab.attention.ops.parallax.triton.common import INTERPRET
from attnlab.attention.ops.parallax.triton.decode import _parallax_decode_kernel, _parallax_decode_merge_kernel
from attnlab.attention.ops.parallax.triton.fwd import LOG2E, _parallax_fwd_kernel
from attnlab.attention.ops.tiles import tile_grid

Tensor = torch.Tensor


def _longest(cu_seqlens: Tensor, max_seqlen: int) -> int:
    """max_seqlen, or where it is 0 the longest segment of the [S+1] offsets ``cu_seqlens`` (a host sync)."""
    return max_seqlen if max_seqlen > 0 else int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def _geometry(q: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: int, cu_seqlens_k: Optional[Tensor] = None,
              max_seqlen_k: int = 0):
    """(T per program row, number of program rows, longest query sequence, longest key sequence, varlen flag)."""
    B, T = q.shape[:2]
    if cu_seqlens is None:
        return T, B, T, T, False
    max_seqlen = _longest(cu_seqlens, max_seqlen)
    max_seqlen_k = max_seqlen if cu_seqlens_k is None else _longest(cu_seqlens_k, max_seqlen_k)
    return T, cu_seqlens.numel() - 1, max_seqlen, max_seqlen_k, True


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs get exact fp32 products


def _window(window_size: int, max_len: int) -> int:
    return window_size if 0 < window_size < max_len else 0


# ---------------------------------------------------------------- launches
def _tma_alloc(size: int, alignment: int, stream: Optional[int]) -> Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _tma_allocator() -> None:
    """Device-side tensor descriptors (the TMA candidates) need Triton's scratch allocator. Triton keeps it in a
    ContextVar, and autograd runs the backward in its own thread, which starts without one: so it is set before
    every launch, not once."""
    if not INTERPRET:
        triton.set_allocator(_tma_alloc)


_FAST = {kernel: FastLaunch(kernel) for kernel in (_parallax_fwd_kernel, _parallax_bwd_dq_kernel,
                                                    _parallax_bwd_dkv_kernel)}
"""Each autotuned kernel behind a :class:`FastLaunch`: the autotuner picks at the first launch per key, later
launches run its pick on the bare kernel."""


def _launch(job: tuple, config: Optional[dict], follow=None) -> None:
    """Run ``job`` = (autotuned kernel, grid, args, meta): autotuned, or with ``config`` = {BM, BN, num_warps,
    num_stages[, TMA, WS]} the bare kernel at that config (benchmarks/bench_attention.py --tune-report times each
    candidate this way). At a new autotune key the candidates of ``job``, and of the jobs ``follow`` returns, compile
    first in one pool (``compile_candidates``) and the autotuner picks; later launches at the key run its pick on
    the bare kernel (``FastLaunch``), without ``Autotuner.run``'s and the key check's host time per launch."""
    kernel, grid, args, meta = job
    _tma_allocator()
    if config is None:
        _FAST[kernel].run(*args, grid=grid, first_launch=lambda: compile_candidates(job, follow), **meta)
    else:
        kernel.fn[grid](*args, **meta, **config)


def _meta(q: Tensor, k: Tensor, probe: bool, varlen: bool, W: int, q_offset: bool) -> dict:
    return dict(HQ=q.shape[2], HKV=k.shape[2], D=q.shape[3], HAS_PROBE=probe, IS_VARLEN=varlen, WINDOW=W > 0,
                DOT_PREC=_dot_prec(q.dtype), Q_OFFSET=q_offset)


def _layout(q: Tensor, k: Tensor, r: Optional[Tensor], lse: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: int,
            window_size: int, cu_seqlens_k: Optional[Tensor], max_seqlen_k: int) -> tuple:
    """What the three jobs share: (T per program row, program rows, longest query and key sequences, window, the
    kernels' CU and CU_K arguments (``lse`` stands in for an absent one), their meta-parameters)."""
    T_arg, NB, Tmax, Tmax_k, varlen = _geometry(q, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
    W = _window(window_size, Tmax_k)  # a query sees at most Tmax_k keys: a window that long is no window
    q_offset = cu_seqlens_k is not None
    cu = cu_seqlens if varlen else lse
    meta = _meta(q, k, r is not None, varlen, W, q_offset)
    return T_arg, NB, Tmax, Tmax_k, W, cu, cu_seqlens_k if q_offset else cu, meta


def _fwd_job(q, k, v, r, o, lse, vbar, tbar, cu_seqlens, scale, max_seqlen, window_size, cu_seqlens_k=None,
             max_seqlen_k=0) -> tuple:
    B, T, HQ = q.shape[:3]
    T_arg, NB, Tmax, _, W, cu, cu_k, meta = _layout(q, k, r, lse, cu_seqlens, max_seqlen, window_size, cu_seqlens_k,
                                                    max_seqlen_k)
    probe = r is not None
    grid = lambda META: tile_grid(triton.cdiv(Tmax, META["BM"]), HQ * NB)  # noqa: E731
    args = (q, k, v, r if probe else q, o, lse, vbar if probe else o, tbar if probe else lse, cu, cu_k,
            scale * LOG2E, W, T_arg, B * T, k.shape[0] * k.shape[1])
    return _parallax_fwd_kernel, grid, args, meta


def _dq_job(do, q, k, v, r, o, lse, vbar, tbar, tau, beta, cu_seqlens, scale, max_seqlen, window_size, dq, dr,
            cu_seqlens_k=None, max_seqlen_k=0) -> tuple:
    B, T, HQ = q.shape[:3]
    T_arg, NB, Tmax, _, W, cu, cu_k, meta = _layout(q, k, r, lse, cu_seqlens, max_seqlen, window_size, cu_seqlens_k,
                                                    max_seqlen_k)
    probe = r is not None
    grid = lambda META: tile_grid(triton.cdiv(Tmax, META["BM"]), HQ * NB)  # noqa: E731
    args = (q, k, v, r if probe else q, o, do, lse, vbar if probe else o, tbar if probe else lse, tau, beta,
            dq, dr if probe else dq, cu, cu_k, scale, scale * LOG2E, W, T_arg, B * T, k.shape[0] * k.shape[1])
    return _parallax_bwd_dq_kernel, grid, args, meta


def _dkv_job(do, q, k, v, r, o, lse, vbar, tbar, tau, beta, cu_seqlens, scale, max_seqlen, window_size, dk, dv,
             cu_seqlens_k=None, max_seqlen_k=0) -> tuple:
    B, T = q.shape[:2]
    HKV = k.shape[2]
    T_arg, NB, Tmax, Tmax_k, W, cu, cu_k, meta = _layout(q, k, r, lse, cu_seqlens, max_seqlen, window_size,
                                                         cu_seqlens_k, max_seqlen_k)
    probe = r is not None
    grid = lambda META: tile_grid(triton.cdiv(Tmax_k, META["BN"]), HKV * NB)  # noqa: E731
    args = (q, k, v, r if probe else q, do, lse, tbar if probe else lse, tau, beta, dk, dv, cu, cu_k, scale,
            scale * LOG2E, W, T_arg, B * T)
    long_off = (Tmax + 256) * q.shape[2] * q.shape[3] >= 2**31  # the column pass's per-document int32 query offsets
    return _parallax_bwd_dkv_kernel, grid, args, dict(meta, LONG_OFF=long_off)


def _bwd_stand_ins(q, k, v, r, o, lse, vbar, tbar, cu_seqlens, scale, max_seqlen, window_size, cu_seqlens_k=None,
                   max_seqlen_k=0) -> tuple:
    """The backward's two jobs with the forward's buffers standing in for do, tau, beta and the gradients: same
    dtypes, shapes and scalars, so the same compiled kernels. Compiling needs no launch, so nothing is written."""
    probe = r is not None
    args = (o, q, k, v, r, o, lse, vbar, tbar, lse, tbar if probe else lse, cu_seqlens, scale, max_seqlen,
            window_size)
    keys = dict(cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    return _dq_job(*args, o, vbar if probe else None, **keys), _dkv_job(*args, k, v, **keys)


def launch_fwd(q, k, v, r, o, lse, vbar, tbar, cu_seqlens, scale, max_seqlen, window_size, config=None,
               backward: bool = False, *, cu_seqlens_k=None, max_seqlen_k=0) -> None:
    """Forward kernel into preallocated o, lse (and vbar, tbar with a probe). ``backward``: a backward will follow,
    so the backward kernels' candidates compile in the same pool as the forward's at a new key (the cold first
    fwd+bwd then waits for one pool, not three). ``cu_seqlens_k``, ``max_seqlen_k``: query offsets (module
    docstring)."""
    args = (q, k, v, r, o, lse, vbar, tbar, cu_seqlens, scale, max_seqlen, window_size)
    keys = dict(cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    _launch(_fwd_job(*args, **keys), config, (lambda: _bwd_stand_ins(*args, **keys)) if backward else None)


def launch_dq(do, q, k, v, r, o, lse, vbar, tbar, tau, beta, cu_seqlens, scale, max_seqlen, window_size, dq, dr,
              config=None, *, cu_seqlens_k=None, max_seqlen_k=0) -> None:
    """Row pass: writes tau (and beta with a probe), dq (and dr)."""
    _launch(_dq_job(do, q, k, v, r, o, lse, vbar, tbar, tau, beta, cu_seqlens, scale, max_seqlen, window_size, dq,
                    dr, cu_seqlens_k, max_seqlen_k), config)


def launch_dkv(do, q, k, v, r, o, lse, vbar, tbar, tau, beta, cu_seqlens, scale, max_seqlen, window_size, dk, dv,
               config=None, *, cu_seqlens_k=None, max_seqlen_k=0) -> None:
    """Column pass (reads tau, beta from the row pass): writes dk, dv (zeros for keys that no query sees)."""
    _launch(_dkv_job(do, q, k, v, r, o, lse, vbar, tbar, tau, beta, cu_seqlens, scale, max_seqlen, window_size, dk,
                     dv, cu_seqlens_k, max_seqlen_k), config)


def _forward(q: Tensor, k: Tensor, v: Tensor, r: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
             max_seqlen: int, cu_seqlens_k: Optional[Tensor], max_seqlen_k: int, window_size: int,
             backward: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(o, lse, vbar, tbar): the forward of both paths (``attend``)."""
    B, T, HQ, D = q.shape
    probe = r is not None
    o = empty_like(q)
    lse = empty(HQ, B * T, device=q.device, dtype=torch.float32)
    vbar = empty_like(q) if probe else q.new_empty(0)
    tbar = empty_like(lse) if probe else lse.new_empty(0)
    launch_fwd(q, k, v, r, o, lse, vbar, tbar, cu_seqlens, scale, max_seqlen, window_size, backward=backward,
               cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    return o, lse, vbar, tbar


def _backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, r: Optional[Tensor], o: Tensor, lse: Tensor, vbar: Tensor,
              tbar: Tensor, cu_seqlens: Optional[Tensor], scale: float, max_seqlen: int,
              cu_seqlens_k: Optional[Tensor], max_seqlen_k: int,
              window_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dr): the backward of both paths; dr is empty without a probe."""
    probe = r is not None
    dq = empty_like(q)
    dk = empty_like(k)
    dv = empty_like(v)
    dr = empty_like(q) if probe else q.new_empty(0)
    tau = empty_like(lse)
    beta = empty_like(lse) if probe else tau
    # at most one host sync per unknown length, shared by both passes
    _, _, max_seqlen, max_seqlen_k, _ = _geometry(q, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
    args = (do.contiguous(), q, k, v, r, o, lse, vbar, tbar, tau, beta, cu_seqlens, scale, max_seqlen, window_size)
    keys = dict(cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
    launch_dq(*args, dq, dr, **keys)
    launch_dkv(*args, dk, dv, **keys)
    return dq, dk, dv, dr


def _fwd_fake(q, k, v, r, cu_seqlens, scale, max_seqlen, cu_seqlens_k, max_seqlen_k, window_size):
    B, T, HQ, D = q.shape
    lse = q.new_empty(HQ, B * T, dtype=torch.float32)
    if r is None:
        return torch.empty_like(q), lse, q.new_empty(0), lse.new_empty(0)
    return torch.empty_like(q), lse, torch.empty_like(q), q.new_empty(HQ, B * T, dtype=torch.float32)


@attnlab_op("parallax_fwd", _fwd_fake, keep_under_sac=True)
def parallax_fwd(q: Tensor, k: Tensor, v: Tensor, r: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
                 max_seqlen: int, cu_seqlens_k: Optional[Tensor], max_seqlen_k: int,
                 window_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # requires_grad only: the op's autograd runs this body with grad mode off even when a backward follows, so an
    # op call under torch.no_grad() on inputs that require grad still compiles the backward's candidates
    needs_grad = any(t is not None and t.requires_grad for t in (q, k, v, r))
    return _forward(q, k, v, r, cu_seqlens, scale, max_seqlen, cu_seqlens_k, max_seqlen_k, window_size, needs_grad)


def _bwd_fake(do, q, k, v, r, o, lse, vbar, tbar, cu_seqlens, scale, max_seqlen, cu_seqlens_k, max_seqlen_k,
              window_size):
    dr = torch.empty_like(q) if r is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dr  # dk, dv: k's shape (Nk keys)


@attnlab_op("parallax_bwd", _bwd_fake)
def parallax_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, r: Optional[Tensor], o: Tensor, lse: Tensor,
                 vbar: Tensor, tbar: Tensor, cu_seqlens: Optional[Tensor], scale: float, max_seqlen: int,
                 cu_seqlens_k: Optional[Tensor], max_seqlen_k: int,
                 window_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward(do, q, k, v, r, o, lse, vbar, tbar, cu_seqlens, scale, max_seqlen, cu_seqlens_k, max_seqlen_k,
                     window_size)


def _save(ctx, inputs: tuple, output: tuple) -> None:
    """What both paths' backward reads: ``inputs`` = (q, k, v, r, cu_seqlens, scale, max_seqlen, cu_seqlens_k,
    max_seqlen_k, window_size), ``output`` = (o, lse, vbar, tbar)."""
    q, k, v, r, cu_seqlens, scale, max_seqlen, cu_seqlens_k, max_seqlen_k, window_size = inputs
    ctx.save_for_backward(q, k, v, r, *output, cu_seqlens, cu_seqlens_k)
    ctx.args = (scale, max_seqlen, max_seqlen_k, window_size)


def _grads(ctx, do: Tensor, backward) -> tuple:
    """(dq, dk, dv, dr or None) from what ``_save`` kept; ``backward``: ``parallax_bwd`` (the op) or ``_backward``."""
    q, k, v, r, o, lse, vbar, tbar, cu_seqlens, cu_seqlens_k = ctx.saved_tensors
    scale, max_seqlen, max_seqlen_k, window_size = ctx.args
    dq, dk, dv, dr = backward(do, q, k, v, r, o, lse, vbar, tbar, cu_seqlens, scale, max_seqlen, cu_seqlens_k,
                              max_seqlen_k, window_size)
    return dq, dk, dv, (dr if r is not None else None)


def _setup_context(ctx, inputs, output):
    _save(ctx, inputs, output)
    ctx.mark_non_differentiable(*output[1:])


def _op_backward(ctx, do, _dlse, _dvbar, _dtbar):
    return *_grads(ctx, do, parallax_bwd), None, None, None, None, None, None


parallax_fwd.register_autograd(_op_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The custom ops' forward and backward without their dispatch layers (``attend``)."""

    @staticmethod
    def forward(ctx, q, k, v, r, cu_seqlens, scale, max_seqlen, cu_seqlens_k, max_seqlen_k, window_size, backward):
        inputs = (q, k, v, r, cu_seqlens, scale, max_seqlen, cu_seqlens_k, max_seqlen_k, window_size)
        output = _forward(*inputs, backward)
        _save(ctx, inputs, output)
        return output[0]

    @staticmethod
    def backward(ctx, do):
        return *_grads(ctx, do, _backward), None, None, None, None, None, None, None


def attend(q: Tensor, k: Tensor, v: Tensor, r: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
           max_seqlen: int, window_size: int, cu_seqlens_k: Optional[Tensor] = None, max_seqlen_k: int = 0) -> Tensor:
    """o = attention of q, k, v (and the probe r), differentiable: through the custom op ``attnlab::parallax_fwd``
    where something must see the op (``torch.compile``; any TorchDispatchMode, e.g. selective activation
    checkpointing's, whose save list names it; fake tensors), else through ``_Eager``, the same kernels and
    buffers without the op's dispatch layers (about half the host time per fwd+bwd). ``cu_seqlens_k``,
    ``max_seqlen_k``: query offsets (module docstring)."""
    args = (q, k, v, r, cu_seqlens, scale, max_seqlen, cu_seqlens_k, max_seqlen_k, window_size)
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return parallax_fwd(*args)[0]
    backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, r))
    return _Eager.apply(*args, backward)


# ---------------------------------------------------------------- decode
DECODE_CFG = {"BN": 64, "num_warps": 4, "num_stages": 3}
"""Decode tile and launch parameters (fixed, not autotuned: a CUDA-graph capture must not benchmark). Picked by
``benchmarks/bench_attention.py --sweep``."""
DECODE_CFG_LONG = {"BN": 32, "num_warps": 2, "num_stages": 3}
"""Tile for programs that stream at least LONG_MIN_KEYS cache keys, when the grid has at most
LONG_MAX_PROGRAMS_PER_SM programs per SM (``decode_cfg``): long caches on small grids, where the default tile left
cells slower than SDPA. Both limits are where the smaller tile stopped paying (many keys per program, few
programs)."""
LONG_MIN_KEYS = 512
LONG_MAX_PROGRAMS_PER_SM = 2
DECODE_CFG_MANY = {"BN": 128, "num_warps": 4, "num_stages": 2}
"""Parallax tile for grids of more than LONG_MAX_PROGRAMS_PER_SM programs per SM whose programs stream at least
MANY_MIN_KEYS keys (large batches, long caches): one program per SM with two 128-key K/V stages in flight (128 KB
of shared memory at D=128; used only where the GPU has it, ``_fits``). It paid from 16k keys per program on every
machine tried, and lost or did not help at 1k-4k."""
DECODE_CFG_MANY_SOFTMAX = {"BN": 128, "num_warps": 8, "num_stages": 3}
"""The same for softmax (no probe): 192 KB at D=128."""
MANY_MIN_KEYS = 16384


def _fits(cfg: dict, D: int, device: torch.device) -> bool:
    """Whether the split kernel's K/V stages (num_stages × BN × D × 2 tensors × 2 bytes, plus 16 KB) fit in one
    program's shared memory on ``device`` (always on CPU, where the interpreter runs)."""
    need = cfg["num_stages"] * cfg["BN"] * D * 4 + 16 * 1024
    return device.type != "cuda" or need <= _props(device.index or 0).shared_memory_per_block_optin


def decode_cfg(keys_per_program: int, programs: int, device: torch.device, D: int = 128, probe: bool = True) -> dict:
    """The decode tile for a grid of ``programs`` programs that each stream ``keys_per_program`` cache keys."""
    if programs <= LONG_MAX_PROGRAMS_PER_SM * _n_sm(device):
        return DECODE_CFG_LONG if keys_per_program >= LONG_MIN_KEYS else DECODE_CFG
    many = DECODE_CFG_MANY if probe else DECODE_CFG_MANY_SOFTMAX
    return many if keys_per_program >= MANY_MIN_KEYS and _fits(many, D, device) else DECODE_CFG


MIN_KEYS_PER_SPLIT = 64
"""Fewest cache keys per split: fewer splits of tiny caches cost more in merging than they save; 32 was slower."""
WAVES = 1
DECODE_MERGES = ("fused", "kernel")
DECODE_MERGE = os.environ.get("PARALLAX_DECODE_MERGE", "kernel")
"""How decode merges its KV splits: "kernel" (a second merge launch; default) or "fused" (the last split program
of a row merges, one launch). Fused is slower at small batches (the last arriver's serial merge outlasts a launch)
and equal at large ones, so it is not the default. Env ``PARALLAX_DECODE_MERGE``;
``parallax_decode_triton(merge=...)``."""

MERGE_CFG = {"BD": 64, "num_warps": 1}
"""The two-launch merge: channels per program (grid rows × D/BD) and warps; narrow, one-warp programs merged
fastest."""


def merge_grid(rows: int, D: int) -> tuple[int, int]:
    """Grid of the two-launch merge kernel: (output rows B·TQ·HQ, channel blocks D / BD)."""
    return rows, D // min(D, MERGE_CFG["BD"])


DECODE_PDL = os.environ.get("PARALLAX_DECODE_PDL", "1") == "1"
"""Two-launch merge with a small merge grid (fewer programs than a quarter of the SMs): launch the merge kernel as
a programmatic dependent of the split kernel (Hopper and newer; CUDA-graph capturable), which lets it launch as the
split kernel starts and wait for its partials on the GPU. It saves a launch gap on small merge grids and cost time
on larger ones, hence the grid limit. Env ``PARALLAX_DECODE_PDL``."""


def _pdl(device: torch.device, merge_programs: int) -> bool:
    if not DECODE_PDL or INTERPRET or device.type != "cuda":
        return False
    props = _props(device.index or 0)
    return props.major >= 9 and 4 * merge_programs < props.multi_processor_count


MERGE_TILE = 4096
"""fp32 elements of one [splits, rows, D] partial tile the fused merge loads at once (64 KB per O tile)."""

_COUNTERS: dict[tuple[str, int], Tensor] = {}


def decode_counters(device: torch.device, n: int) -> Tensor:
    """The fused merge's int32 arrival counters for ``device`` (≥ n entries, all zero between calls).

    One buffer per device, allocated once (zeros) and grown only when a call needs more rows; every call
    leaves it zeroed, so replays of a captured CUDA graph need no memset. Calls on one device must not run
    concurrently on different streams (they would share counters).
    """
    key = (device.type, device.index or 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(1024, triton.next_power_of_2(n)), device=device, dtype=torch.int32)
        _COUNTERS[key] = buf
    return buf


@functools.lru_cache(maxsize=None)
def _props(device_index: int):
    """The CUDA device's properties (compute capability, SMs, shared memory per program), read once."""
    return torch.cuda.get_device_properties(device_index)


def _n_sm(device: torch.device) -> int:
    """SMs of a CUDA device; 4 stands in on CPU (the interpreter), so the split and tile rules still branch."""
    return _props(device.index or 0).multi_processor_count if device.type == "cuda" else 4


def decode_splits(batch: int, n_kv_heads: int, cache_len: int, device: torch.device) -> int:
    """Power-of-two KV split count from static shapes only: about WAVES waves of programs, ≥ MIN_KEYS_PER_SPLIT
    keys each."""
    n_sm = _n_sm(device)
    s = 1
    while 2 * s * MIN_KEYS_PER_SPLIT <= cache_len and batch * n_kv_heads * s < WAVES * n_sm:
        s *= 2
    return s


def _decode_fake(q, k_cache, v_cache, cache_seqlens, r, scale, window_size, num_splits, fused_merge=True):
    return torch.empty_like(q)


@attnlab_op("parallax_decode", _decode_fake)
def parallax_decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, r: Optional[Tensor],
                       scale: float, window_size: int, num_splits: int, fused_merge: bool = True) -> Tensor:
    B, TQ, HQ, D = q.shape
    LMAX, HKV = k_cache.shape[1], k_cache.shape[2]
    probe = r is not None
    S = num_splits
    keys = triton.cdiv(LMAX, S)
    cfg = decode_cfg(keys, S * B * HKV, q.device, D, probe)
    BN = cfg["BN"]
    chunk = triton.cdiv(keys, BN) * BN
    W = window_size if 0 < window_size < LMAX else 0
    o = empty_like(q)
    BR = max(16, triton.next_power_of_2((HQ // HKV) * TQ))
    if S > 1:
        nrows = B * TQ * HQ
        pm = empty(S, nrows, device=q.device, dtype=torch.float32)
        pd1 = empty_like(pm)
        po1 = empty(S, nrows, D, device=q.device, dtype=torch.float32)
        pd2, po2 = (empty_like(pm), empty_like(po1)) if probe else (pm, po1)
    else:
        pm = pd1 = pd2 = po1 = po2 = o
    fused = S > 1 and fused_merge
    RR = max(2, triton.next_power_of_2((HQ // HKV) * TQ))  # rows of the fused merge
    SC = min(triton.next_power_of_2(S), max(1, MERGE_TILE // (RR * D)))  # splits it loads at once
    cnt = decode_counters(q.device, B * HKV) if fused else cache_seqlens
    grid_m = merge_grid(B * TQ * HQ, D)
    pdl = S > 1 and not fused and _pdl(q.device, grid_m[0] * grid_m[1])
    _parallax_decode_kernel[(S, B * HKV)](
        q, r if probe else q, k_cache, v_cache, cache_seqlens, o, pm, pd1, pd2, po1, po2, cnt, scale * LOG2E, W,
        chunk, B, LMAX, TQ=TQ, HQ=HQ, HKV=HKV, D=D, BR=BR, BN=BN, HAS_PROBE=probe, WINDOW=W > 0, SPLIT=S > 1,
        FUSED_MERGE=fused, RR=RR, SC=SC, LONG_OFF=(LMAX + BN) * HKV * D >= 2**31, DOT_PREC=_dot_prec(q.dtype),
        PDL=pdl, num_warps=1 if INTERPRET else cfg["num_warps"], num_stages=1 if INTERPRET else cfg["num_stages"])
    if S > 1 and not fused:
        _parallax_decode_merge_kernel[grid_m](
            o, pm, pd1, pd2, po1, po2, B * TQ * HQ, S=S, BS=triton.next_power_of_2(S), D=D, HAS_PROBE=probe,
            PDL=pdl, BD=D // grid_m[1], num_warps=1 if INTERPRET else MERGE_CFG["num_warps"],
            **({"launch_pdl": True} if pdl else {}))
    return o
