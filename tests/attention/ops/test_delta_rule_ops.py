"""The delta-rule custom ops ``attnlab::delta_rule_fwd`` / ``attnlab::delta_rule_bwd`` (``ops.py``).

CPU (default suite): the ops route to the PyTorch chunk path on any non-CUDA device, so they are checked here
without fla or a GPU: ``torch.library.opcheck`` (schema, fake shapes/dtypes, autograd registration, AOT
dispatch) with optional tensors absent and present; outputs against the recurrent float64 oracle; float64
gradients through the op (q, k, v, beta, g, initial state, through o and the final state) against autograd
through the chunk path; ``torch.compile(fullgraph=True)`` of a function calling the op (aot_eager) against
eager, forward and backward. GPU (``-m gpu``): the op with the backend "auto" picks (fla_hopper on Hopper +
Triton < 3.7.1, fla elsewhere) against the chunk path in float32, and a compiled GDN module (impl "auto")
forward + backward against eager.
"""

import pytest
import torch

from attention.linear_common import l2norm
from attention.ops.delta_rule import chunk_delta_rule, delta_rule, naive_recurrent_delta_rule, select_impl
from attention.ops.delta_rule.ops import delta_rule_bwd, delta_rule_fwd, delta_rule_op

F64 = torch.float64


def _inputs(gate, B, T, H, K, V, dtype=F64, device="cpu", n_state=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), l2norm(r(B, T, H, K)), r(B, T, H, V)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    g = None
    if gate == "scalar":
        g = -0.4 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    elif gate == "channel":
        g = -0.4 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    h0 = None if n_state is None else 0.5 * r(n_state, H, K, V)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return [cast(t) for t in (q, k, v, beta, g, h0)]


CU = torch.tensor([0, 9, 30, 37], dtype=torch.int32)  # unequal documents, none aligned to the chunk


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
@pytest.mark.parametrize("varlen", [False, True])
def test_op_forward_and_grads_match_chunk_path(gate, varlen):
    B, T, H, K, V = (1, 37, 2, 8, 6) if varlen else (2, 21, 2, 8, 6)
    cu = CU if varlen else None
    N = 3 if varlen else B
    q, k, v, beta, g, h0 = _inputs(gate, B, T, H, K, V, n_state=N)
    leaves = lambda: [None if t is None else t.clone().requires_grad_(True) for t in (q, k, v, beta, g, h0)]  # noqa: E731
    a, b = leaves(), leaves()
    o, ht = delta_rule_op(*a[:5], 0.7, a[5], True, cu, backend="fla", chunk_size=16)
    o_ref, ht_ref = chunk_delta_rule(*b[:5], 0.7, b[5], True, cu, chunk_size=16)
    o_orc, ht_orc = naive_recurrent_delta_rule(q, k, v, beta, g, 0.7, h0, True, cu)
    torch.testing.assert_close(o, o_orc, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ht, ht_orc, rtol=1e-9, atol=1e-9)
    assert o.dtype == v.dtype and ht.shape == (N, H, K, V)
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(ht.shape, generator=gen, dtype=F64)
    ((o * do).sum() + (ht * dht).sum()).backward()
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()
    for x, y in zip(a, b):
        if x is not None:
            assert x.grad is not None and x.grad.dtype == x.dtype
            torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-9)


def test_op_without_optional_tensors_and_no_final_state():
    q, k, v, beta, g, _ = _inputs("none", 2, 19, 2, 8, 6, dtype=torch.float32)
    a = [t.clone().requires_grad_(True) for t in (q, k, v, beta)]
    o, ht = delta_rule_op(*a, chunk_size=16)
    assert ht is None and o.dtype == torch.float32
    o_ref, _ = naive_recurrent_delta_rule(*(t.double() for t in (q, k, v, beta)))
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    o.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in a)


@pytest.mark.parametrize("case", ["scalar_varlen_state", "channel_plain", "none_state"])
def test_opcheck(case):
    if case == "scalar_varlen_state":
        q, k, v, beta, g, h0 = _inputs("scalar", 1, 37, 2, 4, 3, n_state=3)
        cu, ofs = CU, True
    elif case == "channel_plain":
        q, k, v, beta, g, h0 = _inputs("channel", 2, 13, 2, 4, 3, dtype=torch.float32)
        cu, ofs = None, False
    else:
        q, k, v, beta, g, h0 = _inputs("none", 2, 13, 2, 4, 3, n_state=2)
        cu, ofs = None, True
    args = [None if t is None else t.requires_grad_(True) for t in (q, k, v, beta, g, h0)]
    torch.library.opcheck(delta_rule_fwd, (*args[:5], args[5], cu, 0.5, ofs, "fla", 16))
    do, dht = torch.randn_like(v), (torch.randn(q.shape[0] if cu is None else 3, 2, 4, 3, dtype=F64) if ofs else None)
    torch.library.opcheck(delta_rule_bwd, (do, dht, *(None if t is None else t.detach() for t in args), cu, 0.5,
                                           "fla_hopper", 16), test_utils=("test_schema", "test_faketensor"))


