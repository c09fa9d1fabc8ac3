"""Chunked causal scalar-gated linear attention in Triton: the ``triton`` path of
:func:`attention.ops.linear_attn.gated_linear_attention` (gated_linear, linear, HLA, CALA).

    o_t = Σ_{s≤t, same document} b(s,t) (q_t·k_s) v_s,   b(s,t) = exp(g_{s+1} + ... + g_t)

Chunk form (GLA / Lightning / RetNet style; docs/kernels.md, "Scalar-gated linear attention"): with local
log-cumsum ℓ of the gates inside a chunk of BT tokens, state h_n [K, V] before chunk n,

    o_c  = diag(β) Q_c h_n + (D ⊙ tril(Q_c K_cᵀ)) V_c,    D_τσ = exp(ℓ_τ − ℓ_σ),  β_τ = exp(ℓ_τ)
    h_n+1 = β_W h_n + (diag(e) K_c)ᵀ V_c,                 e_σ = exp(ℓ_W − ℓ_σ)

Kernels (fla's ``chunk_simple_gla`` layout, written from scratch for this project):
``_state_kernel`` (sequential over chunks, one program per (K-tile, V-tile, batch·head), stores h_n; with
REVERSE the adjoint's states dh_n), ``_fwd_o`` (parallel over chunks), backward ``_bwd_dqk``,
``_bwd_dv``. States are recomputed in backward, never saved. Packed documents: a document id per token;
cross-document pairs are masked and carried state is dropped at a document start (chunks may straddle
documents). The gate gradient uses dG_t = q_t·dq_t − k_t·dk_t, dg = reverse cumsum(dG).
Accumulation in fp32; inputs fp32/bf16/fp16. No initial/final state (prefill and decode use the PyTorch chunk
form, ``attention.ops.linear_attn.chunk.chunk_gla``, which is also the kernel's test reference).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from attnlab.attention.ops.common import document_ids
from attnlab.attention.ops.custom_ops import fake_attention_out, opaque_op
from attnlab.attention.ops.linear_attn import TRITON_CHUNK_SIZES
from attnlab.attention.ops.outputs import empty

Tensor = torch.Tensor


@triton.jit
def _ptrs(base, R, C, sr, sc, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """Pointers and in-bounds mask of the [BR, BC] tile at (r0, c0) of an R x C matrix with strides (sr, sc)."""
    o_r = r0 + tl.arange(0, BR)
    o_c = c0 + tl.arange(0, BC)
    return base + o_r[:, None] * sr + o_c[None, :] * sc, (o_r[:, None] < R) & (o_c[None, :] < C)


@triton.jit
def _load(base, R, C, sr, sc, r0, c0, BR: tl.constexpr, BC: tl.constexpr):
    """The [BR, BC] tile at (r0, c0) of an R x C matrix with strides (sr, sc), zero outside it."""
    p, ok = _ptrs(base, R, C, sr, sc, r0, c0, BR, BC)
    return tl.load(p, mask=ok, other=0.0)


@triton.jit
def _store(base, R, C, sr, sc, r0, c0, BR: tl.constexpr, BC: tl.constexpr, val):
    """Store ``val`` (cast to the buffer's dtype) into the [BR, BC] tile at (r0, c0), inside the matrix only."""
    p, ok = _ptrs(base, R, C, sr, sc, r0, c0, BR, BC)
    tl.store(p, val.to(p.dtype.element_ty), mask=ok)


@triton.jit
def _chunk_meta(ell, doc, i_b, i_h, i_t, T, H: tl.constexpr, BT: tl.constexpr, HAS_DOC: tl.constexpr):
    """Per-chunk gate and document data: ℓ [BT], ℓ_W, carry mask [BT], contributes-to-state mask [BT],
    carry of the state across the chunk (scalar), same-document pair mask [BT, BT] (causal included)."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_l = tl.load(ell + (i_b * T + o_t) * H + i_h, mask=m_t, other=0.0)
    last = tl.minimum(i_t * BT + BT, T) - 1
    b_lw = tl.load(ell + (i_b * T + last) * H + i_h)
    causal = o_t[:, None] >= o_t[None, :]
    if HAS_DOC:
        b_d = tl.load(doc + i_b * T + o_t, mask=m_t, other=-1)
        d_prev = tl.load(doc + i_b * T + tl.maximum(i_t * BT - 1, 0))
        d_last = tl.load(doc + i_b * T + last)
        m_carry = b_d == d_prev
        m_last = b_d == d_last
        carry_w = d_last == d_prev
        pair = causal & (b_d[:, None] == b_d[None, :]) & m_t[:, None] & m_t[None, :]
    else:
        m_carry = m_t
        m_last = m_t
        carry_w = last >= 0
        pair = causal & m_t[:, None] & m_t[None, :]
    return b_l, b_lw, m_carry & m_t, m_last & m_t, carry_w, pair


@triton.jit
def _state_kernel(x, y, ell, doc, s, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, HAS_DOC: tl.constexpr, PREC: tl.constexpr,
                  REVERSE: tl.constexpr):
    """The per-chunk states, sequential over chunks, stored before each chunk is added.
    Forward (x, y) = (k, v): h[n] = state before chunk n, h[n+1] = β_W(n) h[n] + (diag(e) K_n)ᵀ V_n.
    REVERSE (x, y) = (q, dO): dh[n] = gradient w.r.t. the state after chunk n, dh[NT-1] = 0,
    dh[n-1] = β_W(n) dh[n] + (diag(β) Q_n)ᵀ dO_n."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(NT):
        if REVERSE:
            i_t = NT - 1 - i
        else:
            i_t = i
        _store(s + (i_bh * NT + i_t) * K * V, K, V, V, 1, i_k * BK, i_v * BV, BK, BV, b_s)
        b_l, b_lw, m_carry, m_last, carry_w, pair = _chunk_meta(ell, doc, i_b, i_h, i_t, T, H, BT, HAS_DOC)
        b_x = _load(x + (i_b * T * H + i_h) * K, K, T, 1, H * K, i_k * BK, i_t * BT, BK, BT)
        b_y = _load(y + (i_b * T * H + i_h) * V, T, V, H * V, 1, i_t * BT, i_v * BV, BT, BV)
        if REVERSE:
            b_w = tl.where(m_carry, tl.exp(b_l), 0.0)
        else:
            b_w = tl.where(m_last, tl.exp(b_lw - b_l), 0.0)
        b_s = b_s * tl.where(carry_w, tl.exp(b_lw), 0.0)
        b_s += tl.dot(b_x, (b_y * b_w[:, None]).to(b_x.dtype), input_precision=PREC)


@triton.jit
def _fwd_o_kernel(q, k, v, ell, doc, h, o, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DOC: tl.constexpr, PREC: tl.constexpr):
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        b_q = _load(q + (i_b * T * H + i_h) * K, T, K, H * K, 1, i_t * BT, i_k * BK, BT, BK)
        b_k = _load(k + (i_b * T * H + i_h) * K, K, T, 1, H * K, i_k * BK, i_t * BT, BK, BT)
        b_h = _load(h + (i_bh * NT + i_t) * K * V, K, V, V, 1, i_k * BK, i_v * BV, BK, BV)
        b_o += tl.dot(b_q, b_h.to(b_q.dtype), input_precision=PREC)
        b_A += tl.dot(b_q, b_k, input_precision=PREC)
    b_l, b_lw, m_carry, m_last, carry_w, pair = _chunk_meta(ell, doc, i_b, i_h, i_t, T, H, BT, HAS_DOC)
    b_beta = tl.where(m_carry, tl.exp(b_l), 0.0)
    b_A = b_A * tl.exp(tl.where(pair, b_l[:, None] - b_l[None, :], float("-inf")))
    b_v = _load(v + (i_b * T * H + i_h) * V, T, V, H * V, 1, i_t * BT, i_v * BV, BT, BV)
    b_o = b_o * b_beta[:, None] + tl.dot(b_A.to(b_v.dtype), b_v, input_precision=PREC)
    _store(o + (i_b * T * H + i_h) * V, T, V, H * V, 1, i_t * BT, i_v * BV, BT, BV, b_o)


@triton.jit
def _bwd_dqk_kernel(q, k, v, ell, doc, h, do, dh, dq, dk, dG, T, NT, H: tl.constexpr, K: tl.constexpr,
                    V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DOC: tl.constexpr,
                    PREC: tl.constexpr):
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        # vᵀ [BV, BT], dO [BT, BV], hᵀ and dhᵀ [BV, BK]
        b_vt = _load(v + (i_b * T * H + i_h) * V, V, T, 1, H * V, i_v * BV, i_t * BT, BV, BT)
        b_do = _load(do + (i_b * T * H + i_h) * V, T, V, H * V, 1, i_t * BT, i_v * BV, BT, BV)
        b_ht = _load(h + (i_bh * NT + i_t) * K * V, V, K, 1, V, i_v * BV, i_k * BK, BV, BK).to(b_do.dtype)
        b_dht = _load(dh + (i_bh * NT + i_t) * K * V, V, K, 1, V, i_v * BV, i_k * BK, BV, BK).to(b_do.dtype)
        b_ds += tl.dot(b_do, b_vt, input_precision=PREC)
        b_dq += tl.dot(b_do, b_ht, input_precision=PREC)
        b_dk += tl.dot(tl.trans(b_vt), b_dht, input_precision=PREC)
    b_l, b_lw, m_carry, m_last, carry_w, pair = _chunk_meta(ell, doc, i_b, i_h, i_t, T, H, BT, HAS_DOC)
    b_ds = b_ds * tl.exp(tl.where(pair, b_l[:, None] - b_l[None, :], float("-inf")))
    b_q = _load(q + (i_b * T * H + i_h) * K, T, K, H * K, 1, i_t * BT, i_k * BK, BT, BK)
    b_k = _load(k + (i_b * T * H + i_h) * K, T, K, H * K, 1, i_t * BT, i_k * BK, BT, BK)
    b_beta = tl.where(m_carry, tl.exp(b_l), 0.0)
    b_e = tl.where(m_last, tl.exp(b_lw - b_l), 0.0)
    b_dq = b_dq * b_beta[:, None] + tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)
    b_dk = b_dk * b_e[:, None] + tl.dot(tl.trans(b_ds).to(b_q.dtype), b_q, input_precision=PREC)
    b_dG = tl.sum(b_q.to(tl.float32) * b_dq - b_k.to(tl.float32) * b_dk, axis=1)
    _store(dq + (i_b * T * H + i_h) * K, T, K, H * K, 1, i_t * BT, i_k * BK, BT, BK, b_dq)
    _store(dk + (i_b * T * H + i_h) * K, T, K, H * K, 1, i_t * BT, i_k * BK, BT, BK, b_dk)
    o_t = i_t * BT + tl.arange(0, BT)
    B = tl.num_programs(2) // H
    tl.store(dG + ((i_k * B + i_b) * T + o_t) * H + i_h, b_dG, mask=o_t < T)  # dG: [NK, B, T, H]


