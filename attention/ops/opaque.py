"""Opaque ops: an eager attention function as a ``torch.library`` custom op pair, so compiled models trace it.

torchtitan compiles every transformer block with ``fullgraph=True``. A mechanism whose compute path dynamo
cannot trace — Triton launches inside an ``autograd.Function``, data-dependent Python loops, fla-core entry
points wrapped in ``torch.compiler.disable`` — breaks the graph and the run fails at its first step.
:func:`opaque_op` registers

- ``attnlab::<name>``: the forward, ``fn`` run as is (inside the op autograd records nothing);
- ``attnlab::<name>_bwd``: the backward by recomputation: ``fn`` again under autograd on detached copies of the
  floating-point tensor inputs, then ``torch.autograd.grad`` (one extra forward; mechanisms whose own backward
  saves intermediates can register a dedicated op pair instead);

with fake implementations for tracing and the autograd wiring between them. Both are opaque to dynamo,
AOTAutograd and inductor, and selective activation checkpointing keeps the forward's output
(:func:`models.parallelize.sac_save_list` adds every op registered here).

``fn`` must be fully annotated with ``torch.library`` schema types (``Tensor``, ``Optional[Tensor]``, ``int``,
``float``, ``bool``, ``str``) and return one new contiguous tensor; ``fake(*args)`` returns an empty contiguous
tensor of the output's shape, dtype and device. Gradients come back contiguous.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch

from attention.ops.common import keep_under_sac

Tensor = torch.Tensor

REGISTERED: dict[str, object] = {}
"""name -> forward op (``torch.ops.attnlab.<name>``): each name is registered once."""


@contextlib.contextmanager
def autograd_inside_op():
    """Re-enable autograd inside a custom op's kernel (the dispatcher excludes the autograd keys there)."""
    DK = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    with contextlib.ExitStack() as stack:
        for key in (DK.AutogradFunctionality, DK.ADInplaceOrView):
            if excluded.has(key):
                stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        with torch.enable_grad():
            yield


def _tensor_slots(fn: Callable) -> list[bool]:
    """Per parameter of ``fn``: whether it is a (possibly optional) tensor."""
    params = inspect.signature(inspect.unwrap(fn), eval_str=True).parameters.values()
    return [p.annotation is Tensor or p.annotation == (Tensor | None) for p in params]


def fake_attention_out(q: Tensor, k: Tensor, v: Tensor, *rest) -> Tensor:
    """The usual ``fake`` of an attention op: [B, T, H, V] from q [B, T, H, K] and v [..., V], in q's dtype."""
    return q.new_empty(*q.shape[:3], v.shape[-1])


def _differentiable(t) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()


def opaque_op(name: str, fn: Callable[..., Tensor], fake: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Register ``fn`` as ``attnlab::<name>`` with a recomputing backward; returns the op (call it like ``fn``)."""
    if name in REGISTERED:
        raise ValueError(f"opaque op attnlab::{name} is already registered")
    slots = _tensor_slots(fn)
    schema = torch.library.infer_schema(inspect.unwrap(fn), mutates_args=())
    params = schema[1:schema.rindex(") -> ")]
    fwd = torch.library.custom_op(f"attnlab::{name}", fn, mutates_args=(), schema=schema)
    fwd.register_fake(fake)

    def bwd_impl(grad, *args):
        leaves = [a.detach().requires_grad_(True) if _differentiable(a) else a for a in args]
        with autograd_inside_op():
            out = fn(*leaves)
            need = [t for t in leaves if _differentiable(t)]
            got = iter(torch.autograd.grad(out, need, grad.to(out.dtype), allow_unused=True))
        grads = []
        for a, is_tensor in zip(leaves, slots):
            if not is_tensor:
                continue
            g = next(got) if _differentiable(a) else None
            if g is None:
                g = a.new_zeros(a.shape) if _differentiable(a) else grad.new_empty(0)
            grads.append(g.contiguous())  # contiguous whatever the input's strides: the fake promises that
        return grads

    def bwd_fake(grad, *args):
        return [a.new_empty(a.shape) if _differentiable(a) else grad.new_empty(0)
                for a, is_tensor in zip(args, slots) if is_tensor]

    bwd = torch.library.custom_op(f"attnlab::{name}_bwd", bwd_impl, mutates_args=(),
                                  schema=f"(Tensor grad, {params}) -> Tensor[]")
    bwd.register_fake(bwd_fake)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*[a for a, is_tensor in zip(inputs, slots) if is_tensor])
        ctx.others = [None if is_tensor else a for a, is_tensor in zip(inputs, slots)]

    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if is_tensor else a for a, is_tensor in zip(ctx.others, slots)]
        grads = iter(bwd(grad.contiguous(), *args))  # one per tensor slot
        out = []
        for a, is_tensor in zip(args, slots):
            g = next(grads) if is_tensor else None
            out.append(g if _differentiable(a) else None)
        return tuple(out)

    fwd.register_autograd(backward, setup_context=setup_context)
    REGISTERED[name] = fwd
    return keep_under_sac(fwd)  # its backward recomputes the forward: saving the output spares a third run
