"""torch.library custom ops around the fla / fla_hopper delta-rule paths (opaque to torch.compile: no graph break).

- ``attnlab::delta_rule_fwd`` (q, k, v, beta, g?, initial_state?, cu_seqlens?, scale, output_final_state,
  backend, chunk_size) -> (o, final_state)
- ``attnlab::delta_rule_bwd`` (do, dht?, q, k, v, beta, g?, initial_state?, cu_seqlens?, scale, backend,
  chunk_size) -> (dq, dk, dv, dbeta, dg, dh0)

Autograd is registered on ``delta_rule_fwd`` (``register_autograd``); ``register_fake`` gives exact shapes and
dtypes for tracing. The forward saves only its inputs: the backward recomputes the chunk-local gate cumsum
(``[B, T, H]``) and the WY form (w, u, A: one fused intra-chunk kernel, which fla's own backward also runs as
``recompute_w_u_fwd``), so nothing of size ``[B, T, H, *]`` beyond the inputs is kept between the passes.

Backends (``backend``), on CUDA:

- "fla": fla-core 0.6.0's pipeline with fla's ``chunk_bwd_dqkwg`` (g None / [B, T, H]; ours instead where fla
  refuses its gated backward, so a backend picked for a no-grad trace cannot fail in the backward);
- "fla_hopper": the same pipeline with our Hopper-safe ``dqkwg`` kernel (:mod:`fla_hopper`);
- "chunk": the PyTorch chunk path (:func:`chunk.chunk_delta_rule`).

Per-channel gates (g [B, T, H, K], KDA) take fla's ``chunk_kda`` under "fla" and "fla_hopper" alike; its
backward reruns ``chunk_kda`` under autograd (one extra forward) rather than calling fla's private KDA backward.
On any non-CUDA device every backend runs the chunk path (forward; backward by autograd through it), so the ops
are testable on the CPU (``torch.library.opcheck``, float64 gradients, ``torch.compile`` without a GPU).

Tensors: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; g None | [B, T, H] | [B, T, H, K] (log decay);
initial_state [N, H, K, V]; cu_seqlens [N + 1] (B == 1). o [B, T, H, V] in v's dtype; final_state
[N, H, K, V] float32 (float64 for float64 q), or an empty float tensor without ``output_final_state``.
Gradients come back in their inputs' dtypes; dg / dh0 are empty tensors when g / initial_state are None.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch

from attention.linear_common import fla_gated_backward_ok
from attention.ops.delta_rule.chunk import chunk_delta_rule

Tensor = torch.Tensor

BACKENDS = ("fla", "fla_hopper", "chunk")
BT = 64  # fla's chunk size


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _n_states(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _check(backend: str, q: Tensor, cu_seqlens: Optional[Tensor]) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"attnlab::delta_rule backend={backend!r}; choose from {list(BACKENDS)}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (flattened documents), got B={q.shape[0]}")


def _uses_chunk(backend: str, q: Tensor) -> bool:
    return backend == "chunk" or not q.is_cuda


@contextlib.contextmanager
def _autograd_inside_op():
    """Re-enable autograd inside a custom op's kernel (the dispatcher excludes the autograd keys there)."""
    DK = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    with contextlib.ExitStack() as stack:
        for key in (DK.AutogradFunctionality, DK.ADInplaceOrView):
            if excluded.has(key):
                stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        with torch.enable_grad():
            yield


# ---------------------------------------------------------------- fla pieces (CUDA)
_CU_CACHE: list = []  # [weakref to the caller's cu_seqlens, its _version, int64 copy, chunk indices], newest first


def cached_cu_seqlens(cu_seqlens: Tensor, make_indices=None) -> tuple[Tensor, Tensor | None]:
    """(int64 copy of ``cu_seqlens``, ``make_indices(copy)`` or None), computed once per tensor object.

    Every layer of a packed batch (forward and backward) gets the same ``cu_seqlens`` tensor. fla caches its
    per-batch helpers (``prepare_chunk_indices``: the lengths read back to the host, a device sync, and one
    ``arange`` per document; chunk offsets) by the identity of the int64 tensor it is given, so a fresh
    ``.to(torch.int64)`` per call recomputed them 2 × layers times per step. Keyed by identity (a weak reference)
    and the version counter, never by address, so a later batch's tensor cannot hit a stale entry.
    """
    for entry in _CU_CACHE:
        ref, version, cu, ci = entry
        if ref() is cu_seqlens and version == cu_seqlens._version:
            if ci is None and make_indices is not None:
                entry[3] = ci = make_indices(cu)
            return cu, ci
    cu = cu_seqlens.to(torch.int64)
    ci = None if make_indices is None else make_indices(cu)
    _CU_CACHE.insert(0, [weakref.ref(cu_seqlens), cu_seqlens._version, cu, ci])
    del _CU_CACHE[4:]
    return cu, ci


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


def _fla_fwd(q, k, v, beta, g, h0, cu_seqlens, scale, output_final_state):
    if g is not None and g.dim() == 4:
        from attention.ops.delta_rule.fla import fla_delta_rule

        return fla_delta_rule(q, k, v, beta, g, scale, h0, output_final_state, cu_seqlens)
    from attention.ops.delta_rule.fla_hopper import _fwd

    q, k, v, beta, g, h0, cu, ci = _fla_prep(q, k, v, beta, g, h0, cu_seqlens)
    return _fwd(q, k, v, beta, g, scale, h0, output_final_state, cu, ci)


