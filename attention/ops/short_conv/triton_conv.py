"""The short convolution in Triton: one forward kernel and one backward kernel (dx and dweight), as custom ops.

    pre_t = Σ_{j<K} w[:, K-1-j] · x_{t-j}  (x_{t-j} = 0 before the token's document or row start),  y_t = act(pre_t)

(:func:`attention.ops.short_conv.naive.naive_short_conv` is the oracle; docs/kernels.md, "The short convolution").

- ``_fwd_kernel``: one program per (BT x BC tile, batch row); K shifted loads of x (the K-1 rows above a tile come
  from the cache), fp32 accumulation, SiLU fused, y in x's dtype.
- ``_bwd_kernel``: one program per (BC channels, TS rows, batch row), walking its rows in BT tiles. The
  pre-activation is recomputed (never saved): dpre_s = dy_s · silu'(pre_s) at the K rows s = t..t+K-1 that read a
  row t, and ``dx_t = Σ_j w[:, K-1-j] · dpre_{t+j}`` over the lags j that row t+j may read. dweight is reduced
  deterministically: each program sums ``dpre_t · x_{t-j}`` over its rows into its own fp32 partial
  [K, C] slice, and the [B · n_splits, K, C] partials are summed by torch afterwards.
- Documents (``cu_seqlens``, fla varlen over the flattened ``B*T`` tokens): each row's document start comes from a
  vectorised binary search over ``cu_seqlens`` inside the kernels (no per-token tensor is built); lag j of token t
  is read only if ``t - j`` is at or after that start (and the row's start).

Tensors: x [B, T, C] (made contiguous), weight [C, K] with K <= 8 (a constexpr), cu_seqlens [N + 1] int32 or None.
dx comes back in x's dtype, dweight in weight's. ``attnlab::short_conv_fwd`` / ``attnlab::short_conv_bwd`` are the
torch.library pair a compiled block calls without a graph break; the forward saves x and weight only.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attention.ops.autotune import candidates
from attention.ops.outputs import empty

Tensor = torch.Tensor

MAX_K = 8
ROWS_PER_PROGRAM = 256
"""Rows (TS) one backward program walks: its dweight partial is one [K, BC] slice, so the partials hold
``B * cdiv(T, TS) * K * C`` floats whatever the tile."""


def _configs(spec) -> list:
    return candidates([triton.Config({"BT": bt, "BC": bc}, num_warps=w) for bt, bc, w in spec])


@triton.jit
def _first_readable(cu, i_b, o_t, T, n_iter, N, HAS_CU: tl.constexpr):
    """[BT] first row (in row coordinates) that each row o_t may read: its document's start, or 0 (row start).
    Without documents 0. The document comes from a binary search for the last ``cu[idx] <= token`` over
    cu[0..N] (``n_iter`` = bit length of N steps)."""
    first = tl.zeros_like(o_t)
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
    return first


@triton.jit
def _fwd_kernel(x, w, cu, y, T, C, n_iter, N, K: tl.constexpr, ACT: tl.constexpr, HAS_CU: tl.constexpr,
                BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t, m_c = o_t < T, o_c < C
    first = _first_readable(cu, i_b, o_t, T, n_iter, N, HAS_CU)
    row0 = i_b.to(tl.int64) * T * C
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        b_w = tl.load(w + o_c * K + (K - 1 - j), mask=m_c, other=0.0).to(tl.float32)
        r = o_t - j
        m = (r >= first) & m_t
        b_x = tl.load(x + row0 + r[:, None] * C + o_c[None, :], mask=m[:, None] & m_c[None, :], other=0.0)
        acc += b_x.to(tl.float32) * b_w[None, :]
    if ACT:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + row0 + o_t[:, None] * C + o_c[None, :], acc.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def _bwd_kernel(x, w, cu, dy, dx, dwp, T, C, TS, NS, n_iter, N, K: tl.constexpr, KP: tl.constexpr,
                ACT: tl.constexpr, HAS_CU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_c, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_k = tl.arange(0, KP)
    row0 = i_b.to(tl.int64) * T * C
    b_dw = tl.zeros([KP, BC], dtype=tl.float32)  # row K-1-i: Σ_t dpre_t · x_{t-i} (weight column K-1-i)
    t_begin = i_s * TS
    t_end = tl.minimum(t_begin + TS, T)
    for t0 in range(t_begin, t_end, BT):
        o_t = t0 + tl.arange(0, BT)
        m_own = o_t < t_end
        b_dx = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):
            # row s = t + j reads row t at lag j: recompute its pre-activation and dpre
            s = o_t + j
            m_s = s < T
            first = _first_readable(cu, i_b, s, T, n_iter, N, HAS_CU)
            pre = tl.zeros([BT, BC], dtype=tl.float32)
            for i in tl.static_range(K):
                w_i = tl.load(w + o_c * K + (K - 1 - i), mask=m_c, other=0.0).to(tl.float32)
                r = s - i
                m = (r >= first) & m_s
                b_x = tl.load(x + row0 + r[:, None] * C + o_c[None, :], mask=m[:, None] & m_c[None, :], other=0.0)
                pre += b_x.to(tl.float32) * w_i[None, :]
            b_dy = tl.load(dy + row0 + s[:, None] * C + o_c[None, :], mask=m_s[:, None] & m_c[None, :],
                           other=0.0).to(tl.float32)
            if ACT:
                sig = tl.sigmoid(pre)
                dpre = b_dy * sig * (1.0 + pre * (1.0 - sig))
            else:
                dpre = b_dy
            w_j = tl.load(w + o_c * K + (K - 1 - j), mask=m_c, other=0.0).to(tl.float32)
            m_j = (o_t >= first) & m_s
            b_dx += tl.where(m_j[:, None], dpre, 0.0) * w_j[None, :]
            if j == 0:  # the tile's own rows: dweight over the rows this program owns
                dpre = tl.where(m_own[:, None], dpre, 0.0)
                for i in tl.static_range(K):
                    r = o_t - i
                    m = (r >= first) & m_own
                    b_x = tl.load(x + row0 + r[:, None] * C + o_c[None, :], mask=m[:, None] & m_c[None, :],
                                  other=0.0)
                    part = tl.sum(dpre * b_x.to(tl.float32), axis=0)  # [BC]
                    b_dw += tl.where(o_k[:, None] == K - 1 - i, part[None, :], 0.0)
        tl.store(dx + row0 + o_t[:, None] * C + o_c[None, :], b_dx.to(dx.dtype.element_ty),
                 mask=m_own[:, None] & m_c[None, :])
    p = dwp + (i_b.to(tl.int64) * NS + i_s) * K * C
    tl.store(p + o_k[:, None] * C + o_c[None, :], b_dw, mask=(o_k[:, None] < K) & m_c[None, :])


# (BT, BC, num_warps) candidates; the first is the one ATTNLAB_AUTOTUNE=first (tests) runs
FWD_SPEC = [(64, 128, 4), (32, 256, 4), (128, 128, 8)]
BWD_SPEC = [(32, 128, 4), (64, 64, 4), (32, 256, 8)]
_fwd_tuned = triton.autotune(configs=_configs(FWD_SPEC), key=["C", "K", "ACT", "HAS_CU"])(_fwd_kernel)
_bwd_tuned = triton.autotune(configs=_configs(BWD_SPEC), key=["C", "K", "ACT", "HAS_CU"])(_bwd_kernel)


def _check(x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor]) -> None:
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"short_conv: x {tuple(x.shape)} must be [B, T, C] and weight {tuple(weight.shape)} [C, K]")
    if not 1 <= weight.shape[1] <= MAX_K:
        raise ValueError(f"short_conv: kernel size {weight.shape[1]} must be in [1, {MAX_K}]")
    if cu_seqlens is not None and cu_seqlens.dtype != torch.int32:
        raise ValueError(f"short_conv: cu_seqlens must be int32, got {cu_seqlens.dtype}")


def _doc_args(x: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[Tensor, int, int]:
    """(cu pointer or a stand-in, binary-search steps, N documents)."""
    if cu_seqlens is None:
        return x, 0, 0
    n = cu_seqlens.shape[0] - 1
    return cu_seqlens, max(n, 1).bit_length(), n


def _device(x: Tensor):
    import contextlib

    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def conv_fwd(x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor], activation: bool,
             config: Optional[tuple[int, int, int]] = None) -> Tensor:
    """y [B, T, C] in x's dtype. ``config`` = (BT, BC, num_warps) pins a tile (tests); None autotunes."""
    _check(x, weight, cu_seqlens)
    x, weight = x.contiguous(), weight.contiguous()
    B, T, C = x.shape
    K = weight.shape[1]
    y = empty(B, T, C, device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    cu, n_iter, N = _doc_args(x, cu_seqlens)
    args = (x, weight, cu, y, T, C, n_iter, N)
    meta = dict(K=K, ACT=activation, HAS_CU=cu_seqlens is not None)
    with _device(x):
        if config is None:
            _fwd_tuned[lambda m: (triton.cdiv(T, m["BT"]), triton.cdiv(C, m["BC"]), B)](*args, **meta)
        else:
            bt, bc, nw = config
            _fwd_kernel[(triton.cdiv(T, bt), triton.cdiv(C, bc), B)](*args, **meta, BT=bt, BC=bc, num_warps=nw)
    return y


def conv_bwd(dy: Tensor, x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor], activation: bool,
             config: Optional[tuple[int, int, int]] = None, rows_per_program: int = ROWS_PER_PROGRAM
             ) -> tuple[Tensor, Tensor]:
    """(dx [B, T, C] in x's dtype, dweight [C, K] in weight's dtype). The pre-activation is recomputed from x."""
    _check(x, weight, cu_seqlens)
    x, weight, dy = x.contiguous(), weight.contiguous(), dy.contiguous()
    B, T, C = x.shape
    K = weight.shape[1]
    dx = empty(B, T, C, device=x.device, dtype=x.dtype)
    if dx.numel() == 0:
        return dx, torch.zeros_like(weight)
    TS = min(rows_per_program, T)
    NS = triton.cdiv(T, TS)
    dwp = empty(B * NS, K, C, device=x.device, dtype=torch.float32)
    cu, n_iter, N = _doc_args(x, cu_seqlens)
    args = (x, weight, cu, dy, dx, dwp, T, C, TS, NS, n_iter, N)
    meta = dict(K=K, KP=triton.next_power_of_2(K), ACT=activation, HAS_CU=cu_seqlens is not None)
    with _device(x):
        if config is None:
            _bwd_tuned[lambda m: (triton.cdiv(C, m["BC"]), NS, B)](*args, **meta)
        else:
            bt, bc, nw = config
            _bwd_kernel[(triton.cdiv(C, bc), NS, B)](*args, **meta, BT=bt, BC=bc, num_warps=nw)
    dw = dwp.sum(0).t().to(weight.dtype).contiguous()  # [C, K]
    return dx, dw