@triton.jit
def _bwd_dv_kernel(q, k, ell, doc, do, dh, dv, T, NT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DOC: tl.constexpr, PREC: tl.constexpr):
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    b_At = tl.zeros([BT, BT], dtype=tl.float32)  # [σ, τ] = k_σ·q_τ
    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        b_k = _load(k + (i_b * T * H + i_h) * K, T, K, H * K, 1, i_t * BT, i_k * BK, BT, BK)
        b_qt = _load(q + (i_b * T * H + i_h) * K, K, T, 1, H * K, i_k * BK, i_t * BT, BK, BT)
        b_dh = _load(dh + (i_bh * NT + i_t) * K * V, K, V, V, 1, i_k * BK, i_v * BV, BK, BV)
        b_At += tl.dot(b_k, b_qt, input_precision=PREC)
        b_dv += tl.dot(b_k, b_dh.to(b_k.dtype), input_precision=PREC)
    b_l, b_lw, m_carry, m_last, carry_w, pair = _chunk_meta(ell, doc, i_b, i_h, i_t, T, H, BT, HAS_DOC)
    b_At = b_At * tl.exp(tl.where(tl.trans(pair), b_l[None, :] - b_l[:, None], float("-inf")))
    b_e = tl.where(m_last, tl.exp(b_lw - b_l), 0.0)
    b_do = _load(do + (i_b * T * H + i_h) * V, T, V, H * V, 1, i_t * BT, i_v * BV, BT, BV)
    b_dv = b_dv * b_e[:, None] + tl.dot(b_At.to(b_do.dtype), b_do, input_precision=PREC)
    _store(dv + (i_b * T * H + i_h) * V, T, V, H * V, 1, i_t * BT, i_v * BV, BT, BV, b_dv)


