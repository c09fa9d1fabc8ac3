"""HLA ops: chunked == serial == naive (2nd, 3rd order, AHLA), decay variants and the paper's errata, scan
operator associativity, state passing, gradients vs float64, and the Triton kernels (interpreter on CPU)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from attnlab.attention.ops.hla import hla
from attnlab.attention.ops.hla import naive as N
from attnlab.attention.ops.hla.recurrent import hla2_step_paper, hla3_step_corrected, hla3_step_paper, serial_hla

NAIVE = {(2, "symmetric"): N.naive_hla2, (2, "asymmetric"): N.naive_ahla, (3, "symmetric"): N.naive_hla3}
CASES = [(2, "symmetric"), (2, "asymmetric"), (3, "symmetric")]
CU = torch.tensor([0, 5, 13, 15, 26], dtype=torch.int32)  # B=2, T=13: docs of 5, 8 | 2, 11 tokens


def _inputs(B=2, T=13, H=2, K=4, V=3, dtype=torch.float64, scale=0.5):
    q, k = (torch.randn(B, T, H, K, dtype=dtype) * scale for _ in range(2))
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = -torch.rand(B, T, H, dtype=dtype) * 0.5
    return q, k, v, g


def _serial(q, k, v, g, order, variant, normalize, cu=None):
    vv = torch.cat([v, torch.ones_like(v[..., :1])], -1) if normalize else v
    o = serial_hla(q, k, vv, g, order=order, variant=variant, cu_seqlens=cu)
    return N.safe_div(o[..., :-1], o[..., -1], 1e-6) if normalize else o


@pytest.mark.parametrize("normalize", [False, True], ids=["num", "norm"])
@pytest.mark.parametrize("gated", [False, True], ids=["nodecay", "gates"])
@pytest.mark.parametrize("case", CASES, ids=["hla2", "ahla", "hla3"])
def test_chunk_serial_naive_varlen(case, gated, normalize):
    order, variant = case
    q, k, v, g = _inputs()
    g = g if gated else None
    ref = NAIVE[case](q, k, v, g, normalize=normalize, cu_seqlens=CU)
    s = _serial(q, k, v, g, order, variant, normalize, CU)
    c = hla(q, k, v, g, order=order, variant=variant, normalize=normalize, chunk_size=4, cu_seqlens=CU,
            impl="chunk")
    tol = dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s, ref, **tol)
    torch.testing.assert_close(c, ref, **tol)


def test_docs_do_not_leak():
    q, k, v, g = _inputs()
    ref = N.naive_hla2(q, k, v, g, cu_seqlens=CU)
    q2 = q.clone()
    q2[0, :5] += 1.0  # change the first document only
    k2 = k.clone()
    k2[0, :5] -= 1.0
    out = hla(q2, k2, v, g, chunk_size=4, cu_seqlens=CU, impl="chunk")
    torch.testing.assert_close(out[0, 5:], ref[0, 5:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-10, atol=1e-10)
    assert (out[0, :5] - ref[0, :5]).abs().max() > 1e-3


def test_matrix_forms_equal_sums():
    """O = tril(AAᵀ)V and tril(AAᵀ)(AV) (paper's matrix forms) equal the triple/quadruple sums."""
    q, k, v, _ = _inputs(B=1, T=9, H=1)
    torch.testing.assert_close(N.naive_hla2(q, k, v), N.naive_hla2_matrix(q, k, v).to(q.dtype))
    torch.testing.assert_close(N.naive_hla3(q, k, v), N.naive_hla3_matrix(q, k, v).to(q.dtype))


@pytest.mark.parametrize("w", [1, 3, 16, 19])
def test_chunk_sizes(w):
    q, k, v, g = _inputs(B=1, T=19)
    ref = N.naive_hla2(q, k, v, g)
    torch.testing.assert_close(hla(q, k, v, g, chunk_size=w, impl="chunk"), ref, rtol=1e-10, atol=1e-10)


def test_paper_tuple_equals_compact_and_U_identity():
    """Thm 3.1 tuple (S, C, m, G, h) == compact U: U_t = S_t C_t - G_t at every t; also with the
    corrected decay (G = γ² G + γ kkᵀ C)."""
    T, K, V = 9, 4, 3
    q, k, v = torch.randn(T, K, dtype=torch.float64), torch.randn(T, K, dtype=torch.float64), torch.randn(T, V, dtype=torch.float64)
    for gamma in (1.0, 0.8):
        st = (torch.zeros(K, K), torch.zeros(K, V), torch.zeros(K), torch.zeros(K, V), torch.zeros(K))
        st = tuple(x.double() for x in st)
        outs, dens = [], []
        for t in range(T):
            o, d, st = hla2_step_paper(st, q[t], k[t], v[t], gamma, corrected=True)
            outs.append(o)
            dens.append(d)
        g = torch.full((1, T, 1), math.log(gamma), dtype=torch.float64)
        ref = N.naive_hla2(q[None, :, None], k[None, :, None], v[None, :, None], g if gamma < 1 else None)[0, :, 0]
        torch.testing.assert_close(torch.stack(outs), ref)
        den_ref = N.naive_hla2(q[None, :, None], k[None, :, None], torch.ones(1, T, 1, 1, dtype=torch.float64),
                               g if gamma < 1 else None)[0, :, 0, 0]
        torch.testing.assert_close(torch.stack(dens), den_ref)


def test_erratum_paper_decayed_recurrence_is_not_masked():
    """Paper erratum: the printed G = γG + kkᵀC_{t-1} recurrence does not give the decayed masked form."""
    T, K, V = 8, 3, 2
    q, k, v = torch.randn(T, K, dtype=torch.float64), torch.randn(T, K, dtype=torch.float64), torch.randn(T, V, dtype=torch.float64)
    st = tuple(torch.zeros(s, dtype=torch.float64) for s in [(K, K), (K, V), (K,), (K, V), (K,)])
    outs = []
    for t in range(T):
        o, _, st = hla2_step_paper(st, q[t], k[t], v[t], 0.8, corrected=False)
        outs.append(o)
    g = torch.full((1, T, 1), math.log(0.8), dtype=torch.float64)
    ref = N.naive_hla2(q[None, :, None], k[None, :, None], v[None, :, None], g)[0, :, 0]
    assert (torch.stack(outs) - ref).abs().max() > 1e-2 * ref.abs().max()


def test_third_order_corrected_and_paper_erratum():
    """Corrected tuple (S^K S^Q P − G1 − G3 − X) == compact == naive; the paper's Alg. 3 equals the 'max index
    attained at least twice' sum, which differs from the masked (W Wᵀ W) V (a paper erratum)."""
    T, K, V = 7, 3, 2
    q, k, v = torch.randn(T, K, dtype=torch.float64), torch.randn(T, K, dtype=torch.float64), torch.randn(T, V, dtype=torch.float64)
    z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
    st_c = (z(K, K), z(K, K), z(K, V), z(K, V), z(K, V), z(K, V))
    st_p = (z(K, K), z(K, K), z(K, V), z(K, V), z(K, V), z(K, V))
    oc, op = [], []
    for t in range(T):
        o, st_c = hla3_step_corrected(st_c, q[t], k[t], v[t])
        oc.append(o)
        o, st_p = hla3_step_paper(st_p, q[t], k[t], v[t])
        op.append(o)
    ref = N.naive_hla3(q[None, :, None], k[None, :, None], v[None, :, None])[0, :, 0]
    torch.testing.assert_close(torch.stack(oc), ref)
    torch.testing.assert_close(torch.stack(op), N.naive_hla3_paper(q, k, v))
    assert (torch.stack(op) - ref).abs().max() > 1e-2 * ref.abs().max()


def _rand_bracketing(segs, op):
    """Reduce a list with ``op`` under a random binary bracketing."""
    segs = list(segs)
    while len(segs) > 1:
        i = random.randrange(len(segs) - 1)
        segs[i:i + 2] = [op(segs[i], segs[i + 1])]
    return segs[0]


def _close(a, b):
    return all(torch.allclose(a[key], b[key], rtol=1e-9, atol=1e-9) for key in a)


def test_scan_operators_associative_and_errata():
    """Eq. (6) and the corrected ⊕_γ are associative and reproduce the serial state under any bracketing;
    the printed ⊕_γ and AHLA with decaying R are not (ERRATA 1, 3)."""
    random.seed(0)
    T, K, V, gam = 8, 3, 2, 0.8
    q, k, v = torch.randn(T, K, dtype=torch.float64), torch.randn(T, K, dtype=torch.float64), torch.randn(T, V, dtype=torch.float64)
    toks = [N.token_segment(q[t], k[t], v[t]) for t in range(T)]
    a, b, c = (_rand_bracketing(toks[i:i + 3], N.op_masked) for i in (0, 3, 5))
    assert _close(N.op_masked(N.op_masked(a, b), c), N.op_masked(a, N.op_masked(b, c)))
    dtoks = [dict(t, rho=torch.tensor(gam, dtype=torch.float64)) for t in toks]
    ref = None
    for t in dtoks:  # left fold == serial recurrence
        ref = t if ref is None else N.op_decay(ref, t)
    for _ in range(5):
        assert _close(_rand_bracketing(dtoks, N.op_decay), ref)
    # the output q_T (S C - G) of the whole segment equals the decayed masked definition
    g = torch.full((1, T, 1), math.log(gam), dtype=torch.float64)
    o_ref = N.naive_hla2(q[None, :, None], k[None, :, None], v[None, :, None], g)[0, -1, 0]
    torch.testing.assert_close(q[-1] @ (ref["S"] @ ref["C"] - ref["G"]), o_ref)
    paper = lambda x, y: N.op_decay(x, y, paper=True)  # noqa: E731
    x, y, z = dtoks[0], N.op_decay(dtoks[1], dtoks[2]), N.op_decay(dtoks[3], dtoks[4])
    assert not _close(paper(paper(x, y), z), paper(x, paper(y, z)))
    # AHLA: R undecayed -> associative and equal to the serial state; R decayed -> not associative
    atoks = [dict(N.ahla_token_segment(q[t], k[t], v[t]), rho=torch.tensor(gam, dtype=torch.float64)) for t in range(T)]
    fold = None
    for t in atoks:
        fold = t if fold is None else N.op_ahla(fold, t)
    for _ in range(5):
        assert _close(_rand_bracketing(atoks, N.op_ahla), fold)
    a_ref = N.naive_ahla(q[None, :, None], k[None, :, None], v[None, :, None], g)[0, -1, 0]
    torch.testing.assert_close(q[-1] @ fold["E"], a_ref)
    dr = lambda x, y: N.op_ahla(x, y, decay_R=True)  # noqa: E731
    x, y, z = N.op_ahla(atoks[0], atoks[1]), N.op_ahla(atoks[2], atoks[3]), N.op_ahla(atoks[4], atoks[5])
    assert not _close(dr(dr(x, y), z), dr(x, dr(y, z)))


@pytest.mark.parametrize("case", CASES, ids=["hla2", "ahla", "hla3"])
def test_state_passing_and_decode(case):
    """chunk(x[:a]) then chunk(x[a:], state) == chunk(x) == token-by-token decode (with normalisation)."""
    order, variant = case
    q, k, v, g = _inputs(B=2, T=11)
    kw = dict(order=order, variant=variant, normalize=True, chunk_size=4)
    full = hla(q, k, v, g, impl="chunk", **kw)
    o1, st = hla(q[:, :6], k[:, :6], v[:, :6], g[:, :6], impl="chunk", output_final_state=True, **kw)
    o2 = hla(q[:, 6:], k[:, 6:], v[:, 6:], g[:, 6:], impl="chunk", initial_state=st, **kw)
    torch.testing.assert_close(torch.cat([o1, o2], 1), full, rtol=1e-10, atol=1e-10)
    st, outs = None, []
    for t in range(11):
        o, st = hla(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], impl="reference", initial_state=st,
                    output_final_state=True, **kw)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=["hla2", "ahla", "hla3"])
