"""The short convolution in Triton: a forward kernel and two backward kernels (dpre and dweight, then dx), as
custom ops.

    pre_t = Σ_{j<K} w[:, K-1-j] · x_{t-j}  (x_{t-j} = 0 before the token's document or row start),  y_t = act(pre_t)

(:func:`attention.ops.short_conv.naive.naive_short_conv` is the oracle; docs/kernels.md, "The short convolution").

- ``_fwd_kernel``: one program per (BT x BC tile, batch row); K shifted loads of x (the K-1 rows above a tile come
  from the cache), fp32 accumulation, SiLU fused, y in x's dtype.
- ``_bwd_dpre_kernel``: one program per (BC channels, TS rows, batch row), walking its rows in BT tiles: the
  pre-activation is recomputed (never saved), ``dpre_t = dy_t · silu'(pre_t)`` is written to a [B, T, C] buffer in
  x's dtype (half the bytes of fp32 for bf16 x, written here and read K times per tile by the dx kernel; eager
  autograd of the bf16 reference rounds this gradient to bf16 too), and ``Σ_t dpre_t · x_{t-j}`` over the
  program's rows, from the fp32 dpre before that rounding, goes into its own fp32 [K, C] slice of the
  [B · n_splits, K, C] dweight partials, which torch sums afterwards (deterministic). The K shifted x tiles are
  loaded twice per tile, for pre and then for the sum (the second time mostly from the cache): holding K tiles in
  registers between the two costs more occupancy than the reload.
- ``_bwd_dx_kernel``: the forward's tiling over dpre, fp32 accumulation: ``dx_t = Σ_j w[:, K-1-j] · dpre_{t+j}``
  over the lags j that row t+j may read. Two passes over memory, each with K shifted loads per tile, in place of
  recomputing dpre at the K rows that read each row (K² loads per tile).
- Documents (``cu_seqlens``, fla varlen over the flattened ``B*T`` tokens): each row's document start comes from a
  vectorised binary search over ``cu_seqlens`` inside the kernels (no per-token tensor is built); lag j of token t
  is read only if ``t - j`` is at or after that start (and the row's start).

Tensors: x [B, T, C] (made contiguous), weight [C, K] with K <= 8 (a constexpr), cu_seqlens [N + 1] int32 or None.
dx comes back in x's dtype, dweight in weight's. ``attnlab::short_conv_fwd`` / ``attnlab::short_conv_bwd`` are the
op pair a compiled block calls without a graph break (``torch.library.triton_op`` on a GPU, so inductor launches
the kernels itself; see the ops section below); the forward saves x and weight only.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from attnlab.attention.ops.autotune import candidates
from attnlab.attention.ops.common import cuda_device_of
from attnlab.attention.ops.custom_ops import attnlab_op
from attnlab.attention.ops.outputs import empty

Tensor = torch.Tensor

MAX_K = 8
ROWS_PER_PROGRAM = 256
"""Rows (TS) one backward program walks: its dweight partial is one [K, BC] slice, so the partials hold
``B * cdiv(T, TS) * K * C`` floats whatever the tile."""


def _configs(spec) -> list:
    return candidates([triton.Config({"BT": bt, "BC": bc}, num_warps=w) for bt, bc, w in spec])


@triton.jit
def _doc_span(cu, i_b, o_t, T, n_iter, N, HAS_CU: tl.constexpr):
    """([BT] first, [BT] end): the rows (in row coordinates) of the document that holds each row o_t, clipped to
    its batch row: row o_t reads rows >= first, and rows < end read it. Without documents (0, T). The document
    comes from a binary search for the last ``cu[idx] <= token`` over cu[0..N] in ``n_iter`` steps (at least the
    bit length of N; further steps leave the result unchanged)."""
    first = tl.zeros_like(o_t)
    end = tl.zeros_like(o_t) + T
    if HAS_CU:
        g = i_b * T + tl.minimum(o_t, T - 1)
        lo = tl.zeros_like(o_t)
        hi = tl.zeros_like(o_t) + N
        for _ in range(n_iter):
            mid = (lo + hi + 1) // 2
            le = tl.load(cu + mid) <= g
            lo = tl.where(le, mid, lo)
            hi = tl.where(le, hi, mid - 1)
        first = tl.maximum(tl.load(cu + lo) - i_b * T, 0)
        end = tl.minimum(tl.load(cu + tl.minimum(lo + 1, N)) - i_b * T, T)
    return first, end


@triton.jit
def _pre_activation(x, w, row0, o_t, o_c, first, m_t, m_c, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """[BT, BC] fp32 ``Σ_j w[:, K-1-j] · x_{t-j}`` for rows o_t and channels o_c of the batch row at ``row0``,
    reading a lag only where its row is at or after the row's ``first`` readable row."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        b_w = tl.load(w + o_c * K + (K - 1 - j), mask=m_c, other=0.0).to(tl.float32)
        r = o_t - j
        m = (r >= first) & m_t
        b_x = tl.load(x + row0 + r[:, None] * C + o_c[None, :], mask=m[:, None] & m_c[None, :], other=0.0)
        acc += b_x.to(tl.float32) * b_w[None, :]
    return acc