def _local_cumsum(g: torch.Tensor, BT: int) -> torch.Tensor:
    """g: [B, T, H] -> fp32 cumsum restarted every BT tokens."""
    B, T, H = g.shape
    NT = triton.cdiv(T, BT)
    gp = torch.nn.functional.pad(g.float(), (0, 0, 0, NT * BT - T))
    return gp.view(B, NT, BT, H).cumsum(2).view(B, NT * BT, H)[:, :T].contiguous()


def _blocks(K: int, V: int):
    """(BK, BV), always equal. With BK != BV and 16-bit inputs the kernels returned wrong values on an H100
    (Triton 3.6; relative error 1.3-4.1 at K/V = 16/17, 16/32, 16/64, 64/17, bf16 and fp16), and CALA's fullgraph
    GPU test at K/V = 16/17 faulted with an illegal address in ``_bwd_dqk_kernel``. fp32, the interpreter and every
    equal pair tried (16, 32, 64) were right; which kernel miscompiles was not isolated."""
    B = min(64, max(16, triton.next_power_of_2(max(K, V))))
    return B, B


def _prec(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _states(x, y, ell, doc, BT, reverse):
    """h (forward, x=k, y=v) or dh (reverse, x=q, y=do): [B*H, NT, K, V] fp32."""
    B, T, H, K = x.shape
    V = y.shape[-1]
    NT = triton.cdiv(T, BT)
    BK, BV = _blocks(K, V)
    out = empty(B * H, NT, K, V, device=x.device, dtype=torch.float32)
    _state_kernel[(triton.cdiv(K, BK), triton.cdiv(V, BV), B * H)](
        x, y, ell, doc, out, T, NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_DOC=doc is not None, PREC=_prec(x),
        REVERSE=bool(reverse), num_warps=4, num_stages=2)
    return out


def gla_fwd(q, k, v, ell, doc, BT):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, BT)
    BK, BV = _blocks(K, V)
    h = _states(k, v, ell, doc, BT, reverse=False)
    o = empty(B, T, H, V, device=q.device, dtype=q.dtype)
    _fwd_o_kernel[(triton.cdiv(V, BV), NT, B * H)](
        q, k, v, ell, doc, h, o, T, NT, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_DOC=doc is not None, PREC=_prec(q),
        num_warps=4, num_stages=2)
    return o


