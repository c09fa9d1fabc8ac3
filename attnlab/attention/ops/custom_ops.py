"""Every ``attnlab::`` custom op is registered here, in one namespace and one way.

torchtitan compiles every transformer block with ``fullgraph=True``. A compute path dynamo cannot trace — Triton
launches inside an ``autograd.Function``, data-dependent Python loops, fla-core entry points wrapped in
``torch.compiler.disable`` — breaks the graph and the run fails at its first step; behind a custom op it is one
opaque node. Two helpers:

- :func:`attnlab_op`: the decorator of every op: ``attnlab::<name>`` with its fake implementation (shapes for
  tracing), optionally kept under selective activation checkpointing (``keep_under_sac``) or, for Triton launches
  that inductor may trace into, a ``torch.library.triton_op`` on a GPU (``triton``). An op pair with its own
  backward (Parallax/softmax, LLA, the delta rule, the short convolution) is two such ops and
  ``fwd.register_autograd``.
- :func:`opaque_op`: an eager function as such a pair with the backward by recomputation:

  - ``attnlab::<name>``: the forward, ``fn`` run as is (inside the op autograd records nothing);
  - ``attnlab::<name>_bwd``: ``fn`` again under autograd on detached copies of the floating-point tensor inputs,
    then ``torch.autograd.grad`` (one extra forward; an op whose own backward saves intermediates is written as
    a pair of :func:`attnlab_op` instead).

  ``fn`` must be fully annotated with ``torch.library`` schema types (``Tensor``, ``Optional[Tensor]``, ``int``,
  ``float``, ``bool``, ``str``) and return one new contiguous tensor; ``fake(*args)`` returns an empty contiguous
  tensor of the output's shape, dtype and device. Gradients come back contiguous.

Selective activation checkpointing keeps the outputs of the ops in :data:`SAC_SAVE` (``attnlab/models/parallelize.py``
reads them through :func:`attention.ops.sac_save_ops`; ``[attention] sac_save = false`` recomputes them).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch

from attnlab.attention.ops.autotune import INTERPRET

Tensor = torch.Tensor

NAMESPACE = "attnlab"

REGISTERED: dict[str, object] = {}
"""name -> op (``torch.ops.attnlab.<name>``): every op registered through :func:`attnlab_op`, each name once."""

SAC_SAVE: list = []
"""Forward ops whose outputs selective activation checkpointing keeps instead of recomputing (``[attention]
sac_save``): without that, the backward of a layer re-runs its attention forward (Triton kernels, CG solves). An op
joins with ``attnlab_op(..., keep_under_sac=True)``; :func:`attention.ops.sac_save_ops` collects them."""


def attnlab_op(name: str, fake: Callable, *, keep_under_sac: bool = False, triton: bool = False,
               schema: str | None = None) -> Callable:
    """Decorator registering ``fn`` as the custom op ``attnlab::<name>`` (it mutates no argument); returns the op,
    called like ``fn`` (autograd, for a forward with its own backward op: ``op.register_autograd``).

    - ``fake``: the op on fake tensors (empty outputs of the right shapes, dtypes and devices), for tracing.
    - ``keep_under_sac``: selective activation checkpointing keeps the op's outputs (:data:`SAC_SAVE`). Set it on
      the forward of a pair whose backward reads what the forward returns, so the backward does not run the
      forward again.
    - ``triton``: on a GPU a ``torch.library.triton_op`` (``fn`` launches its kernels through
      ``torch.library.wrap_triton``): a compiled graph traces into it and inductor launches the kernels from its
      generated code, without a custom op's Python dispatch per call. Triton's interpreter cannot run on fake
      tensors, so under ``TRITON_INTERPRET=1`` (the CPU tests) the same body is a custom op with ``fake``.
    - ``schema``: the op's schema where ``fn``'s annotations do not give it (:func:`opaque_op`).
    """

    def register(fn: Callable) -> Callable:
        if name in REGISTERED:
            raise ValueError(f"custom op {NAMESPACE}::{name} is already registered")
        qualname = f"{NAMESPACE}::{name}"
        if triton and not INTERPRET:
            op = torch.library.triton_op(qualname, fn, mutates_args=())
        else:
            op = torch.library.custom_op(qualname, fn, mutates_args=(), schema=schema)
            op.register_fake(fake)
        if keep_under_sac:
            SAC_SAVE.append(op._opoverload)
        REGISTERED[name] = op
        return op

    return register


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


def fake_packed_state(q: Tensor, k: Tensor, v: Tensor, *rest) -> Tensor:
    """``fake`` of an op returning :func:`unpack_state`'s layout for packed documents: o [B, T, H, V] and the final
    state of every document [N, H, K, V] (N from ``cu_seqlens``, the last tensor argument), flattened into one
    float32 (float64) tensor."""
    cu = [a for a in rest if isinstance(a, Tensor)][-1]
    B, T, H, K = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(B * T * H * v.shape[-1] + (cu.shape[0] - 1) * H * K * v.shape[-1], dtype=acc)


def pack_state(o: Tensor, final: Tensor) -> Tensor:
    """(o, final state) as one contiguous tensor in the state's dtype (an op returns one tensor)."""
    return torch.cat([o.reshape(-1).to(final.dtype), final.reshape(-1)])


def unpack_state(packed: Tensor, q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`pack_state`'s inverse: (o [B, T, H, V] in q's dtype, final state [N, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    n = B * T * H * V
    return packed[:n].view(B, T, H, V).to(q.dtype), packed[n:].view(-1, H, K, V)


def _differentiable(t) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()


def opaque_op(name: str, fn: Callable[..., Tensor], fake: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """Register ``fn`` as ``attnlab::<name>`` with a recomputing backward; returns the op (call it like ``fn``).
    Selective activation checkpointing keeps its output: the backward already runs the forward once more."""
    slots = _tensor_slots(fn)
    schema = torch.library.infer_schema(inspect.unwrap(fn), mutates_args=())
    params = schema[1:schema.rindex(") -> ")]
    fwd = attnlab_op(name, fake, keep_under_sac=True, schema=schema)(fn)

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

    bwd = attnlab_op(f"{name}_bwd", bwd_fake, schema=f"(Tensor grad, {params}) -> Tensor[]")(bwd_impl)

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
    return fwd