def test_chunk_gradients_vs_naive_float64(case):
    order, variant = case
    q, k, v, g = (x.requires_grad_() for x in _inputs(B=2, T=13))
    do = torch.randn(2, 13, 2, 3, dtype=torch.float64)
    kw = dict(normalize=True, cu_seqlens=CU)
    ref = NAIVE[case](q, k, v, g, **kw)
    gr = torch.autograd.grad((ref * do).sum(), (q, k, v, g))
    out = hla(q, k, v, g, order=order, variant=variant, normalize=True, chunk_size=4, cu_seqlens=CU, impl="chunk")
    gc = torch.autograd.grad((out * do).sum(), (q, k, v, g))
    for a, b in zip(gc, gr):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


def test_chunk_gradcheck_finite_differences():
    q, k, v, g = (x[:1, :6, :1].clone().requires_grad_() for x in _inputs())
    f = lambda q, k, v, g: hla(q, k, v, g, chunk_size=4, normalize=True, impl="chunk")  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v, g))
    f3 = lambda q, k, v, g: hla(q, k, v, g, order=3, chunk_size=4, impl="chunk")  # noqa: E731
    assert torch.autograd.gradcheck(f3, (q, k, v, g))


def test_spec_adjoint_recurrence_matches_autograd():
    """The explicit reverse-mode recurrences equal autograd through the chunk form."""
    T, K, V, gam = 7, 3, 2, 0.9
    q, k, v = (torch.randn(T, K, dtype=torch.float64), torch.randn(T, K, dtype=torch.float64),
               torch.randn(T, V, dtype=torch.float64))
    do = torch.randn(T, V, dtype=torch.float64)
    qs, ks, vs = (x[None, :, None].clone().requires_grad_() for x in (q, k, v))
    g = torch.full((1, T, 1), math.log(gam), dtype=torch.float64)
    out = hla(qs, ks, vs, g, chunk_size=3, impl="chunk")
    dq_a, dk_a, dv_a = (x[0, :, 0] for x in torch.autograd.grad((out[0, :, 0] * do).sum(), (qs, ks, vs)))
    S, U, Ss, Us = torch.zeros(K, K, dtype=torch.float64), torch.zeros(K, V, dtype=torch.float64), [], []
    for t in range(T):
        S = gam * S + torch.outer(k[t], k[t])
        U = gam**2 * U + torch.outer(S @ q[t], v[t])
        Ss.append(S)
        Us.append(U)
    Ub, Sb = torch.zeros(K, V, dtype=torch.float64), torch.zeros(K, K, dtype=torch.float64)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for t in reversed(range(T)):
        Ub = gam**2 * Ub + torch.outer(q[t], do[t])
        Sb = gam * Sb + Ub @ torch.outer(v[t], q[t])
        dq[t] = Us[t] @ do[t] + Ss[t] @ Ub @ v[t]
        dv[t] = Ub.T @ Ss[t] @ q[t]
        dk[t] = (Sb + Sb.T) @ k[t]
    for a, b in ((dq, dq_a), (dk, dk_a), (dv, dv_a)):
        torch.testing.assert_close(a, b)