def gla_bwd(q, k, v, ell, doc, do, BT):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, BT)
    BK, BV = _blocks(K, V)
    h = _states(k, v, ell, doc, BT, reverse=False)
    dh = _states(q, do, ell, doc, BT, reverse=True)
    dq, dk, dv = (empty(*x.shape, device=x.device, dtype=x.dtype) for x in (q, k, v))
    NK = triton.cdiv(K, BK)
    dG = empty(NK, B, T, H, device=q.device, dtype=torch.float32)
    meta = dict(H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_DOC=doc is not None, PREC=_prec(q), num_warps=4, num_stages=2)
    _bwd_dqk_kernel[(NK, NT, B * H)](q, k, v, ell, doc, h, do, dh, dq, dk, dG, T, NT, **meta)
    _bwd_dv_kernel[(triton.cdiv(V, BV), NT, B * H)](q, k, ell, doc, do, dh, dv, T, NT, **meta)
    dg = dG.sum(0).flip(1).cumsum(1).flip(1)  # dg_s = Σ_{t≥s} dG_t
    return dq, dk, dv, dg


class _GLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, doc, BT):
        B, T, H, _ = q.shape
        ell = torch.zeros(B, T, H, device=q.device, dtype=torch.float32) if g is None else _local_cumsum(g, BT)
        o = gla_fwd(q, k, v, ell, doc, BT)
        ctx.save_for_backward(q, k, v, ell, doc)
        ctx.BT, ctx.has_g, ctx.g_dtype = BT, g is not None, None if g is None else g.dtype
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, ell, doc = ctx.saved_tensors
        dq, dk, dv, dg = gla_bwd(q, k, v, ell, doc, do.contiguous(), ctx.BT)
        return dq, dk, dv, (dg.to(ctx.g_dtype) if ctx.has_g else None), None, None


def _gla_eager(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], doc: Optional[Tensor], chunk_size: int) -> Tensor:
    return _GLAFunction.apply(q, k, v, g, doc, chunk_size).contiguous()


# Triton launches inside an autograd.Function: an opaque op inside compiled models (backward recomputes the forward)
_gla_op = opaque_op("gla_triton", _gla_eager, fake_attention_out)


def gla_triton(q, k, v, g=None, *, cu_seqlens=None, chunk_size=64):
    """Triton chunked scalar-gated linear attention without scaling (scale q first) and without initial or final
    state (prefill and decode take the chunk path of :func:`attention.ops.linear_attn.gated_linear_attention`).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log decay (<= 0) or None; cu_seqlens: [N+1] document offsets
    over the flattened B*T tokens (each row boundary a document boundary) or None. Returns o [B, T, H, V]."""
    if chunk_size not in TRITON_CHUNK_SIZES:
        raise ValueError(f"attention chunk_size={chunk_size} must be one of {list(TRITON_CHUNK_SIZES)} for the "
                         "Triton path")
    q, k, v = q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()  # one dtype for tl.dot
    doc = None
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, q.shape[0], q.shape[1]).to(torch.int32).contiguous()
    return _gla_op(q, k, v, g, doc, int(chunk_size))
