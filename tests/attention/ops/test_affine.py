"""Affine family: chunked vs the explicit reference (forward, gradients, GQA, varlen), gradcheck of the
implicit-gradient CG solve (incl. λ), the family's limits, decode steps vs the full forward."""

import pytest
import torch

from attnlab.attention.ops.affine import AffineState, affine_attention, affine_step, causal_linear, naive_affine
from attnlab.attention.ops.common import doc_bounds

f64 = torch.float64
MECHS = ["value_avg", "affine_linear", "mesa", "affine_mesa"]


def inputs(B, T, HQ, HKV, D, dtype=f64):
    mk = lambda *s: torch.randn(*s, dtype=dtype)  # noqa: E731
    return mk(B, T, HQ, D), mk(B, T, HKV, D), mk(B, T, HKV, D), torch.rand(B, T, HQ, dtype=dtype) + 0.3


def test_causal_linear_matches_explicit_sum():
    B, H, T, D = 2, 2, 19, 3
    p, k, v = (torch.randn(B, H, T, D, dtype=f64) for _ in range(3))
    cu = torch.tensor([0, 7, 19, 20, 38], dtype=torch.int32)
    ds, _ = doc_bounds(cu, B, T, "cpu")
    out = causal_linear(p, k, v, ds, chunk=4)
    for b in range(B):
        for i in range(T):
            j0 = int(ds[b, i])
            ref = ((p[b, :, i, None] * k[b, :, j0:i + 1]).sum(-1)[..., None] * v[b, :, j0:i + 1]).sum(1)
            torch.testing.assert_close(out[b, :, i], ref)


@pytest.mark.parametrize("mech", MECHS)
@pytest.mark.parametrize("cu", [None, [0, 4, 19, 23, 46]], ids=["causal", "varlen"])
def test_chunked_matches_reference_fwd_and_grads(mech, cu):
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    B, T, HQ, HKV, D = 2, 23, 4, 2, 5
    xs0 = inputs(B, T, HQ, HKV, D)
    go = torch.randn(B, T, HQ, D, dtype=f64)
    xs = [t.clone().requires_grad_() for t in xs0]
    ref = naive_affine(mech, *xs, cu_seqlens=cu)
    ref.backward(go)
    ys = [t.clone().requires_grad_() for t in xs0]
    out = affine_attention(mech, *ys, cu_seqlens=cu, cg_iters=3 * D, rtol=0.0, chunk=8, jacobi=True)
    out.backward(go)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for a, b in zip(ys, xs):
        if b.grad is None:
            assert a.grad is None or a.grad.abs().max() == 0
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("mech", ["mesa", "affine_mesa"])
def test_gradcheck_solved_probe_including_lambda(mech):
    q, k, v, lam = inputs(1, 6, 2, 1, 3)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    fn = lambda q, k, v, lam: affine_attention(mech, q, k, v, lam, cu_seqlens=cu, cg_iters=10, rtol=0.0, chunk=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in (q, k, v, lam)], eps=1e-6, atol=1e-6)


def test_limits_of_the_family():
    q, k, v, _ = inputs(2, 11, 2, 2, 4)
    vavg = naive_affine("value_avg", q, k, v)
    # zero probe: affine linear attention is value averaging
    torch.testing.assert_close(affine_attention("affine_linear", torch.zeros_like(q), k, v), vavg)
    # strong ridge: affine MesaNet -> value averaging, MesaNet -> 0
    torch.testing.assert_close(affine_attention("affine_mesa", q, k, v, 1e10, rtol=0.0), vavg, rtol=1e-8, atol=1e-8)
    assert affine_attention("mesa", q, k, v, 1e10, rtol=0.0).abs().max() < 1e-8
    # first token: value averaging / affine forms return v_1
    for mech in ("value_avg", "affine_linear", "affine_mesa"):
        torch.testing.assert_close(affine_attention(mech, q, k, v, 0.5)[:, 0], v[:, 0])


def test_affine_mesa_reproduces_affine_maps_with_tiny_ridge():
    T, D = 14, 3
    q, k, _, _ = inputs(1, T, 1, 1, D)
    A, c = torch.randn(D, D, dtype=f64), torch.randn(D, dtype=f64)
    o = naive_affine("affine_mesa", q, k, k @ A.T + c, 1e-11)
    torch.testing.assert_close(o[0, D + 1:, 0], q[0, D + 1:, 0] @ A.T + c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mech", MECHS)
def test_decode_steps_equal_full_forward(mech):
    B, T, HQ, HKV, D = 2, 9, 4, 2, 4
    q, k, v, lam = inputs(B, T, HQ, HKV, D, dtype=torch.float32)
    full = affine_attention(mech, q, k, v, lam, cg_iters=3, jacobi=True)  # truncated CG: same iterates
    st = AffineState.zeros(B, HKV, D, "cpu")
    for t in range(T):
        o = affine_step(mech, st, q[:, t], k[:, t], v[:, t], lam[:, t], cg_iters=3, jacobi=True)
        torch.testing.assert_close(o, full[:, t], rtol=1e-4, atol=1e-4)


def test_bad_names_raise():
    q, k, v, lam = inputs(1, 3, 1, 1, 2)
    with pytest.raises(ValueError, match="model.attention"):
        affine_attention("mesanet", q, k, v, lam)
    with pytest.raises(ValueError, match="attention.impl"):
        affine_attention("mesa", q, k, v, lam, impl="triton")