def _fla_bwd(do, dht, q, k, v, beta, g, h0, cu_seqlens, scale, backend):
    """(dq, dk, dv, dbeta, dg or None, dh0 or None) in fla's dtypes (cast by the caller)."""
    if g is not None and g.dim() == 4:  # KDA: rerun fla's chunk_kda under autograd
        from attention.ops.delta_rule.fla import fla_delta_rule

        with _autograd_inside_op():
            leaves = [None if t is None else t.detach().requires_grad_(True) for t in (q, k, v, beta, g, h0)]
            o, ht = fla_delta_rule(*leaves[:5], scale, leaves[5], dht is not None, cu_seqlens)
            outs, grads = [o], [do]
            if dht is not None:
                outs.append(ht)
                grads.append(dht)
            need = [t for t in leaves if t is not None]
            got = iter(torch.autograd.grad(outs, need, grads, allow_unused=True))
            res = [None if t is None else next(got) for t in leaves]
        return tuple(r if r is not None or t is None else torch.zeros_like(t) for r, t in zip(res, leaves))
    from attention.ops.delta_rule.fla_hopper import _bwd

    q, k, v, beta, gf, h0f, cu, ci = _fla_prep(q, k, v, beta, g, h0, cu_seqlens)
    dqkwg = None
    if backend == "fla" and (gf is None or fla_gated_backward_ok(q.device)[0]):
        # fla's own dqkwg; never where fla refuses it (gated, Hopper + Triton < 3.7.1): ours there
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg as dqkwg
    dht = None if dht is None else dht.float().contiguous()
    return _bwd(q, k, v, beta, gf, scale, h0f, do.contiguous(), dht, cu, ci, dqkwg=dqkwg)


# ---------------------------------------------------------------- forward op
@torch.library.custom_op("attnlab::delta_rule_fwd", mutates_args=())
def delta_rule_fwd(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor],
                   initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
                   output_final_state: bool, backend: str, chunk_size: int) -> tuple[Tensor, Tensor]:
    _check(backend, q, cu_seqlens)
    if _uses_chunk(backend, q):
        o, ht = chunk_delta_rule(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens,
                                 chunk_size=chunk_size)
    else:
        o, ht = _fla_fwd(q, k, v, beta, g, initial_state, cu_seqlens, scale, output_final_state)
    o = o.to(v.dtype).contiguous()
    if ht is None:
        return o, q.new_empty(0, dtype=_state_dtype(q))
    return o, ht.to(_state_dtype(q)).contiguous()


@delta_rule_fwd.register_fake
def _(q, k, v, beta, g, initial_state, cu_seqlens, scale, output_final_state, backend, chunk_size):
    B, T, H, K = q.shape
    o = v.new_empty(B, T, H, v.shape[-1])
    if not output_final_state:
        return o, q.new_empty(0, dtype=_state_dtype(q))
    return o, q.new_empty(_n_states(q, cu_seqlens), H, K, v.shape[-1], dtype=_state_dtype(q))


# ---------------------------------------------------------------- backward op
@torch.library.custom_op("attnlab::delta_rule_bwd", mutates_args=())
def delta_rule_bwd(do: Tensor, dht: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, beta: Tensor,
                   g: Optional[Tensor], initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float,
                   backend: str, chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check(backend, q, cu_seqlens)
    if _uses_chunk(backend, q):
        with _autograd_inside_op():
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
    else:
        res = list(_fla_bwd(do, dht, q, k, v, beta, g, initial_state, cu_seqlens, scale, backend))
    ins = (q, k, v, beta, g, initial_state)
    return tuple(q.new_empty(0) if t is None else r.to(t.dtype).contiguous() for r, t in zip(res, ins))


@delta_rule_bwd.register_fake
def _(do, dht, q, k, v, beta, g, initial_state, cu_seqlens, scale, backend, chunk_size):
    like = lambda t: q.new_empty(0) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return tuple(like(t) for t in (q, k, v, beta, g, initial_state))


def _setup_context(ctx, inputs, output):
    q, k, v, beta, g, initial_state, cu_seqlens, scale, output_final_state, backend, chunk_size = inputs
    ctx.save_for_backward(q, k, v, beta, g, initial_state, cu_seqlens)
    ctx.args = (scale, output_final_state, backend, chunk_size)


def _backward(ctx, do, dht):
    q, k, v, beta, g, initial_state, cu_seqlens = ctx.saved_tensors
    scale, output_final_state, backend, chunk_size = ctx.args
    dht = dht if output_final_state and dht is not None else None
    dq, dk, dv, db, dg, dh0 = delta_rule_bwd(do, dht, q, k, v, beta, g, initial_state, cu_seqlens, scale, backend,
                                             chunk_size)
    return (dq, dk, dv, db, None if g is None else dg, None if initial_state is None else dh0,
            None, None, None, None, None)


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
) -> tuple[Tensor, Tensor | None]:
    """:func:`attention.ops.delta_rule.delta_rule`'s contract through ``attnlab::delta_rule_fwd``.

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; g: None | [B, T, H] | [B, T, H, K].
    Returns (o [B, T, H, V] in v's dtype, final state [N, H, K, V] float32 or None).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, ht = delta_rule_fwd(q, k, v, beta, g, initial_state, cu_seqlens, scale, output_final_state, backend,
                           chunk_size)
    return o, (ht if output_final_state else None)
