"""CALA ops vs an independent per-token loop: local context through the sliding-window softmax path (pad key
trick), normalised linear attention through the HLA primitive (PyTorch and Triton), varlen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention.ops.common import document_ids
from attnlab.attention.ops.cala import local_context, naive_cala, naive_local_context, normalized_linear_attention

CU = torch.tensor([0, 4, 13, 15, 26], dtype=torch.int32)  # B=2, T=13: docs 4, 9 | 2, 11


def _loop_linear(qf, kf, v, cu, eps=1e-6):
    """o_i = Σ_{j≤i, same doc} (φq_i·φk_j) v_j / (Σ φq_i·φk_j + ε), float64 loop."""
    B, T, H, _ = qf.shape
    doc = document_ids(cu, B, T) if cu is not None else torch.zeros(B, T, dtype=torch.long)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for i in range(T):
            for h in range(H):
                num, den = 0.0, 0.0
                for j in range(i + 1):
                    if doc[b, j] == doc[b, i]:
                        w = float(qf[b, i, h].double() @ kf[b, j, h].double())
                        num, den = num + w * v[b, j, h].double(), den + w
                o[b, i, h] = num / (den + eps)
    return o


@pytest.mark.parametrize("cu", [None, CU], ids=["dense", "varlen"])
@pytest.mark.parametrize("window", [1, 3, 20])
def test_local_context_matches_loop(window, cu):
    q, k = torch.randn(2, 13, 2, 8, dtype=torch.float64), torch.randn(2, 13, 2, 8, dtype=torch.float64) * 3
    cq, ck = local_context(q, k, window, cu_seqlens=cu, impl="reference")
    rq, rk = naive_local_context(q, k, window, cu_seqlens=cu)
    torch.testing.assert_close(cq, rq, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ck, rk, rtol=1e-10, atol=1e-10)
    starts = [0] if cu is None else [0, 4]
    assert (cq[0, starts] == 0).all() and (ck[0, starts] == 0).all()  # empty neighbourhood -> C = 0


@pytest.mark.parametrize("cu", [None, CU], ids=["dense", "varlen"])
def test_normalized_linear_attention_matches_loop(cu):
    qf, kf = (F.elu(torch.randn(2, 13, 2, 5, dtype=torch.float64)) + 1 for _ in range(2))
    v = torch.randn(2, 13, 2, 3, dtype=torch.float64)
    o = normalized_linear_attention(qf, kf, v, cu_seqlens=cu, impl="chunk")
    torch.testing.assert_close(o, _loop_linear(qf, kf, v, cu), rtol=1e-10, atol=1e-10)


def test_normalized_linear_attention_triton():
    qf, kf = (F.elu(torch.randn(1, 21, 2, 5)) + 1 for _ in range(2))
    v = torch.randn(1, 21, 2, 3)
    cu = torch.tensor([0, 6, 21], dtype=torch.int32)
    xs = [x.clone().requires_grad_() for x in (qf, kf, v)]
    o = normalized_linear_attention(*xs, cu_seqlens=cu, impl="triton")
    do = torch.randn_like(o)
    gt = torch.autograd.grad((o * do).sum(), xs)
    ys = [x.double().requires_grad_() for x in (qf, kf, v)]
    ref = normalized_linear_attention(*ys, cu_seqlens=cu, impl="chunk")
    gr = torch.autograd.grad((ref * do.double()).sum(), ys)
    torch.testing.assert_close(o.double(), _loop_linear(qf, kf, v, cu), rtol=1e-4, atol=1e-4)
    for a, b in zip(gt, gr):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_full_cala_vs_loop_and_gradients():
    """The op chain (local context -> LayerNorm -> elu+1 -> normalised linear attention) == naive_cala, with
    gradients through both local streams."""
    B, T, H, D = 2, 13, 2, 8
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ln = torch.nn.LayerNorm(D).double()
    phi = lambda x: F.elu(x) + 1  # noqa: E731

    def ops(q, k, v):
        cq, ck = local_context(q, k, 3, cu_seqlens=CU, impl="reference")
        return normalized_linear_attention(phi(ln(q + cq)), phi(ln(k + ck)), v, cu_seqlens=CU, impl="chunk")

    out = ops(q, k, v)
    ref = naive_cala(q, k, v, 3, ln, ln, phi, cu_seqlens=CU)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    do = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * do).sum(), (q, k, v)), torch.autograd.grad((ref * do).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
