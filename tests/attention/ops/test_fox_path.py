"""FoX and PaTH ops: blockwise PyTorch == naive (outputs and gradients), naive == independent loops."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention.ops.fox import chunk_forgetting_attn, forgetting_attention, naive_forgetting_attn
from attnlab.attention.ops.path import chunk_path_attn, householder_update_, naive_path_attn, path_attention

D64 = torch.float64


def inputs(B, T, HQ, HKV, D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=D64)  # noqa: E731
    q, k, v = r(B, T, HQ, D), r(B, T, HKV, D), r(B, T, HKV, D - 2)
    g = F.logsigmoid(r(B, T, HQ) + 1)
    w = F.normalize(r(B, T, HKV, D), dim=-1)
    beta = 2 * torch.sigmoid(r(B, T, HKV))
    return q, k, v, g, w, beta


def fox_loop(q, k, v, g, scale):
    """o_t = Σ_i softmax(scale q_t·k_i + Σ_{j=i+1..t} g_j) v_i, one (b, h, t) at a time."""
    B, T, HQ, _ = q.shape
    G = HQ // k.shape[2]
    o = torch.zeros(B, T, HQ, v.shape[-1], dtype=D64)
    for b in range(B):
        for h in range(HQ):
            for t in range(T):
                logit = torch.stack([scale * q[b, t, h] @ k[b, i, h // G] + g[b, i + 1:t + 1, h].sum() for i in range(t + 1)])
                o[b, t, h] = torch.softmax(logit, 0) @ v[b, :t + 1, h // G]
    return o


def path_loop(q, k, v, w, beta, g, scale):
    """Explicit path products P_{i+1:t} = M_{i+1}···M_t (Variants eq. 33), logits scale·(A + c_t − c_i)."""
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    o = torch.zeros(B, T, HQ, v.shape[-1], dtype=D64)
    for b in range(B):
        for h in range(HQ):
            hk = h // G
            for t in range(T):
                P, logit = torch.eye(D, dtype=D64), []
                for i in range(t, -1, -1):
                    logit.append(k[b, i, hk] @ P @ q[b, t, h] + g[b, i + 1:t + 1, h].sum())
                    P = (torch.eye(D, dtype=D64) - beta[b, i, hk] * torch.outer(w[b, i, hk], w[b, i, hk])) @ P
                o[b, t, h] = torch.softmax(scale * torch.stack(logit[::-1]), 0) @ v[b, :t + 1, hk]
    return o


def test_fox_naive_matches_loop():
    q, k, v, g, _, _ = inputs(1, 9, 4, 2, 6)
    torch.testing.assert_close(naive_forgetting_attn(q, k, v, g, 0.3), fox_loop(q, k, v, g, 0.3), rtol=1e-12, atol=1e-12)


def test_path_naive_matches_explicit_products():
    q, k, v, g, w, beta = inputs(1, 9, 4, 2, 6)
    torch.testing.assert_close(naive_path_attn(q, k, v, w, beta, g, 0.3), path_loop(q, k, v, w, beta, g, 0.3),
                               rtol=1e-12, atol=1e-12)
    zero = torch.zeros_like(g)
    torch.testing.assert_close(naive_path_attn(q, k, v, w, beta, None, 0.3), path_loop(q, k, v, w, beta, zero, 0.3),
                               rtol=1e-12, atol=1e-12)


def _grads(fn, leaves, do):
    o = fn()
    return [o, *torch.autograd.grad((o * do).sum(), leaves)]


@pytest.mark.parametrize("T,m", [(1, 16), (37, 8), (130, 32)], ids=lambda x: str(x))
def test_fox_blockwise_matches_naive(T, m):
    q, k, v, g, _, _ = inputs(2, T, 4, 2, 8, seed=T)
    leaves = [t.requires_grad_() for t in (q, k, v, g)]
    do = torch.randn(2, T, 4, 6, dtype=D64)
    ref = _grads(lambda: naive_forgetting_attn(q, k, v, g), leaves, do)
    out = _grads(lambda: chunk_forgetting_attn(q, k, v, g, block_size=m), leaves, do)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("T,m", [(1, 16), (37, 8), (130, 32)], ids=lambda x: str(x))
def test_path_blockwise_matches_naive(T, m, gate):
    q, k, v, g, w, beta = inputs(2, T, 4, 2, 8, seed=T)
    g = g if gate else None
    leaves = [t.requires_grad_() for t in (q, k, v, w, beta) + ((g,) if gate else ())]
    do = torch.randn(2, T, 4, 6, dtype=D64)
    ref = _grads(lambda: naive_path_attn(q, k, v, w, beta, g), leaves, do)
    out = _grads(lambda: chunk_path_attn(q, k, v, w, beta, g, block_size=m), leaves, do)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_varlen_three_docs_equal_separate_runs():
    cu = torch.tensor([0, 5, 42, 70], dtype=torch.int32)
    q, k, v, g, w, beta = inputs(1, 70, 4, 2, 8, seed=1)
    fox = chunk_forgetting_attn(q, k, v, g, cu_seqlens=cu, block_size=16)
    pth = chunk_path_attn(q, k, v, w, beta, g, cu_seqlens=cu, block_size=16)
    torch.testing.assert_close(fox, naive_forgetting_attn(q, k, v, g, cu_seqlens=cu), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pth, naive_path_attn(q, k, v, w, beta, g, cu_seqlens=cu), rtol=1e-10, atol=1e-10)
    for s, e in ((0, 5), (5, 42), (42, 70)):
        sl = lambda t: t[:, s:e]  # noqa: E731
        torch.testing.assert_close(fox[:, s:e], naive_forgetting_attn(*map(sl, (q, k, v, g))), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(pth[:, s:e], naive_path_attn(*map(sl, (q, k, v, w, beta, g))), rtol=1e-10, atol=1e-10)


def test_varlen_over_rows_matches_chunk():
    """B = 2 rows with cu_seqlens over the flattened B*T tokens (as the model passes them: every row starts a
    document): the reference equals the chunk path and, per document, itself on that document alone."""
    cu = torch.tensor([0, 5, 35, 42, 70], dtype=torch.int32)
    q, k, v, g, w, beta = inputs(2, 35, 4, 2, 8, seed=2)
    ref = naive_path_attn(q, k, v, w, beta, g, cu_seqlens=cu)
    torch.testing.assert_close(chunk_path_attn(q, k, v, w, beta, g, cu_seqlens=cu, block_size=16), ref,
                               rtol=1e-10, atol=1e-10)
    for b, s, e in ((0, 0, 5), (0, 5, 35), (1, 0, 7), (1, 7, 35)):
        one = naive_path_attn(*(t[b:b + 1, s:e] for t in (q, k, v, w, beta, g)))
        torch.testing.assert_close(ref[b:b + 1, s:e], one, rtol=1e-10, atol=1e-10)


def test_path_decode_key_update_matches_scores():
    """Transformed-key cache after t steps holds P_{i+1:t}^T k_i: its scores equal the path scores."""
    _, k, _, _, w, beta = inputs(1, 12, 2, 2, 6, seed=2)
    cache = torch.zeros(1, 12, 2, 6, dtype=D64)
    for t in range(12):
        householder_update_(cache, w[:, t], beta[:, t], t)
        cache[:, t] = k[:, t]
    P = torch.eye(6, dtype=D64)
    for i in range(11, -1, -1):  # P = M_{i+1} ... M_11 ; cached key i should be P^T k_i
        torch.testing.assert_close(cache[0, i, 0], P.T @ k[0, i, 0], rtol=1e-12, atol=1e-12)
        P = (torch.eye(6, dtype=D64) - beta[0, i, 0] * torch.outer(w[0, i, 0], w[0, i, 0])) @ P


def test_dispatch_and_validation():
    q, k, v, g, w, beta = inputs(1, 7, 2, 1, 8)
    torch.testing.assert_close(forgetting_attention(q, k, v, g), naive_forgetting_attn(q, k, v, g))
    torch.testing.assert_close(path_attention(q, k, v, w, beta), naive_path_attn(q, k, v, w, beta))
    with pytest.raises(ValueError, match="attention.impl"):
        forgetting_attention(q, k, v, g, impl="sdpa")
    with pytest.raises(ValueError, match="attention.impl"):
        path_attention(q, k, v, w, beta, impl="flex")
    with pytest.raises(ValueError, match="beta"):
        path_attention(q, k, v, w, beta[..., None])


def test_bf16_blockwise_close():
    q, k, v, g, w, beta = inputs(1, 50, 4, 2, 16, seed=4)
    ref_f, ref_p = naive_forgetting_attn(q, k, v, g), naive_path_attn(q, k, v, w, beta, g)
    bf = lambda *ts: [t.bfloat16() for t in ts]  # noqa: E731
    o_f = chunk_forgetting_attn(*bf(q, k, v), g.float(), block_size=16)
    o_p = chunk_path_attn(*bf(q, k, v), w.float(), beta.float(), g.float(), block_size=16)
    for o, ref in ((o_f, ref_f), (o_p, ref_p)):
        assert o.dtype == torch.bfloat16
        assert (o.double() - ref).norm() / ref.norm() < 2e-2  # bf16 inputs, fp32 math


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fla", "triton"])
def test_fox_gpu_paths(impl):
    if impl == "fla":
        pytest.importorskip("fla")
    dev = torch.device("cuda")
    cu = torch.tensor([0, 100, 333, 512], dtype=torch.int32, device=dev)
    for cus in (None, cu):
        q, k, v, g, _, _ = (t.to(dev) for t in inputs(1, 512, 8, 2, 64, seed=3))
        v = torch.randn_like(k)
        leaves = [t.float().requires_grad_() for t in (q, k, v, g)]
        do = torch.randn(1, 512, 8, k.shape[-1], device=dev)
        ref = _grads(lambda: naive_forgetting_attn(*leaves, cu_seqlens=cus), leaves, do)
        lb = [t.detach().bfloat16().requires_grad_() if i < 3 else t.detach().clone().requires_grad_() for i, t in enumerate(leaves)]
        out = _grads(lambda: forgetting_attention(*lb, cu_seqlens=cus, impl=impl), lb, do.bfloat16())
        for a, b in zip(out, ref):
            assert (a.float() - b).norm() / b.norm() < 3e-2


@pytest.mark.gpu
def test_path_fla_parity():
    pytest.importorskip("fla")
    dev = torch.device("cuda")
    q, k, v, g, w, beta = (t.to(dev) for t in inputs(2, 300, 8, 4, 64, seed=5))
    v = torch.randn_like(k)
    ref = naive_path_attn(q, k, v, w, beta, g)
    o = path_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), w.float(), beta.float(), g.float(), impl="fla")
    assert (o.double() - ref).norm() / ref.norm() < 2e-2
    oc = chunk_path_attn(q.float(), k.float(), v.float(), w.float(), beta.float(), g.float())
    assert (oc.double() - ref).norm() / ref.norm() < 1e-4
