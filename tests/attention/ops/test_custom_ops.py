"""attention.ops.custom_ops: ``attnlab_op`` registers an ``attnlab::`` op (once, with its fake, optionally kept
under selective activation checkpointing); ``opaque_op`` makes an untraceable eager function a custom op pair that
compiles with fullgraph=True."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from attnlab.attention.ops.custom_ops import REGISTERED, SAC_SAVE, attnlab_op, opaque_op

Tensor = torch.Tensor


@torch.compiler.disable
def _untraceable(x: Tensor, w: Tensor, idx: Optional[Tensor], scale: float, reps: int) -> Tensor:
    """Data-dependent Python control flow behind torch.compiler.disable: a graph break for dynamo."""
    out = x * w
    for _ in range(int(idx.max().item()) if idx is not None else reps):
        out = torch.tanh(out) * scale
    return out


def _fake(x, w, idx, scale, reps):
    return torch.empty_like(x)


op = opaque_op("test_untraceable", _untraceable, _fake)


def _scale_fake(x, s):
    return torch.empty_like(x)


@attnlab_op("test_scale", _scale_fake, keep_under_sac=True, triton=True)
def _scale(x: Tensor, s: float) -> Tensor:
    return x * s


@attnlab_op("test_scale_kept_off", _scale_fake)
def _scale_recomputed(x: Tensor, s: float) -> Tensor:
    return x * s


def test_attnlab_op_namespace_fake_and_sac_declaration():
    """One namespace; ``keep_under_sac`` puts the op on the save list, its absence leaves it off; under the
    interpreter (the CPU tests) ``triton=True`` is a custom op with the fake (a triton_op needs a GPU)."""
    assert REGISTERED["test_scale"] is _scale and torch.ops.attnlab.test_scale.default is _scale._opoverload
    assert _scale._opoverload in SAC_SAVE and _scale_recomputed._opoverload not in SAC_SAVE
    torch.testing.assert_close(_scale(torch.ones(3), 2.0), torch.full((3,), 2.0))
    torch.library.opcheck(_scale, (torch.randn(2, 3), 0.5), test_utils=("test_schema", "test_faketensor"))


def test_registered_and_rejects_a_second_registration():
    assert REGISTERED["test_untraceable"] is op and REGISTERED["test_untraceable_bwd"] is not None
    assert op._opoverload in SAC_SAVE  # its backward recomputes the forward: the output is kept
    with pytest.raises(ValueError, match="already registered"):
        opaque_op("test_untraceable", _untraceable, _fake)
    with pytest.raises(ValueError, match="attnlab::test_scale is already registered"):
        attnlab_op("test_scale", _scale_fake)(_scale_recomputed)


@pytest.mark.parametrize("with_idx", [True, False])
def test_eager_values_and_gradients(with_idx):
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([1, 3]) if with_idx else None
    ref = _untraceable(x, w, idx, 0.7, 2)
    out = op(x, w, idx, 0.7, 2)
    torch.testing.assert_close(out, ref)
    do = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(out, (x, w), do), torch.autograd.grad(ref, (x, w), do))


def test_compiles_with_fullgraph():
    """The plain function breaks the graph; the op compiles as one graph and gives the same gradients."""
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, requires_grad=True)

    def f(fn, x, w):
        return (fn(x * 2, w, None, 0.5, 3) + 1).square().sum()

    torch._dynamo.reset()
    with pytest.raises(Exception, match="torch.compiler.disable"):
        torch.compile(lambda x, w: f(_untraceable, x, w), fullgraph=True, backend="aot_eager")(x, w)
    torch._dynamo.reset()
    loss = torch.compile(lambda x, w: f(op, x, w), fullgraph=True, backend="aot_eager")(x, w)
    grads = torch.autograd.grad(loss, (x, w))
    ref = torch.autograd.grad(f(_untraceable, x, w), (x, w))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)


def test_opcheck():
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    torch.library.opcheck(op, (x, w, torch.tensor([2]), 0.9, 1))