def test_compiled_fullgraph_matches_eager():
    torch._dynamo.reset()
    q, k, v, beta, g, h0 = _inputs("scalar", 2, 21, 2, 8, 6, n_state=2)
    w = torch.randn(6, 6, dtype=F64)

    def fn(q, k, v, beta, g, h0):  # the op with the backend "fla": the CPU runs its chunk-path kernel
        o, ht = delta_rule_op(q * 1.5, k, v, beta, g, initial_state=h0, output_final_state=True, backend="fla",
                              chunk_size=16)
        return (o @ w).tanh(), ht.square()

    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    a = [t.clone().requires_grad_(True) for t in (q, k, v, beta, g, h0)]
    b = [t.clone().requires_grad_(True) for t in (q, k, v, beta, g, h0)]
    out_c, out_e = compiled(*a), fn(*b)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for x, y in zip(out_c, out_e):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
    (out_c[0].sum() + out_c[1].sum()).backward()
    (out_e[0].sum() + out_e[1].sum()).backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-10)
    with pytest.raises(RuntimeError, match="attention.impl='fla'"):  # dispatch still refuses fla on the CPU
        delta_rule(q, k, v, beta, g, impl="fla")


def test_auto_under_compile_on_cpu_is_chunk():
    torch._dynamo.reset()
    x = torch.randn(1, 2, 2, 4)

    @torch.compile(fullgraph=True, backend="eager")
    def pick(x):
        return x + (1 if select_impl("auto", x, True, True) == "chunk" else 2)

    assert torch.equal(pick(x), x + 1)


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_module_compiled_through_op_matches_chunk(name, monkeypatch):
    """The module path under torch.compile(fullgraph=True) when dispatch picks the op (as "auto" does on a GPU
    with fla): forced here by making the resolver answer "fla" (the op's CPU kernel is the chunk path), packed
    documents included; compared with the eager module on the chunk path."""
    import attention  # noqa: F401
    import attention.ops.delta_rule as dr
    from attention.base import AttentionArgs, AttentionContext
    from attention.registry import REGISTRY

    torch._dynamo.reset()
    spec = REGISTRY[name]
    mods = []
    for impl in ("auto", "chunk"):
        torch.manual_seed(0)
        m = spec.cls(AttentionArgs(dim=16, n_heads=2, n_kv_heads=2, head_dim=4, impl=impl),
                     spec.options(chunk_size=8)).double()
        with torch.no_grad():
            m.init_weights(0.02)
        mods.append(m)
    calls = []
    monkeypatch.setattr(dr, "_resolve", torch.compiler.assume_constant_result(
        lambda *a: calls.append(a) or "fla"))
    pos = torch.cat([torch.arange(7), torch.arange(12)]).expand(2, 19).contiguous()
    ctx = AttentionContext.from_positions(pos, block_causal=True, rope_theta=1e6)
    x = torch.randn(2, 19, 16, dtype=F64)
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(mods[0], fullgraph=True, backend="aot_eager")
    y = compiled(x, ctx)
    y_ref = mods[1](x, ctx)
    assert calls and not counters["graph_break"]
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    for (n, p), p_ref in zip(mods[0].named_parameters(), mods[1].parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-8, atol=1e-10, msg=n)


