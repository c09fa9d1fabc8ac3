"""Gated linear attention family (plain, scalar gate, per-channel GLA gate): one public op.

``gated_linear_attention(q, k, v, g=None, gk=None, ..., impl=...)`` computes, per head,

    h_t = exp(g_t) · diag(exp(gk_t)) · h_{t-1} + k_t v_t^T,      o_t = h_t^T (scale · q_t)

(docs/mechanisms.md, "The linear family"; fla's layout ``h = S^T``). ``impl``:

- "reference": :func:`naive_recurrent_gla` (token loop, float64-capable, the oracle);
- "chunk": :func:`chunk_gla` (PyTorch, chunk-local log space, compile-friendly, any device);
- "triton": the project's Triton kernel (``triton/``) for scalar or no gates (no per-channel ``gk``); with an
  initial or final state (prefill, decode) it takes the chunk path;
- "fla":   fla-core 0.6.0 (``chunk_gla`` / ``chunk_simple_gla`` / ``chunk_linear_attn``);
- "auto":  fla on CUDA when importable and safe for the requested pass, else "triton" where it applies on CUDA,
  else "chunk".

This is the one gated-linear-attention primitive: GLA, gated and plain linear attention, HLA (two or three passes)
and CALA all call :func:`gated_linear_attention`. Packed documents use one convention everywhere, ``cu_seqlens``
over the flattened ``B*T`` tokens.

fla is "safe" unless a backward is needed on Hopper with 3.4 <= Triton < 3.7.1 (fla refuses its gated
chunk backward there); the fallback logs one line.
"""

from __future__ import annotations

from typing import Optional

import torch

from attnlab.attention.ops.common import check_impl, fla_gated_backward_ok, fla_importable, log_once
from attnlab.attention.ops.custom_ops import (fake_attention_out, fake_packed_state, opaque_op, pack_state,
                                              unpack_state)
from attnlab.attention.ops.linear_attn.chunk import chunk_gla
from attnlab.attention.ops.linear_attn.naive import naive_recurrent_gla

IMPLS = ("auto", "reference", "chunk", "triton", "fla")
TRITON_CHUNK_SIZES = (16, 32, 64, 128)
"""The chunk lengths the Triton kernel (``triton/gla.py``) compiles for."""

__all__ = ["gated_linear_attention", "chunk_gla", "naive_recurrent_gla", "fla_gla", "resolve_impl", "IMPLS"]

Tensor = torch.Tensor


def fla_usable(device: torch.device, needs_grad: bool) -> tuple[bool, str]:
    """Whether fla's chunk kernels can run here: CUDA, fla importable, and (for training) a safe Triton."""
    if device.type != "cuda":
        return False, "not a CUDA device"
    ok, why = fla_importable()
    if not ok:
        return False, why
    if needs_grad:
        return fla_gated_backward_ok(device)
    return True, ""


def resolve_impl(impl: str, device: torch.device, needs_grad: bool, mechanism: str = "gated linear attention",
                 stateful: bool = False, per_channel: bool = False, chunk_size: int = 64) -> str:
    """Map ``[attention] impl`` to "reference" | "chunk" | "triton" | "fla" (logs one line when "fla" falls back).
    ``stateful``: an initial or final state goes in or out; ``per_channel``: a per-key-channel gate ``gk``.
    "auto" without fla on CUDA takes the Triton kernel where it applies (scalar or no gate, no state, a chunk size
    it compiles for), else the chunk path: on Hopper with Triton < 3.7.1 the chunk path trains gated and plain
    linear attention at ~1/20 of the kernel's speed."""
    check_impl(impl, IMPLS, mechanism)
    if impl == "triton":
        if per_channel:
            raise ValueError(f"attention.impl='triton' for {mechanism}: the Triton kernel has per-head gates only; "
                             "per-channel gates run on 'chunk' or 'fla'")
        return "chunk" if stateful else "triton"
    if impl in ("auto", "fla"):
        ok, why = fla_usable(device, needs_grad)
        if ok:
            return "fla"
        own = ("triton" if impl == "auto" and device.type == "cuda" and not per_channel and not stateful
               and chunk_size in TRITON_CHUNK_SIZES else "chunk")
        if impl == "fla" or device.type == "cuda":
            log_once(f"attention.impl={impl!r}: fla unavailable for {mechanism} ({why}); using the "
                     + ("Triton kernel" if own == "triton" else "PyTorch chunk path"))
        return own
    return impl


def _fla_gla_eager(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], gk: Optional[Tensor], scale: float,
                   cu_seqlens: Optional[Tensor]) -> Tensor:
    return _fla_gla_calls(q, k, v, g, gk, scale, None, False, cu_seqlens)[0].contiguous()


# fla's entry points are torch.compiler.disable'd: the stateless (training) call is an opaque op in compiled models
_fla_gla_op = opaque_op("fla_gla", _fla_gla_eager, fake_attention_out)