@triton.jit
def _fwd_kernel(x, w, cu, y, T, C, n_iter, N, K: tl.constexpr, ACT: tl.constexpr, HAS_CU: tl.constexpr,
                BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t, m_c = o_t < T, o_c < C
    first, _ = _doc_span(cu, i_b, o_t, T, n_iter, N, HAS_CU)
    row0 = i_b.to(tl.int64) * T * C
    acc = _pre_activation(x, w, row0, o_t, o_c, first, m_t, m_c, C, K, BT, BC)
    if ACT:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + row0 + o_t[:, None] * C + o_c[None, :], acc.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def _bwd_dpre_kernel(x, w, cu, dy, dpre, dwp, T, C, TS, NS, n_iter, N, K: tl.constexpr, KP: tl.constexpr,
                     ACT: tl.constexpr, HAS_CU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dpre = dy · act'(pre) [B, T, C] in x's dtype (pre recomputed), and this program's fp32 [K, BC] dweight
    partial ``Σ_t dpre_t · x_{t-j}`` over its TS rows, summed from dpre in fp32 before it is rounded for the store."""
    i_c, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_k = tl.arange(0, KP)
    row0 = i_b.to(tl.int64) * T * C
    b_dw = tl.zeros([KP, BC], dtype=tl.float32)  # row K-1-j: Σ_t dpre_t · x_{t-j} (weight column K-1-j)
    t_begin = i_s * TS
    t_end = tl.minimum(t_begin + TS, T)
    for t0 in range(t_begin, t_end, BT):
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < t_end
        first, _ = _doc_span(cu, i_b, o_t, T, n_iter, N, HAS_CU)
        b_dy = tl.load(dy + row0 + o_t[:, None] * C + o_c[None, :], mask=m_t[:, None] & m_c[None, :],
                       other=0.0).to(tl.float32)
        b_dp = b_dy
        if ACT:
            pre = _pre_activation(x, w, row0, o_t, o_c, first, m_t, m_c, C, K, BT, BC)
            sig = tl.sigmoid(pre)
            b_dp = b_dy * sig * (1.0 + pre * (1.0 - sig))
        tl.store(dpre + row0 + o_t[:, None] * C + o_c[None, :], b_dp.to(dpre.dtype.element_ty),
                 mask=m_t[:, None] & m_c[None, :])
        for j in tl.static_range(K):  # dpre before its rounding
            r = o_t - j
            m = (r >= first) & m_t
            b_x = tl.load(x + row0 + r[:, None] * C + o_c[None, :], mask=m[:, None] & m_c[None, :], other=0.0)
            part = tl.sum(b_dp * b_x.to(tl.float32), axis=0)  # [BC]
            b_dw += tl.where(o_k[:, None] == K - 1 - j, part[None, :], 0.0)
    p = dwp + (i_b.to(tl.int64) * NS + i_s) * K * C
    tl.store(p + o_k[:, None] * C + o_c[None, :], b_dw, mask=(o_k[:, None] < K) & m_c[None, :])


@triton.jit
def _bwd_dx_kernel(dpre, w, cu, dx, T, C, n_iter, N, K: tl.constexpr, HAS_CU: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr):
    """dx_t = Σ_j w[:, K-1-j] · dpre_{t+j} over the rows t+j in row t's document (one search per tile)."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t, m_c = o_t < T, o_c < C
    row0 = i_b.to(tl.int64) * T * C
    _, end = _doc_span(cu, i_b, o_t, T, n_iter, N, HAS_CU)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        s = o_t + j  # row s reads row t at lag j iff s is in row t's document (and batch row)
        m = (s < end) & m_t
        w_j = tl.load(w + o_c * K + (K - 1 - j), mask=m_c, other=0.0).to(tl.float32)
        b_dp = tl.load(dpre + row0 + s[:, None] * C + o_c[None, :], mask=m[:, None] & m_c[None, :], other=0.0)
        acc += b_dp.to(tl.float32) * w_j[None, :]
    tl.store(dx + row0 + o_t[:, None] * C + o_c[None, :], acc.to(dx.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


# (BT, BC, num_warps) candidates; the first is the one ATTNLAB_AUTOTUNE=first (tests) runs. The dx kernel has the
# forward's shape (K shifted loads per tile), so it tunes over the forward's tiles.
FWD_SPEC = [(64, 128, 4), (32, 256, 4), (128, 128, 8)]
DPRE_SPEC = [(32, 128, 4), (64, 64, 4), (32, 256, 8)]
_KEY = ["C", "K", "HAS_CU"]
_fwd_tuned = triton.autotune(configs=_configs(FWD_SPEC), key=_KEY + ["ACT"])(_fwd_kernel)
_dpre_tuned = triton.autotune(configs=_configs(DPRE_SPEC), key=_KEY + ["ACT"])(_bwd_dpre_kernel)
_dx_tuned = triton.autotune(configs=_configs(FWD_SPEC), key=_KEY)(_bwd_dx_kernel)


def _check(x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor]) -> None:
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"short_conv: x {tuple(x.shape)} must be [B, T, C] and weight {tuple(weight.shape)} [C, K]")
    if not 1 <= weight.shape[1] <= MAX_K:
        raise ValueError(f"short_conv: kernel size {weight.shape[1]} must be in [1, {MAX_K}]")
    if cu_seqlens is not None and cu_seqlens.dtype != torch.int32:
        raise ValueError(f"short_conv: cu_seqlens must be int32, got {cu_seqlens.dtype}")


def _doc_args(x: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[Tensor, int, int]:
    """(cu pointer or a stand-in, binary-search steps, N documents). The steps cover any N <= B*T (at most one
    document per token), so they depend on x's shape alone: a compiled graph, where N (the length of
    ``cu_seqlens``) changes from batch to batch, neither recompiles nor specialises on it."""
    if cu_seqlens is None:
        return x, 0, 0
    return cu_seqlens, (x.shape[0] * x.shape[1]).bit_length(), cu_seqlens.shape[0] - 1


def _tile_grid(T: int, C: int, B: int):
    """Grid of the row-tile kernels (forward, dx): (T tiles, C tiles, rows)."""
    return lambda m: (triton.cdiv(T, m["BT"]), triton.cdiv(C, m["BC"]), B)


def _launch(tuned, grid, args: tuple, meta: dict, config: Optional[tuple[int, int, int]]) -> None:
    """Autotuned launch, or with ``config`` = (BT, BC, num_warps) the bare kernel at that tile. ``wrap_triton``
    lets a compiled graph that calls the ops below launch the kernel from inductor's generated code; in eager it
    is the plain launch."""
    if config is None:
        wrap_triton(tuned)[grid](*args, **meta)
    else:
        bt, bc, nw = config
        wrap_triton(tuned.fn)[grid](*args, **meta, BT=bt, BC=bc, num_warps=nw)


def conv_fwd(x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor], activation: bool,
             config: Optional[tuple[int, int, int]] = None) -> Tensor:
    """y [B, T, C] in x's dtype. ``config`` = (BT, BC, num_warps) pins a tile (tests, sweeps); None autotunes."""
    _check(x, weight, cu_seqlens)
    x, weight = x.contiguous(), weight.contiguous()
    B, T, C = x.shape
    y = empty(B, T, C, device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    cu, n_iter, N = _doc_args(x, cu_seqlens)
    meta = dict(K=weight.shape[1], ACT=activation, HAS_CU=cu_seqlens is not None)
    with cuda_device_of(x):
        _launch(_fwd_tuned, _tile_grid(T, C, B), (x, weight, cu, y, T, C, n_iter, N), meta, config)
    return y


def conv_bwd(dy: Tensor, x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor], activation: bool,
             config: Optional[tuple[int, int, int]] = None, dx_config: Optional[tuple[int, int, int]] = None,
             rows_per_program: int = ROWS_PER_PROGRAM) -> tuple[Tensor, Tensor]:
    """(dx [B, T, C] in x's dtype, dweight [C, K] in weight's dtype), in two kernels: dpre = dy · act'(pre)
    [B, T, C] in x's dtype with the fp32 dweight partials (pre recomputed from x), then dx from dpre. ``config``
    pins the dpre kernel's tile and ``dx_config`` the dx kernel's (default: ``config``); None autotunes."""
    _check(x, weight, cu_seqlens)
    x, weight, dy = x.contiguous(), weight.contiguous(), dy.contiguous()
    B, T, C = x.shape
    K = weight.shape[1]
    dx = empty(B, T, C, device=x.device, dtype=x.dtype)
    if dx.numel() == 0:
        return dx, torch.zeros_like(weight)
    TS = min(rows_per_program, T)
    NS = triton.cdiv(T, TS)
    dpre = empty(B, T, C, device=x.device, dtype=x.dtype)
    dwp = empty(B * NS, K, C, device=x.device, dtype=torch.float32)
    cu, n_iter, N = _doc_args(x, cu_seqlens)
    has_cu = cu_seqlens is not None
    with cuda_device_of(x):
        _launch(_dpre_tuned, lambda m: (triton.cdiv(C, m["BC"]), NS, B),
                (x, weight, cu, dy, dpre, dwp, T, C, TS, NS, n_iter, N),
                dict(K=K, KP=triton.next_power_of_2(K), ACT=activation, HAS_CU=has_cu), config)
        _launch(_dx_tuned, _tile_grid(T, C, B), (dpre, weight, cu, dx, T, C, n_iter, N), dict(K=K, HAS_CU=has_cu),
                dx_config or config)
    dw = dwp.sum(0).t().to(weight.dtype).contiguous()  # [C, K]
    return dx, dw


# ---------------------------------------------------------------------------------------------------------- ops
# On a GPU the pair is a ``torch.library.triton_op``: a compiled graph traces into it and inductor launches the
# kernels from its generated code (no Python per call; a custom op's dispatch and launch cost per call is more than
# the forward kernel's GPU time). Under TRITON_INTERPRET=1 (the CPU tests) the same bodies are opaque custom ops.
@attnlab_op("short_conv_fwd", lambda x, weight, cu_seqlens, activation: x.new_empty(x.shape), triton=True)
def short_conv_fwd(x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor], activation: bool) -> Tensor:
    return conv_fwd(x, weight, cu_seqlens, activation)


@attnlab_op("short_conv_bwd",
            lambda dy, x, weight, cu_seqlens, activation: (x.new_empty(x.shape), weight.new_empty(weight.shape)),
            triton=True)
def short_conv_bwd(dy: Tensor, x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor],
                   activation: bool) -> tuple[Tensor, Tensor]:
    return conv_bwd(dy, x, weight, cu_seqlens, activation)


def _setup_context(ctx, inputs, output):
    x, weight, cu_seqlens, activation = inputs
    ctx.save_for_backward(x, weight, cu_seqlens)
    ctx.activation = activation


def _backward(ctx, dy):
    x, weight, cu_seqlens = ctx.saved_tensors
    dx, dw = short_conv_bwd(dy, x, weight, cu_seqlens, ctx.activation)
    return dx, dw, None, None


short_conv_fwd.register_autograd(_backward, setup_context=_setup_context)

