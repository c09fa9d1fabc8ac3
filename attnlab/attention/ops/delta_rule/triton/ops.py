"""The custom ops of the delta rule's fla-core paths, ``impl`` "fla" and "triton" (opaque to torch.compile: no graph
break).

- ``attnlab::delta_rule_fwd`` (q, k, v, beta, g?, initial_state?, cu_seqlens?, scale, output_final_state,
  backend, chunk_size, gate_lower_bound?) -> (o, final_state, gk, Aqk, Akk)
- ``attnlab::delta_rule_bwd`` (do, dht?, q, k, v, beta, g?, initial_state?, cu_seqlens?, scale, backend,
  chunk_size, gk?, Aqk?, Akk?, gate_lower_bound?) -> (dq, dk, dv, dbeta, dg, dh0)

Autograd is registered on ``delta_rule_fwd`` (``register_autograd``); ``register_fake`` gives exact shapes and
dtypes for tracing. gk, Aqk, Akk are non-differentiable outputs, non-empty only for KDA on fla (below); every
other path returns them as empty tensors. For DeltaNet / GDN the forward saves only its inputs: the backward
recomputes the chunk-local gate cumsum (``[B, T, H]``) and the WY form (w, u, A: one fused intra-chunk kernel,
which fla's own backward also runs as ``recompute_w_u_fwd``), so nothing of size ``[B, T, H, *]`` beyond the
inputs is kept between the passes.

Backends (``backend``), on CUDA:

- "fla": fla-core 0.6.0's pipeline with fla's ``chunk_bwd_dqkwg`` (g None / [B, T, H]; ours instead where fla
  refuses its gated backward, so a backend picked for a no-grad trace cannot fail in the backward);
- "fla_hopper" (``impl="triton"``): the same pipeline with our Hopper-safe ``dqkwg`` kernel (:mod:`pipeline`);
- "chunk": the PyTorch chunk path (:func:`chunk.chunk_delta_rule`).

Per-channel gates (g [B, T, H, K], KDA) run what fla's own ``ChunkKDAFunction`` (``chunk_kda``) runs: the
forward is ``chunk_kda_fwd`` and returns, as gk, Aqk, Akk, what that Function saves besides its inputs (gk: g's
chunk-local log2 cumsum, [B, T, H, K] float32; Aqk, Akk: [B, T, H, 64] in k's dtype); the backward works on them
and recomputes w, u, h, v_new as fla's does (no forward is rerun): "fla" runs fla's ``chunk_kda_bwd``,
"fla_hopper" the same pipeline with our intra-chunk kernel (:func:`pipeline.kda_bwd`; tensor-core diagonal
blocks for any gate). ``gate_lower_bound`` (KDA only, in [-5, 0); the caller guarantees every g >= it, as KDA's
bounded gate does) runs fla's kernels with ``safe_gate=True, lower_bound=gate_lower_bound``: tensor-core dots on
the 16x16 diagonal blocks. The chunk path is exact for any g and ignores it.
On any non-CUDA device every backend runs the chunk path (forward; backward by autograd through it), so the ops
are testable on the CPU (``torch.library.opcheck``, float64 gradients, ``torch.compile`` without a GPU).

Tensors: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; g None | [B, T, H] | [B, T, H, K] (log decay);
initial_state [N, H, K, V]; cu_seqlens [N + 1] (B == 1). o [B, T, H, V] in v's dtype; final_state
[N, H, K, V] float32 (float64 for float64 q), or an empty float tensor without ``output_final_state``.
Gradients come back in their inputs' dtypes; dg / dh0 are empty tensors when g / initial_state are None.
"""

from __future__ import annotations

from typing import Optional

import torch

from attnlab.attention.ops.common import cuda_device_of, fla_gated_backward_ok
from attnlab.attention.ops.custom_ops import attnlab_op, autograd_inside_op
from attnlab.attention.ops.delta_rule.chunk import chunk_delta_rule
from attnlab.attention.ops.delta_rule.fla import cached_cu_seqlens, check_gate_lower_bound, is_kda
from attnlab.attention.ops.delta_rule.triton.pipeline import _bwd, _fwd, kda_bwd