def fla_gla(q, k, v, g=None, gk=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla-core 0.6.0 kernels with our contract (fla scales q by ``scale`` too; states are [N, H, K, V])."""
    if initial_state is None and not output_final_state:
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        return _fla_gla_op(q, k, v, g, gk, scale, cu_seqlens), None
    return _fla_gla_calls(q, k, v, g, gk, scale, initial_state, output_final_state, cu_seqlens)


def _fla_gla_calls(q, k, v, g, gk, scale, initial_state, output_final_state, cu_seqlens):
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
    if gk is not None:
        from fla.ops.gla import chunk_gla as fla_chunk_gla

        gk = gk.float() + (g.float()[..., None] if g is not None else 0.0)
        return fla_chunk_gla(q, k, v, g=gk, **kw)
    if g is not None:
        from fla.ops.simple_gla import chunk_simple_gla

        return chunk_simple_gla(q, k, v, g=g.float(), **kw)
    from fla.ops.linear_attn import chunk_linear_attn

    return chunk_linear_attn(q, k, v, normalize=False, **kw)


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] | None; gk: [B, T, H, K] | None (log space, <= 0).

    scale defaults to K**-0.5 (applied to q). cu_seqlens: [N+1] document offsets over the flattened B*T tokens
    (each row boundary is a document boundary). initial_state: [N, H, K, V] with N = B, or N documents when
    ``cu_seqlens`` is given. Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] float32 (float64 for
    float64 inputs) or None).
    """
    B, T, H, K = q.shape
    if k.shape != q.shape or v.shape[:3] != (B, T, H):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q, k [B,T,H,K], v [B,T,H,V]")
    if g is not None and g.shape != (B, T, H):
        raise ValueError(f"g {tuple(g.shape)} must be [B, T, H] = {(B, T, H)}")
    if gk is not None and gk.shape != q.shape:
        raise ValueError(f"gk {tuple(gk.shape)} must be [B, T, H, K] = {tuple(q.shape)}")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, gk, initial_state))
    stateful = initial_state is not None or output_final_state
    path = resolve_impl(impl, q.device, needs_grad, stateful=stateful, per_channel=gk is not None,
                        chunk_size=chunk_size)
    scale = K**-0.5 if scale is None else float(scale)
    if path == "triton":  # rows stay rows: the kernel's sequential state pass runs per (batch, head)
        from attnlab.attention.ops.linear_attn.triton import gla_triton

        return gla_triton(q if scale == 1.0 else q * scale, k, v, g, cu_seqlens=cu_seqlens, chunk_size=chunk_size), None
    if cu_seqlens is not None and B > 1:  # the other paths take the documents flattened into one row
        flat = lambda t: None if t is None else t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
        o, final = gated_linear_attention(flat(q), flat(k), flat(v), flat(g), flat(gk), scale, initial_state,
                                          output_final_state, cu_seqlens, chunk_size, path)
        return o.reshape(B, T, *o.shape[2:]), final
    if path == "reference":
        return naive_recurrent_gla(q, k, v, g, gk, scale, initial_state, output_final_state, cu_seqlens)
    if cu_seqlens is not None and stateful:  # one state per document in and out (context parallelism's chunks)
        o, final = unpack_state(_gla_varlen_state_op(q, k, v, g, gk, scale, initial_state, cu_seqlens, chunk_size,
                                                     path), q, v)
        return o, (final if output_final_state else None)
    if path == "fla":
        return fla_gla(q, k, v, g, gk, scale, initial_state, output_final_state, cu_seqlens)
    if cu_seqlens is not None:
        return _chunk_gla_varlen_op(q, k, v, g, gk, scale, cu_seqlens, chunk_size), None
    return chunk_gla(q, k, v, g, gk, scale, initial_state, output_final_state, cu_seqlens, chunk_size)


def _chunk_gla_varlen_eager(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], gk: Optional[Tensor], scale: float,
                            cu_seqlens: Tensor, chunk_size: int) -> Tensor:
    return chunk_gla(q, k, v, g, gk, scale, None, False, cu_seqlens, chunk_size)[0].contiguous()


def _gla_varlen_state_eager(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], gk: Optional[Tensor], scale: float,
                            initial_state: Optional[Tensor], cu_seqlens: Tensor, chunk_size: int, path: str) -> Tensor:
    """Packed documents with one state each in and out (q, k, v: [1, T, H, ·]; initial_state [N, H, K, V] or None),
    on ``path`` "fla" (fla-core's kernels; its final states are float32) or "chunk": :func:`pack_state` of (o, the
    final states)."""
    if path == "fla":
        o, final = _fla_gla_calls(q, k, v, g, gk, scale, initial_state, True, cu_seqlens)
    else:
        o, final = chunk_gla(q, k, v, g, gk, scale, initial_state, True, cu_seqlens, chunk_size)
    return pack_state(o, final)


# the packed-document layout is built from cu_seqlens' values in Python, and fla's entry points are
# torch.compiler.disable'd: opaque ops inside compiled models, the stateful one the same on every path
_chunk_gla_varlen_op = opaque_op("chunk_gla_varlen", _chunk_gla_varlen_eager, fake_attention_out)
_gla_varlen_state_op = opaque_op("gla_varlen_state", _gla_varlen_state_eager, fake_packed_state)