# ---------------------------------------------------------------- custom ops (compiled blocks trace through them)
@torch.library.custom_op("attnlab::short_conv_fwd", mutates_args=())
def short_conv_fwd(x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor], activation: bool) -> Tensor:
    return conv_fwd(x, weight, cu_seqlens, activation)


@short_conv_fwd.register_fake
def _(x, weight, cu_seqlens, activation):
    return x.new_empty(x.shape)


@torch.library.custom_op("attnlab::short_conv_bwd", mutates_args=())
def short_conv_bwd(dy: Tensor, x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor],
                   activation: bool) -> tuple[Tensor, Tensor]:
    return conv_bwd(dy, x, weight, cu_seqlens, activation)


@short_conv_bwd.register_fake
def _(dy, x, weight, cu_seqlens, activation):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, cu_seqlens, activation = inputs
    ctx.save_for_backward(x, weight, cu_seqlens)
    ctx.activation = activation


def _backward(ctx, dy):
    x, weight, cu_seqlens = ctx.saved_tensors
    dx, dw = short_conv_bwd(dy, x, weight, cu_seqlens, ctx.activation)
    return dx, dw, None, None


short_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


def short_conv_triton(x: Tensor, weight: Tensor, cu_seqlens: Optional[Tensor] = None, activation: bool = True) -> Tensor:
    """y [B, T, C] = act(causal depthwise conv of x [B, T, C] with weight [C, K]) through ``attnlab::short_conv_fwd``."""
    return short_conv_fwd(x, weight, cu_seqlens, activation)