Tensor = torch.Tensor

BACKENDS = ("fla", "fla_hopper", "chunk")
BT = 64  # fla's chunk size


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _n_states(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _check(backend: str, q: Tensor, cu_seqlens: Optional[Tensor], g: Optional[Tensor],
           gate_lower_bound: Optional[float]) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"attnlab::delta_rule backend={backend!r}; choose from {list(BACKENDS)}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (flattened documents), got B={q.shape[0]}")
    check_gate_lower_bound(g, gate_lower_bound)


def _uses_chunk(backend: str, q: Tensor) -> bool:
    return backend == "chunk" or not q.is_cuda


# ---------------------------------------------------------------- fla pieces (CUDA)
def _fla_prep(q, k, v, beta, g, h0, cu_seqlens):
    """Contiguous, fla-typed inputs and chunk indices."""
    cu = ci = None
    if cu_seqlens is not None:
        from fla.ops.utils.index import prepare_chunk_indices

        cu, ci = cached_cu_seqlens(cu_seqlens, lambda c: prepare_chunk_indices(c, BT))
    q, k, v = (t.contiguous() for t in (q, k, v))
    beta = beta.to(q.dtype).contiguous()
    g = None if g is None else g.float().contiguous()
    h0 = None if h0 is None else h0.float().contiguous()
    return q, k, v, beta, g, h0, cu, ci


def _no_saved(q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(0), q.new_empty(0), q.new_empty(0)


def _kda_fwd(q, k, v, beta, g, h0, cu_seqlens, scale, output_final_state, lower_bound):
    """fla-core 0.6.0's ``ChunkKDAFunction.forward`` at ``chunk_kda``'s defaults (no in-kernel l2norm, gate or beta
    sigmoid; ``disable_recompute=False``), with ``safe_gate`` when ``lower_bound`` is set: (o, final state or None,
    gk, Aqk, Akk).

    gk (g's chunk-local log2 cumsum, [B, T, H, K] float32), Aqk and Akk ([B, T, H, 64] in k's dtype) are what that
    Function saves for its backward besides its inputs (w, u, h, v_new are None at these settings).
    """
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    if q.shape[-1] > 256:  # chunk_kda's own limit, asserted before its Function runs
        raise ValueError(f"fla's KDA supports key head dim <= 256, got {q.shape[-1]}")
    q, k, v, beta, g, h0, cu, ci = _fla_prep(q, k, v, beta, g, h0, cu_seqlens)
    with cuda_device_of(q):
        o, ht, gk, Aqk, Akk, *_ = chunk_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0,
                                                output_final_state=output_final_state, cu_seqlens=cu,
                                                chunk_indices=ci, chunk_size=BT, safe_gate=lower_bound is not None,
                                                lower_bound=lower_bound)
    return o.type_as(q), ht, gk, Aqk, Akk


def _kda_bwd(do, dht, q, k, v, beta, h0, cu_seqlens, scale, gk, Aqk, Akk, lower_bound, backend):
    """fla-core 0.6.0's ``ChunkKDAFunction.backward`` on the forward's saved (gk, Aqk, Akk), recomputing w, u, h,
    v_new (fla's default ``disable_recompute=False``): fla's ``chunk_kda_bwd`` ("fla") or the same pipeline with our
    intra-chunk kernel ("fla_hopper"). (dq, dk, dv, dbeta, dg, dh0)."""
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd


    if gk is None or Aqk is None or Akk is None or 0 in (gk.numel(), Aqk.numel(), Akk.numel()):
        raise ValueError("attnlab::delta_rule_bwd: KDA on fla needs delta_rule_fwd's saved (gk, Aqk, Akk)")
    q, k, v, beta, _, h0, cu, ci = _fla_prep(q, k, v, beta, None, h0, cu_seqlens)
    do = do.to(q.dtype).contiguous()  # fla's Function returns o in q's dtype
    dht = None if dht is None else dht.float().contiguous()
    with cuda_device_of(q):
        if backend == "fla_hopper":
            return kda_bwd(q=q, k=k, v=v, beta=beta, Aqk=Aqk, Akk=Akk, scale=scale, initial_state=h0, do=do,
                           dht=dht, g=gk, cu_seqlens=cu, chunk_indices=ci)
        dq, dk, dv, db, dg, dh0, _, _ = chunk_kda_bwd(q=q, k=k, v=v, beta=beta, Aqk=Aqk, Akk=Akk, scale=scale,
                                                      initial_state=h0, do=do, dht=dht, g=gk, cu_seqlens=cu,
                                                      chunk_indices=ci, chunk_size=BT,
                                                      safe_gate=lower_bound is not None, lower_bound=lower_bound)
    return dq, dk, dv, db, dg, dh0


