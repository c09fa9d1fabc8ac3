"""Delta-rule ops: recurrent oracle vs an independent loop, chunked vs recurrent (outputs and every gradient),
packed documents, overflow-free gates, dispatch, and (GPU) fla-core parity.

Float64 throughout on the CPU so mismatches cannot hide behind rounding; sizes are odd (T = 1, 37, 130, K != V).
"""

import pytest
import torch

from attnlab.attention.linear_common import l2norm
from attnlab.attention.ops.delta_rule import chunk_delta_rule, delta_rule, naive_recurrent_delta_rule, select_impl

GATES = ["none", "scalar", "channel"]


def make_inputs(B, T, H, K, V, gate, dtype=torch.float64, device="cpu", decay=1.0):
    q = torch.randn(B, T, H, K, dtype=dtype, device=device)
    k = l2norm(torch.randn(B, T, H, K, dtype=dtype, device=device))
    v = torch.randn(B, T, H, V, dtype=dtype, device=device)
    beta = torch.rand(B, T, H, dtype=dtype, device=device)
    if gate == "none":
        g = None
    elif gate == "scalar":
        g = -decay * torch.rand(B, T, H, dtype=dtype, device=device)
    else:
        g = -decay * torch.rand(B, T, H, K, dtype=dtype, device=device)
    return q, k, v, beta, g