def test_invalid_options_name_the_key():
    q, k, v, _ = _inputs(B=1, T=3, H=1)
    with pytest.raises(ValueError, match="attention.hla.order"):
        hla(q, k, v, order=4)
    with pytest.raises(ValueError, match="attention.hla.variant"):
        hla(q, k, v, order=3, variant="asymmetric")
    with pytest.raises(ValueError, match="attention.impl"):
        hla(q, k, v, impl="flash")


# ---------------------------------------------------------------------------- Triton (interpreter on CPU)
def _grads(fn, xs, do):
    xs = [x.detach().clone().requires_grad_() if x is not None else None for x in xs]
    out = fn(*xs)
    gr = torch.autograd.grad((out * do).sum(), [x for x in xs if x is not None])
    return out, gr


@pytest.mark.parametrize("case", [(2, "symmetric"), (3, "symmetric")], ids=["hla2", "hla3"])
def test_triton_hla_vs_naive_float64(case):
    """HLA through the Triton kernels == the float64 naive definition, output and gradients (decay + norm)."""
    order, variant = case
    B, T, H, K, V = 1, 21, 1, 5, 3
    q, k, v, g = _inputs(B=B, T=T, H=H, K=K, V=V, dtype=torch.float32)
    cu = torch.tensor([0, 13, 21], dtype=torch.int32)
    do = torch.randn(B, T, H, V)
    fn = lambda q, k, v, g: hla(q, k, v, g, order=order, variant=variant, normalize=True, cu_seqlens=cu,  # noqa: E731
                                chunk_size=16, impl="triton")
    o, gt = _grads(fn, (q, k, v, g), do)
    ref, gr = _grads(lambda q, k, v, g: NAIVE[case](q, k, v, g, normalize=True, cu_seqlens=cu),
                     [x.double() for x in (q, k, v, g)], do.double())
    torch.testing.assert_close(o.double(), ref, rtol=2e-4, atol=2e-4)
    for a, b in zip(gt, gr):
        torch.testing.assert_close(a.double(), b, rtol=2e-4, atol=2e-4)