def _fla_fwd(q, k, v, beta, g, h0, cu_seqlens, scale, output_final_state):
    q, k, v, beta, g, h0, cu, ci = _fla_prep(q, k, v, beta, g, h0, cu_seqlens)
    return _fwd(q, k, v, beta, g, scale, h0, output_final_state, cu, ci)


def _fla_bwd(do, dht, q, k, v, beta, g, h0, cu_seqlens, scale, backend):
    """DeltaNet / GDN: (dq, dk, dv, dbeta, dg or None, dh0 or None) in fla's dtypes (cast by the caller)."""
    q, k, v, beta, gf, h0f, cu, ci = _fla_prep(q, k, v, beta, g, h0, cu_seqlens)
    dqkwg = None
    if backend == "fla" and (gf is None or fla_gated_backward_ok(q.device)[0]):
        # fla's own dqkwg; never where fla refuses it (gated, Hopper + Triton < 3.7.1): ours there
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg as dqkwg
    dht = None if dht is None else dht.float().contiguous()
    return _bwd(q, k, v, beta, gf, scale, h0f, do.contiguous(), dht, cu, ci, dqkwg=dqkwg)


# ---------------------------------------------------------------- forward op
def _fwd_fake(q, k, v, beta, g, initial_state, cu_seqlens, scale, output_final_state, backend, chunk_size,
              gate_lower_bound=None):
    B, T, H, K = q.shape
    o = v.new_empty(B, T, H, v.shape[-1])
    if not output_final_state:
        ht = q.new_empty(0, dtype=_state_dtype(q))
    else:
        ht = q.new_empty(_n_states(q, cu_seqlens), H, K, v.shape[-1], dtype=_state_dtype(q))
    if _uses_chunk(backend, q) or not is_kda(g):
        return o, ht, *_no_saved(q)
    return o, ht, g.new_empty(g.shape, dtype=torch.float32), k.new_empty(B, T, H, BT), k.new_empty(B, T, H, BT)


@attnlab_op("delta_rule_fwd", _fwd_fake, keep_under_sac=True)
def delta_rule_fwd(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor],
                   initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
                   output_final_state: bool, backend: str, chunk_size: int,
                   gate_lower_bound: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check(backend, q, cu_seqlens, g, gate_lower_bound)
    saved = _no_saved(q)
    if _uses_chunk(backend, q):
        o, ht = chunk_delta_rule(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens,
                                 chunk_size=chunk_size)
    elif is_kda(g):
        o, ht, *saved = _kda_fwd(q, k, v, beta, g, initial_state, cu_seqlens, scale, output_final_state,
                                 gate_lower_bound)
    else:
        o, ht = _fla_fwd(q, k, v, beta, g, initial_state, cu_seqlens, scale, output_final_state)
    o = o.to(v.dtype).contiguous()
    ht = q.new_empty(0, dtype=_state_dtype(q)) if ht is None else ht.to(_state_dtype(q)).contiguous()
    return o, ht, *saved