# ---------------------------------------------------------------- GPU
def _gpu_backend(gated, impl="auto"):
    x = torch.empty(0, device="cuda")
    try:
        path = select_impl(impl, x, gated, True)
    except RuntimeError as e:
        pytest.skip(str(e))
    if path == "chunk":
        pytest.skip("fla-core cannot run here (auto -> chunk)")
    return path


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("impl", ["auto", "fla_hopper"])
def test_gpu_op_matches_chunk_float32(gate, varlen, impl):
    backend = _gpu_backend(gate != "none", impl)
    B, T, H, K, V = (1, 300, 4, 64, 64) if varlen else (2, 200, 4, 64, 64)
    cu = torch.tensor([0, 70, 229, 300], dtype=torch.int32, device="cuda") if varlen else None
    q, k, v, beta, g, h0 = _inputs(gate, B, T, H, K, V, dtype=torch.float32, device="cuda",
                                   n_state=3 if varlen else B)
    a = [None if t is None else t.clone().requires_grad_(True) for t in (q, k, v, beta, g, h0)]
    b = [None if t is None else t.double().requires_grad_(True) for t in (q, k, v, beta, g, h0)]
    o, ht = delta_rule_op(*a[:5], None, a[5], True, cu, backend=backend)
    o_ref, ht_ref = chunk_delta_rule(*b[:5], None, b[5], True, cu)  # float64 on the GPU
    assert o.dtype == torch.float32 and ht.dtype == torch.float32 and ht.shape == ht_ref.shape
    rel = lambda x, y: ((x.double() - y).abs().max() / y.abs().max().clamp_min(1e-6)).item()  # noqa: E731
    assert rel(o, o_ref) < 5e-3, f"{backend} o: relative error {rel(o, o_ref):.2e}"
    assert rel(ht, ht_ref) < 5e-3, f"{backend} final state: relative error {rel(ht, ht_ref):.2e}"
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    ((o * do).sum() + (ht * dht).sum()).backward()
    ((o_ref * do.double()).sum() + (ht_ref * dht.double()).sum()).backward()
    for name, x, y in zip("q k v beta g h0".split(), a, b):
        if x is not None:
            assert x.grad.dtype == x.dtype
            assert rel(x.grad, y.grad) < 1e-2, f"{backend} d{name}: relative error {rel(x.grad, y.grad):.2e}"


@pytest.mark.gpu
def test_gpu_compiled_gdn_module_matches_eager():
    import attention  # noqa: F401
    from attention.base import AttentionArgs, AttentionContext
    from attention.registry import REGISTRY

    _gpu_backend(True)
    torch._dynamo.reset()
    args = AttentionArgs(dim=128, n_heads=2, n_kv_heads=2, head_dim=64, impl="auto")
    mech = REGISTRY["gdn"]
    m = mech.cls(args, mech.options()).to("cuda")
    with torch.no_grad():
        m.init_weights(0.02)
    m = m.to(torch.bfloat16)
    B, T = 2, 256
    x = torch.randn(B, T, 128, device="cuda", dtype=torch.bfloat16)
    ctx = AttentionContext(positions=torch.arange(T, device="cuda").expand(B, T))
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(m, fullgraph=True)
    xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yc = compiled(xc, ctx)
    ye = m(xe, ctx)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(yc.float(), ye.float(), rtol=3e-2, atol=3e-2)
    gc = torch.autograd.grad(yc.float().square().sum(), [xc, *m.parameters()])
    ge = torch.autograd.grad(ye.float().square().sum(), [xe, *m.parameters()])
    for a, b in zip(gc, ge):
        err = (a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)
        assert err < 5e-2, f"relative gradient error {err:.2e}"


def test_cached_cu_seqlens_per_tensor_object():
    """One int64 copy and one chunk-index computation per packed batch's cu_seqlens, shared by every layer's
    forward and backward; a new tensor or an in-place change recomputes (no stale entry by value or address)."""
    from attention.ops.delta_rule.dqkwg import chunk_indices_for
    from attention.ops.delta_rule.ops import cached_cu_seqlens

    calls = []

    def make(cu):
        calls.append(1)
        return chunk_indices_for(cu, 4)

    cu32 = torch.tensor([0, 5, 13, 20], dtype=torch.int32)
    cu, ci = cached_cu_seqlens(cu32)  # KDA-style call first: no indices
    assert ci is None and cu.dtype == torch.int64 and cu.tolist() == cu32.tolist()
    cu_a, ci_a = cached_cu_seqlens(cu32, make)
    cu_b, ci_b = cached_cu_seqlens(cu32, make)
    assert cu_a is cu and cu_b is cu and ci_a is ci_b and len(calls) == 1  # the same objects: fla's caches hit
    assert ci_a.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]]
    same_values = cu32.clone()
    assert cached_cu_seqlens(same_values, make)[0] is not cu and len(calls) == 2  # identity, not value
    cu32[1] = 8  # in place: the version counter changes
    cu_c, ci_c = cached_cu_seqlens(cu32, make)
    assert len(calls) == 3 and cu_c.tolist() == [0, 8, 13, 20] and ci_c.tolist()[:2] == [[0, 0], [0, 1]]