@pytest.mark.slow
def test_triton_ahla_vs_naive_float64():
    B, T, H, K, V = 2, 37, 2, 8, 5
    q, k, v, g = _inputs(B=B, T=T, H=H, K=K, V=V, dtype=torch.float32)
    do = torch.randn(B, T, H, V)
    fn = lambda q, k, v, g: hla(q, k, v, g, variant="asymmetric", chunk_size=16, impl="triton")  # noqa: E731
    o, gt = _grads(fn, (q, k, v, g), do)
    ref, gr = _grads(lambda q, k, v, g: N.naive_ahla(q, k, v, g), [x.double() for x in (q, k, v, g)], do.double())
    torch.testing.assert_close(o.double(), ref, rtol=2e-4, atol=2e-4)
    for a, b in zip(gt, gr):
        torch.testing.assert_close(a.double(), b, rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=["hla2", "ahla", "hla3"])
def test_triton_hla_gpu(case, dtype):
    """On CUDA at realistic sizes: Triton == chunk PyTorch path (fp32 reference), fwd and grads, varlen.
    bf16 is looser: inputs, the intermediate R/Z passes and the dot products are rounded to bf16."""
    order, variant = case
    B, T, H, D = 2, 1000, 4, 128
    dev = "cuda"
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, D, device=dev)
    g = torch.full((B, T, H), -0.02, device=dev)
    cu = torch.tensor([0, 300, 1000, 1001, 2000], dtype=torch.int32, device=dev)
    do = torch.randn(B, T, H, D, device=dev)
    kw = dict(order=order, variant=variant, normalize=False, cu_seqlens=cu)
    o, gt = _grads(lambda *a: hla(*a, impl="triton", **kw), [x.to(dtype) for x in (q, k, v)] + [g], do.to(dtype))
    ref, gr = _grads(lambda *a: hla(*a, impl="chunk", **kw), (q, k, v, g), do)
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    scale = ref.abs().max()
    assert (o.float() - ref).abs().max() <= tol * scale
    for a, b in zip(gt, gr):
        assert (a.float() - b).abs().max() <= tol * b.abs().max()