def independent_loop(q, k, v, beta, g, scale, S0=None):
    """The Variants notes' convention (eqs. 11, 24): S [V, K], S_t = S_{t-1} D_t (I - b k k^T) + b v k^T, o_t = S_t q_t."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(V, K, dtype=torch.float64) if S0 is None else S0[b, h].T.clone()
            for t in range(T):
                if g is None:
                    D = eye
                elif g.dim() == 3:
                    D = eye * g[b, t, h].exp()
                else:
                    D = torch.diag(g[b, t, h].exp())
                kt = k[b, t, h]
                S = S @ D @ (eye - beta[b, t, h] * torch.outer(kt, kt)) + beta[b, t, h] * torch.outer(v[b, t, h], kt)
                o[b, t, h] = S @ (scale * q[b, t, h])
    return o


@pytest.mark.parametrize("gate", GATES)
def test_naive_matches_independent_loop(gate):
    q, k, v, beta, g = make_inputs(2, 11, 2, 5, 3, gate)
    h0 = torch.randn(2, 2, 5, 3, dtype=torch.float64)
    o, hT = naive_recurrent_delta_rule(q, k, v, beta, g, scale=0.7, initial_state=h0, output_final_state=True)
    ref = independent_loop(q, k, v, beta, g, 0.7, h0)
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
    assert hT.shape == (2, 2, 5, 3)


def _grads(fn, inputs, seed_out):
    for t in inputs:
        if t is not None:
            t.grad = None
    o, h = fn()
    do, dh = seed_out
    ((o * do).sum() + (h * dh).sum()).backward()
    return o.detach(), h.detach(), [None if t is None else t.grad.clone() for t in inputs]


def _leaf(*ts):
    return [None if t is None else t.clone().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T,chunk,sub", [(1, 16, 16), (37, 16, 4), (37, 64, 16), (130, 32, 8), (130, 64, 16)],
                         ids=lambda x: str(x))
def test_chunk_matches_recurrent(gate, T, chunk, sub):
    B, H, K, V = 2, 2, 6, 5
    q, k, v, beta, g = make_inputs(B, T, H, K, V, gate)
    h0 = torch.randn(B, H, K, V, dtype=torch.float64)
    inputs = _leaf(q, k, v, beta, g, h0)
    seed = (torch.randn(B, T, H, V, dtype=torch.float64), torch.randn(B, H, K, V, dtype=torch.float64))

    def run(f, **kw):
        qq, kk, vv, bb, gg, hh = inputs
        return lambda: f(qq, kk, vv, bb, gg, scale=0.9, initial_state=hh, output_final_state=True, **kw)

    o1, h1, g1 = _grads(run(naive_recurrent_delta_rule), inputs, seed)
    o2, h2, g2 = _grads(run(chunk_delta_rule, chunk_size=chunk, sub_chunk_size=sub), inputs, seed)
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h2, h1, rtol=1e-10, atol=1e-10)
    for name, a, b in zip(["dq", "dk", "dv", "dbeta", "dg", "dh0"], g2, g1):
        if b is None:
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("with_state", [False, True], ids=["packed", "packed_h0"])
def test_chunk_varlen_matches_recurrent(gate, with_state):
    """3 unequal documents (7, 33, 21 tokens; boundaries inside and on chunk edges), state reset at each."""
    lens = [7, 33, 24]
    cu = torch.tensor([0, 7, 40, 64], dtype=torch.int32)
    T, H, K, V = sum(lens), 2, 6, 5
    q, k, v, beta, g = make_inputs(1, T, H, K, V, gate)
    h0 = torch.randn(3, H, K, V, dtype=torch.float64) if with_state else None
    inputs = _leaf(q, k, v, beta, g, h0)
    do = torch.randn(1, T, H, V, dtype=torch.float64)

    def run(f, **kw):
        qq, kk, vv, bb, gg, hh = inputs
        o, h = f(qq, kk, vv, bb, gg, initial_state=hh, output_final_state=with_state, cu_seqlens=cu, **kw)
        return o, (h if h is not None else o.new_zeros(()))

    seed = (do, torch.randn(3, H, K, V, dtype=torch.float64) if with_state else torch.zeros((), dtype=torch.float64))
    o1, h1, g1 = _grads(lambda: run(naive_recurrent_delta_rule), inputs, seed)
    o2, h2, g2 = _grads(lambda: run(chunk_delta_rule, chunk_size=16, sub_chunk_size=4), inputs, seed)
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h2, h1, rtol=1e-10, atol=1e-10)
    for a, b in zip(g2, g1):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    # the reference itself restarts at each document: equal to separate calls
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = lambda t: None if t is None else t[:, s:e].detach()  # noqa: E731
        hs = None if h0 is None else h0[n:n + 1]
        o_sep, _ = naive_recurrent_delta_rule(sl(q), sl(k), sl(v), sl(beta), sl(g), initial_state=hs)
        torch.testing.assert_close(o1[:, s:e], o_sep, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_chunk_strong_decay_does_not_overflow(gate):
    """Per-token log decays of -60 (cumulated -3800 over a chunk): global cumprods would overflow/underflow."""
    q, k, v, beta, g = make_inputs(1, 70, 2, 4, 3, gate, dtype=torch.float32, decay=60.0)
    o1, h1 = naive_recurrent_delta_rule(q.double(), k.double(), v.double(), beta.double(), g.double(),
                                        output_final_state=True)
    o2, h2 = chunk_delta_rule(q, k, v, beta, g, output_final_state=True, chunk_size=64)
    assert torch.isfinite(o2).all() and torch.isfinite(h2).all()
    torch.testing.assert_close(o2.double(), o1, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gate", GATES)
def test_chunk_bf16_close_to_float64(gate):
    """bf16 inputs, float32 accumulation: error is the bf16 rounding of the output (~1e-2 relative)."""
    q, k, v, beta, g = make_inputs(2, 45, 2, 8, 8, gate)
    ref, _ = naive_recurrent_delta_rule(q, k, v, beta, g)
    o, _ = chunk_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16(), g, chunk_size=16)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.double(), ref, rtol=3e-2, atol=3e-2)


def test_dispatch():
    q, k, v, beta, g = make_inputs(1, 5, 1, 4, 4, "scalar")
    assert select_impl("auto", q, gated=True, needs_grad=True) == "chunk"  # CPU: never fla
    with pytest.raises(ValueError, match="attention.impl"):
        select_impl("flash", q, gated=True, needs_grad=False)
    with pytest.raises(RuntimeError, match="fla"):
        delta_rule(q, k, v, beta, g, impl="fla")
    o_r, _ = delta_rule(q, k, v, beta, g, impl="reference")
    o_c, _ = delta_rule(q, k, v, beta, g, impl="chunk", chunk_size=2)
    torch.testing.assert_close(o_c, o_r, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------ GPU / fla
def _fla_or_skip():
    pytest.importorskip("fla")


@pytest.mark.gpu
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_fla_forward_matches_chunk(gate, varlen):
    _fla_or_skip()
    from attnlab.attention.ops.delta_rule.fla import fla_delta_rule

    B, T, H, K, V = (1, 300, 4, 64, 64) if varlen else (2, 300, 4, 64, 64)
    cu = torch.tensor([0, 37, 200, 300], dtype=torch.int32, device="cuda") if varlen else None
    q, k, v, beta, g = make_inputs(B, T, H, K, V, gate, dtype=torch.float32, device="cuda")
    qb, kb, vb, bb = (t.bfloat16() for t in (q, k, v, beta))
    ref, _ = chunk_delta_rule(q.double(), k.double(), v.double(), beta.double(), None if g is None else g.double(),
                              cu_seqlens=cu)
    o, _ = fla_delta_rule(qb, kb, vb, bb, g, cu_seqlens=cu)
    err = (o.double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, f"fla vs chunk relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("gate", GATES)
def test_fla_backward_matches_chunk(gate):
    """fla's gradients against the float64 chunk path on the same bf16 values (fla-core 0.6.0's
    ``chunk_delta_rule`` refuses float32 inputs; the gated ones are refused on Hopper with Triton < 3.7.1)."""
    _fla_or_skip()
    from attnlab.attention.ops.delta_rule.fla import fla_delta_rule, fla_unavailable_reason

    B, T, H, K, V = 2, 200, 4, 64, 64
    q, k, v, beta, g = make_inputs(B, T, H, K, V, gate, dtype=torch.float32, device="cuda")
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))
    why = fla_unavailable_reason(q, gate != "none", needs_grad=True)
    if why:
        pytest.skip(f"fla backward not allowed here: {why}")
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.float64)
    grads = []
    for f, dt in ((fla_delta_rule, None), (chunk_delta_rule, torch.float64)):
        ins = _leaf(*(t if t is None or dt is None else t.to(dt) for t in (q, k, v, beta, g)))
        o, _ = f(*ins)
        (o.double() * do).sum().backward()
        grads.append([None if t is None else t.grad.double() for t in ins])
    for name, a, b in zip(["dq", "dk", "dv", "dbeta", "dg"], *grads):
        if b is None:
            continue
        err = (a - b).abs().max() / b.abs().max()
        assert err < 3e-2, f"{name}: fla vs chunk relative error {err:.3g}"  # bf16 inputs and gradients


@pytest.mark.gpu
@pytest.mark.parametrize("gate", GATES)
def test_chunk_compiled_on_gpu(gate):
    """The PyTorch chunk path compiles and matches eager on CUDA (forward and backward). Tiny shape (3 chunks):
    compile time grows with the number of chunks the loop unrolls."""
    B, T, H, K, V = 1, 80, 2, 32, 32
    q, k, v, beta, g = make_inputs(B, T, H, K, V, gate, dtype=torch.float32, device="cuda")
    fn = torch.compile(chunk_delta_rule, dynamic=False)
    outs = []
    for f in (chunk_delta_rule, fn):
        ins = _leaf(q, k, v, beta, g)
        o, _ = f(*ins, chunk_size=32)
        o.square().sum().backward()
        outs.append([o.detach()] + [t.grad for t in ins if t is not None])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