# ---------------------------------------------------------------- backward op
def _bwd_fake(do, dht, q, k, v, beta, g, initial_state, cu_seqlens, scale, backend, chunk_size, gk=None, Aqk=None,
              Akk=None, gate_lower_bound=None):
    like = lambda t: q.new_empty(0) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return tuple(like(t) for t in (q, k, v, beta, g, initial_state))


@attnlab_op("delta_rule_bwd", _bwd_fake)
def delta_rule_bwd(do: Tensor, dht: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, beta: Tensor,
                   g: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
                   backend: str, chunk_size: int, gk: Optional[Tensor] = None, Aqk: Optional[Tensor] = None,
                   Akk: Optional[Tensor] = None,
                   gate_lower_bound: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check(backend, q, cu_seqlens, g, gate_lower_bound)
    if _uses_chunk(backend, q):
        with autograd_inside_op():
            leaves = [None if t is None else t.detach().requires_grad_(True)
                      for t in (q, k, v, beta, g, initial_state)]
            o, ht = chunk_delta_rule(*leaves[:5], scale, leaves[5], dht is not None, cu_seqlens,
                                     chunk_size=chunk_size)
            outs, grads = [o], [do.to(o.dtype)]
            if dht is not None:
                outs.append(ht)
                grads.append(dht.to(ht.dtype))
            need = [t for t in leaves if t is not None]
            got = iter(torch.autograd.grad(outs, need, grads, allow_unused=True))
            res = [None if t is None else next(got) for t in leaves]
        res = [r if r is not None or t is None else torch.zeros_like(t) for r, t in zip(res, leaves)]
    elif is_kda(g):
        res = list(_kda_bwd(do, dht, q, k, v, beta, initial_state, cu_seqlens, scale, gk, Aqk, Akk,
                            gate_lower_bound, backend))
    else:
        res = list(_fla_bwd(do, dht, q, k, v, beta, g, initial_state, cu_seqlens, scale, backend))
    ins = (q, k, v, beta, g, initial_state)
    return tuple(q.new_empty(0) if t is None else r.to(t.dtype).contiguous() for r, t in zip(res, ins))


def _setup_context(ctx, inputs, output):
    q, k, v, beta, g, initial_state, cu_seqlens, scale, output_final_state, backend, chunk_size, lower_bound = inputs
    _, _, gk, Aqk, Akk = output
    ctx.mark_non_differentiable(gk, Aqk, Akk)
    ctx.save_for_backward(q, k, v, beta, g, initial_state, cu_seqlens, gk, Aqk, Akk)
    ctx.args = (scale, output_final_state, backend, chunk_size, lower_bound)


def _backward(ctx, do, dht, *_):  # no gradient flows into the saved intermediates (non-differentiable)
    q, k, v, beta, g, initial_state, cu_seqlens, gk, Aqk, Akk = ctx.saved_tensors
    scale, output_final_state, backend, chunk_size, lower_bound = ctx.args
    dht = dht if output_final_state and dht is not None else None
    dq, dk, dv, db, dg, dh0 = delta_rule_bwd(do, dht, q, k, v, beta, g, initial_state, cu_seqlens, scale, backend,
                                             chunk_size, gk, Aqk, Akk, lower_bound)
    return (dq, dk, dv, db, None if g is None else dg, None if initial_state is None else dh0,
            None, None, None, None, None, None)


delta_rule_fwd.register_autograd(_backward, setup_context=_setup_context)


def delta_rule_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    backend: str = "fla",
    chunk_size: int = 64,
    gate_lower_bound: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`attention.ops.delta_rule.delta_rule`'s contract through ``attnlab::delta_rule_fwd``.

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; g: None | [B, T, H] | [B, T, H, K];
    gate_lower_bound: KDA only, every g >= it (fla's safe_gate kernels).
    Returns (o [B, T, H, V] in v's dtype, final state [N, H, K, V] float32 or None).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, ht, *_ = delta_rule_fwd(q, k, v, beta, g, initial_state, cu_seqlens, scale, output_final_state, backend,
                               chunk_size, gate_lower_bound)
    return o, (ht if output_final_state else None)
