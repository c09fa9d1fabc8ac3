"""The delta-rule custom ops ``attnlab::delta_rule_fwd`` / ``attnlab::delta_rule_bwd`` (``triton/ops.py``).

CPU (default suite): the ops route to the PyTorch chunk path on any non-CUDA device, so they are checked here
without fla or a GPU: ``torch.library.opcheck`` (schema, fake shapes/dtypes, autograd registration, AOT
dispatch) with optional tensors absent and present; outputs against the recurrent float64 oracle; float64
gradients through the op (q, k, v, beta, g, initial state, through o and the final state) against autograd
through the chunk path; ``torch.compile(fullgraph=True)`` of a function calling the op (aot_eager) against
eager, forward and backward; the fake outputs for CUDA inputs (KDA's saved gk, Aqk, Akk; empty elsewhere);
KDA's ``gate_lower_bound`` through the ops (opcheck, compile) and its rejection for DeltaNet / GDN gates.

KDA on fla, CPU (needs fla-core installed; Triton interpreter, tiny shapes, with the op's device check bypassed):
the op's backward calls fla's ``chunk_kda_bwd`` on the forward's saved (gk, Aqk, Akk) without rerunning the
forward, o / final state / every gradient match the float64 recurrent oracle, fake outputs match real ones; with
``gate_lower_bound`` (gates from the bounded formula) fla's ``safe_gate`` kernels run, forward and backward.

GPU (``-m gpu``): the op with the backend "auto" picks (fla_hopper on Hopper + Triton < 3.7.1, fla elsewhere) and
with "triton" (fla_hopper) against the chunk path in float32, dense and packed, with initial and final states;
KDA's saved-intermediate backward (no rerun) against the recurrent oracle; KDA with ``gate_lower_bound=-5`` (fla's
safe_gate) against the chunk path in float32 and bf16; compiled GDN and KDA modules (impl "auto", inductor)
forward + backward against eager. GPU sweep (``-m gpu_sweep``): each config ``attention.ops.fla_launch`` adds to
KDA's fused backward kernel on Hopper, forced alone, at the benchmark shape.
"""

import os

import pytest
import torch

from attnlab.attention.linear_common import l2norm, log_gate
from attnlab.attention.ops.delta_rule import chunk_delta_rule, delta_rule, naive_recurrent_delta_rule, select_impl
from attnlab.attention.ops.delta_rule.triton.ops import delta_rule_bwd, delta_rule_fwd, delta_rule_op

F64 = torch.float64
LB = -5.0  # KDA's bounded gate: fla's recommended (and lowest safe) lower bound


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
    elif gate == "bounded":  # KDA's bounded gate LB * sigmoid(exp(A_log) * (a + dt_bias)): in [LB, 0)
        g = log_gate(r(B, T, H, K), 0.5 * r(H, 1), r(H, K), lower_bound=LB)
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


@pytest.mark.parametrize("case", ["scalar_varlen_state", "channel_plain", "none_state", "bounded_varlen_state"])
def test_opcheck(case):
    lb = None
    if case == "scalar_varlen_state":
        q, k, v, beta, g, h0 = _inputs("scalar", 1, 37, 2, 4, 3, n_state=3)
        cu, ofs = CU, True
    elif case == "channel_plain":
        q, k, v, beta, g, h0 = _inputs("channel", 2, 13, 2, 4, 3, dtype=torch.float32)
        cu, ofs = None, False
    elif case == "bounded_varlen_state":
        q, k, v, beta, g, h0 = _inputs("bounded", 1, 37, 2, 4, 3, n_state=3)
        cu, ofs, lb = CU, True, LB
    else:
        q, k, v, beta, g, h0 = _inputs("none", 2, 13, 2, 4, 3, n_state=2)
        cu, ofs = None, True
    args = [None if t is None else t.requires_grad_(True) for t in (q, k, v, beta, g, h0)]
    torch.library.opcheck(delta_rule_fwd, (*args[:5], args[5], cu, 0.5, ofs, "fla", 16, lb))
    do, dht = torch.randn_like(v), (torch.randn(q.shape[0] if cu is None else 3, 2, 4, 3, dtype=F64) if ofs else None)
    torch.library.opcheck(delta_rule_bwd, (do, dht, *(None if t is None else t.detach() for t in args), cu, 0.5,
                                           "fla_hopper", 16, None, None, None, lb),
                          test_utils=("test_schema", "test_faketensor"))


def test_gate_lower_bound_only_for_kda_in_range():
    """gate_lower_bound is KDA's: with a DeltaNet / GDN gate, or outside [-5, 0), delta_rule and the op refuse it;
    the chunk path ignores it (exact for any gate)."""
    for gate in ("none", "scalar"):
        q, k, v, beta, g, _ = _inputs(gate, 1, 9, 2, 4, 3)
        with pytest.raises(ValueError, match="gate_lower_bound=-5.0 is for KDA's per-channel gate"):
            delta_rule(q, k, v, beta, g, impl="chunk", gate_lower_bound=LB)
        with pytest.raises(ValueError, match="gate_lower_bound=-5.0 is for KDA's per-channel gate"):
            delta_rule_op(q, k, v, beta, g, gate_lower_bound=LB)
    q, k, v, beta, g, _ = _inputs("bounded", 1, 9, 2, 4, 3)
    for lb in (0.0, -6.0):
        with pytest.raises(ValueError, match=r"must be in \[-5, 0\)"):
            delta_rule(q, k, v, beta, g, impl="reference", gate_lower_bound=lb)
    o, _ = delta_rule(q, k, v, beta, g, impl="chunk", chunk_size=4, gate_lower_bound=LB)
    torch.testing.assert_close(o, delta_rule(q, k, v, beta, g, impl="chunk", chunk_size=4)[0], rtol=0, atol=0)


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


@pytest.mark.parametrize("name, extra", [("gdn", {}), ("kda", {}), ("kda", {"gate_lower_bound": LB})],
                         ids=["gdn", "kda", "kda-bounded"])
def test_module_compiled_through_op_matches_chunk(name, extra, monkeypatch):
    """The module path under torch.compile(fullgraph=True) when dispatch picks the op (as "auto" does on a GPU
    with fla): forced here by making the resolver answer "fla" (the op's CPU kernel is the chunk path), packed
    documents included; compared with the eager module on the chunk path."""
    from attnlab import attention  # noqa: F401
    import attnlab.attention.ops.delta_rule as dr
    from attnlab.attention.base import AttentionArgs, AttentionContext
    from attnlab.attention.registry import REGISTRY

    torch._dynamo.reset()
    spec = REGISTRY[name]
    mods = []
    for impl in ("auto", "chunk"):
        torch.manual_seed(0)
        m = spec.cls(AttentionArgs(dim=16, n_heads=2, n_kv_heads=2, head_dim=4, impl=impl),
                     spec.options(chunk_size=8, **extra)).double()
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


# ---------------------------------------------------------------- KDA on fla (saved intermediates, no rerun)
def test_kda_fake_saved_shapes_for_cuda_inputs():
    """Fake (trace-time) outputs for CUDA inputs, where the op takes fla: KDA returns gk [B, T, H, K] float32 and
    Aqk, Akk [B, T, H, 64] in k's dtype; GDN / DeltaNet (and the chunk backend) return them empty. Fake CUDA
    tensors need no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, T, H, K, V = 2, 100, 3, 32, 16
    with FakeTensorMode():
        q, k = torch.empty(B, T, H, K, device="cuda", dtype=torch.bfloat16), torch.empty(B, T, H, K, device="cuda",
                                                                                          dtype=torch.bfloat16)
        v, beta = torch.empty(B, T, H, V, device="cuda", dtype=torch.bfloat16), torch.empty(B, T, H, device="cuda")
        gates = {"channel": torch.empty(B, T, H, K, device="cuda"), "scalar": torch.empty(B, T, H, device="cuda"),
                 "none": None}
        for gate, g in gates.items():
            for backend in ("fla", "fla_hopper", "chunk"):
                o, ht, gk, Aqk, Akk = delta_rule_fwd(q, k, v, beta, g, None, None, 0.5, True, backend, 64)
                assert o.shape == (B, T, H, V) and o.dtype == torch.bfloat16 and ht.shape == (B, H, K, V)
                if gate == "channel" and backend != "chunk":
                    assert gk.shape == (B, T, H, K) and gk.dtype == torch.float32
                    assert Aqk.shape == Akk.shape == (B, T, H, 64) and Aqk.dtype == Akk.dtype == torch.bfloat16
                else:
                    assert gk.numel() == Aqk.numel() == Akk.numel() == 0
                grads = delta_rule_bwd(o, ht, q, k, v, beta, g, None, None, 0.5, backend, 64, gk, Aqk, Akk)
                for d, t in zip(grads, (q, k, v, beta, g)):
                    assert d.shape == (0,) if t is None else (d.shape == t.shape and d.dtype == t.dtype)


@pytest.fixture
def fla_kda_interpreted(monkeypatch):
    """The ops' fla KDA branch on the CPU: fla-core's Triton kernels under the interpreter (TRITON_INTERPRET=1,
    set by conftest without CUDA), at tiny shapes. Two interpreter shims, test-only, fla's code unchanged:

    - one autotune config per kernel (benchmarking needs a GPU driver): the last of fla's list, whose larger
      tiles mean fewer interpreted programs (the token-parallel intra kernel: BH=8, all heads in one program);
    - ``range`` in fla's kernels yields interpreter tensors when its bound is one (the interpreter gives plain
      ints, on which fla's ``i_t.to(tl.int64)`` fails; compiled Triton's loop variables are tensors);
    - fla's module-level alias ``gather = tl.gather`` (the safe_gate kernels) looks ``tl.gather`` up when called, so
      it gets the interpreter's version (the alias, bound at import, is the unpatched builtin);
    - the safe_gate backward's dots use "ieee" precision (fla picks "bf16x3", which the interpreter lacks).

    The op's device check (``_uses_chunk``: fla only on CUDA) is bypassed so "fla" / "fla_hopper" run fla here.
    Returns the record of fla's ``chunk_kda_fwd`` / ``chunk_kda_bwd`` calls (:func:`_spy_fla_kda`)."""
    pytest.importorskip("fla")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU-interpreter test (on a GPU: test_gpu_kda_saved_backward_matches_recurrent)")
    import builtins
    import operator
    import sys

    import fla.ops  # noqa: F401  (every fla op module)
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.interpreter import _implicit_cvt

    from attnlab.attention.ops.delta_rule.triton import ops
    from attnlab.attention.ops.fla_launch import FastLaunch

    def interp_range(*args):
        if not any(isinstance(a, tl.tensor) for a in args):
            return builtins.range(*args)
        return (_implicit_cvt(i) for i in builtins.range(*map(operator.index, args)))

    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.ops") or mod is None:
            continue
        monkeypatch.setattr(mod, "range", interp_range, raising=False)
        if getattr(mod, "gather", None) is tl.gather:
            monkeypatch.setattr(mod, "gather", lambda src, index, axis: tl.gather(src, index, axis))
        if hasattr(mod, "SAFE_GATE_DOT_PRECISION"):
            monkeypatch.setattr(mod, "SAFE_GATE_DOT_PRECISION", tl.constexpr("ieee"))
        for obj in list(vars(mod).values()):
            obj = obj.kernel if isinstance(obj, FastLaunch) else obj
            while isinstance(obj, (Heuristics, Autotuner)):
                if isinstance(obj, Autotuner) and len(obj.configs) > 1:
                    monkeypatch.setattr(obj, "configs", obj.configs[-1:])
                obj = obj.fn
    monkeypatch.setattr(ops, "_uses_chunk", lambda backend, q: backend == "chunk")
    return _spy_fla_kda(monkeypatch)


def _spy_fla_kda(monkeypatch):
    """Record every call of fla's ``chunk_kda_fwd`` and of the KDA backward pipelines, fla's ``chunk_kda_bwd`` and
    ours (``pipeline.kda_bwd``, fla's argument names) (keyword arguments, result)."""
    from fla.ops.kda import chunk_bwd, chunk_fwd

    from attnlab.attention.ops.delta_rule.triton import pipeline

    calls = {"fwd": [], "bwd": []}

    def spy(key, fn):
        def wrapped(**kw):
            out = fn(**kw)
            calls[key].append((kw, out))
            return out
        return wrapped

    monkeypatch.setattr(chunk_fwd, "chunk_kda_fwd", spy("fwd", chunk_fwd.chunk_kda_fwd))
    monkeypatch.setattr(chunk_bwd, "chunk_kda_bwd", spy("bwd", chunk_bwd.chunk_kda_bwd))
    monkeypatch.setattr(pipeline, "kda_bwd", spy("bwd", pipeline.kda_bwd))
    return calls


def _check_gate_flags(calls, backend, lb):
    """fla's calls got ``safe_gate``/``lower_bound`` for ``lb``; our backward pipeline ("fla_hopper") takes none
    (its intra kernel handles any gate)."""
    recs = calls["fwd"] + (calls["bwd"] if backend == "fla" else [])
    assert [(kw["safe_gate"], kw["lower_bound"]) for kw, _ in recs] == [(lb is not None, lb)] * len(recs)
    if backend != "fla":
        assert all("safe_gate" not in kw for kw, _ in calls["bwd"]), "fla_hopper ran fla's KDA backward"


def _check_no_rerun(calls):
    """One fla forward, one fla backward, and the backward got the forward's gk (its ``g``), Aqk and Akk."""
    assert len(calls["fwd"]) == 1 and len(calls["bwd"]) == 1, "the backward reran fla's forward"
    (_, fout), (bkw, _) = calls["fwd"][0], calls["bwd"][0]
    saved = dict(g=fout[2], Aqk=fout[3], Akk=fout[4])
    for name, t in saved.items():
        assert bkw[name] is t, f"fla's backward did not get the forward's {name}"
    return bkw, saved


KDA_CPU_CASES = [  # (B, T, H, K, V, cu_seqlens, with initial state and final-state gradient, gate_lower_bound)
    pytest.param((1, 70, 2, 16, 16, None, True, None), id="dense_state"),  # 2 chunks: 64 + 6
    pytest.param((1, 80, 2, 16, 16, [0, 11, 80], True, None), id="varlen_state"),  # documents of 11 and 64 + 5 tokens
    pytest.param((1, 80, 2, 16, 16, [0, 11, 80], True, LB), id="varlen_state_bounded"),  # fla's safe_gate kernels
    pytest.param((2, 70, 2, 16, 16, None, False, None), id="dense_plain", marks=pytest.mark.slow),  # no h0, no dht
]


def _same_meta(real, fake, name):
    assert (real.shape, real.dtype, real.stride()) == (fake.shape, fake.dtype, fake.stride()), (
        f"{name}: real {tuple(real.shape)} {real.dtype} {real.stride()} != fake {tuple(fake.shape)} {fake.dtype} "
        f"{fake.stride()}")


@pytest.mark.parametrize("backend", ["fla", "fla_hopper"])
@pytest.mark.parametrize("case", KDA_CPU_CASES)
def test_kda_fla_backward_uses_saved_and_matches_recurrent(case, backend, fla_kda_interpreted):
    """KDA through ``delta_rule_op`` on fla's kernels (interpreted, float32), forward and backward, against the
    float64 recurrent oracle: o, final state, dq, dk, dv, dbeta, dg, dh0, none NaN. fla's forward runs once (no
    rerun in the backward), its backward gets exactly the (gk, Aqk, Akk) the forward produced, and the fake
    (trace-time) outputs of both ops match the real ones in shape, dtype and strides. With a gate_lower_bound
    (gates from KDA's bounded formula, down to it) fla's calls get ``safe_gate=True, lower_bound=`` it.
    "fla_hopper" runs the backward through our pipeline and intra-chunk kernel instead of fla's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, T, H, K, V, cu, with_state, lb = case
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    N = B if cu is None else cu.numel() - 1
    ins = _inputs("channel" if lb is None else "bounded", B, T, H, K, V, n_state=N if with_state else None, seed=3)
    a = [None if t is None else t.float().requires_grad_(True) for t in ins]
    b = [None if t is None else t.clone().requires_grad_(True) for t in ins]  # float64
    o, ht = delta_rule_op(*a[:5], 0.7, a[5], with_state, cu, backend=backend, gate_lower_bound=lb)
    o_ref, ht_ref = naive_recurrent_delta_rule(*b[:5], 0.7, b[5], with_state, cu)
    calls = fla_kda_interpreted
    assert len(calls["fwd"]) == 1 and not calls["bwd"]
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    loss, loss_ref = (o.double() * do).sum(), (o_ref * do).sum()
    if with_state:
        dht = torch.randn(ht.shape, generator=gen, dtype=F64)
        loss, loss_ref = loss + (ht.double() * dht).sum(), loss_ref + (ht_ref * dht).sum()
    else:
        assert ht is None
    loss.backward()
    loss_ref.backward()
    bkw, saved = _check_no_rerun(calls)
    assert (bkw["dht"] is None) != with_state and (bkw["initial_state"] is None) != with_state
    _check_gate_flags(calls, backend, lb)

    outs = [("o", o, o_ref)] + ([("ht", ht, ht_ref)] if with_state else [])
    outs += [(f"d{n}", x.grad, y.grad) for n, x, y in zip(["q", "k", "v", "beta", "g", "h0"], a, b) if x is not None]
    for name, x, y in outs:
        assert x.dtype == torch.float32 and x.shape == y.shape, name
        assert not torch.isnan(x).any(), f"{name} has NaN"
        torch.testing.assert_close(x.double(), y.detach(), rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")

    mode = FakeTensorMode()  # the fake kernels on the same (patched: fla on the CPU) dispatch
    fk = lambda t: None if t is None else mode.from_tensor(t.detach())  # noqa: E731
    f_ins, f_cu, f_do, f_dht = [fk(t) for t in a], fk(cu), fk(o), (fk(ht) if with_state else None)
    with mode:
        f_out = delta_rule_fwd(*f_ins[:5], f_ins[5], f_cu, 0.7, with_state, backend, 64, lb)
        f_grads = delta_rule_bwd(f_do, f_dht, *f_ins, f_cu, 0.7, backend, 64, *f_out[2:], lb)
    real_ht = ht if with_state else torch.empty(0)
    for name, x, y in zip(["o", "ht", "gk", "Aqk", "Akk"], [o, real_ht, *saved.values()], f_out):
        _same_meta(x, y, name)
    for name, x, y in zip(["q", "k", "v", "beta", "g", "h0"], a, f_grads):
        _same_meta(x.grad if x is not None else torch.empty(0), y, f"d{name}")


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
@pytest.mark.parametrize("impl", ["auto", "triton"])
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
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_gpu_kda_saved_backward_matches_recurrent(varlen, impl, monkeypatch):
    """KDA on fla (compiled kernels): fla's forward runs once, its backward gets the forward's (gk, Aqk, Akk), and
    o, final state and every gradient (dh0 included) match the float64 recurrent oracle (TF32 dots: 1e-2)."""
    backend = _gpu_backend(True, impl)
    calls = _spy_fla_kda(monkeypatch)
    B, T, H, K, V = (1, 300, 4, 64, 64) if varlen else (2, 150, 4, 64, 64)
    cu = torch.tensor([0, 70, 229, 300], dtype=torch.int32, device="cuda") if varlen else None
    ins = _inputs("channel", B, T, H, K, V, device="cuda", n_state=3 if varlen else B)
    a = [t.float().requires_grad_(True) for t in ins]
    b = [t.clone().requires_grad_(True) for t in ins]
    o, ht = delta_rule_op(*a[:5], None, a[5], True, cu, backend=backend)
    o_ref, ht_ref = naive_recurrent_delta_rule(*b[:5], None, b[5], True, cu)
    do, dht = torch.randn_like(o_ref), torch.randn_like(ht_ref)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()
    _check_no_rerun(calls)
    rel = lambda x, y: ((x.double() - y).abs().max() / y.abs().max().clamp_min(1e-6)).item()  # noqa: E731
    for name, x, y in [("o", o, o_ref), ("ht", ht, ht_ref)] + [
            (f"d{n}", p.grad, r.grad) for n, p, r in zip(["q", "k", "v", "beta", "g", "h0"], a, b)]:
        assert x.dtype == torch.float32 and torch.isfinite(x).all(), name
        assert rel(x, y.detach()) < 1e-2, f"{backend} {name}: relative error {rel(x, y.detach()):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol_o, tol_grad", [(torch.float32, 5e-3, 1e-2), (torch.bfloat16, 2e-2, 5e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_gpu_kda_bounded_gate_matches_chunk(dtype, tol_o, tol_grad, varlen, impl, monkeypatch):
    """KDA with gate_lower_bound=-5 on fla (safe_gate: tensor-core diagonal blocks) against the float64 chunk path,
    gates from the bounded formula (down to -5), forward and every gradient. Tolerances: float32 those of
    test_gpu_op_matches_chunk_float32; bf16 those of the bf16 fla forward (test_delta_rule.py) and compiled-module
    gradient (test_gpu_compiled_module_matches_eager) checks."""
    backend = _gpu_backend(True, impl)
    calls = _spy_fla_kda(monkeypatch)
    B, T, H, K, V = (1, 300, 4, 64, 64) if varlen else (2, 200, 4, 64, 64)
    cu = torch.tensor([0, 70, 229, 300], dtype=torch.int32, device="cuda") if varlen else None
    q, k, v, beta, g, h0 = _inputs("bounded", B, T, H, K, V, device="cuda", n_state=3 if varlen else B)
    a = [t.to(dtype).requires_grad_(True) for t in (q, k, v, beta)] + [t.float().requires_grad_(True) for t in (g, h0)]
    b = [t.clone().requires_grad_(True) for t in (q, k, v, beta, g, h0)]  # float64
    o, ht = delta_rule_op(*a[:5], None, a[5], True, cu, backend=backend, gate_lower_bound=LB)
    o_ref, ht_ref = chunk_delta_rule(*b[:5], None, b[5], True, cu)
    rel = lambda x, y: ((x.double() - y).abs().max() / y.abs().max().clamp_min(1e-6)).item()  # noqa: E731
    assert o.dtype == dtype and rel(o, o_ref) < tol_o, f"{backend} o: relative error {rel(o, o_ref):.2e}"
    assert rel(ht, ht_ref) < tol_o, f"{backend} final state: relative error {rel(ht, ht_ref):.2e}"
    do, dht = torch.randn_like(o_ref), torch.randn_like(ht_ref)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()
    _check_no_rerun(calls)
    _check_gate_flags(calls, backend, LB)
    for name, x, y in zip("q k v beta g h0".split(), a, b):
        assert x.grad.dtype == x.dtype and torch.isfinite(x.grad).all(), name
        err = rel(x.grad, y.grad)
        assert err < tol_grad, f"{backend} {dtype} d{name}: relative error {err:.2e}"


@pytest.mark.gpu_sweep
@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
def test_gpu_kda_hopper_extra_configs_match_chunk(bounded):
    """Each config attention.ops.fla_launch adds to KDA's fused backward kernel on Hopper (8 warps, which fla's list
    leaves out there), forced alone: every gradient against the float64 chunk path, bf16 budgets of
    test_gpu_kda_bounded_gate_matches_chunk. The shape and flags are those of ``benchmarks/bench_linear.py``'s kda rows
    (B4 T4096 H16 D128, no initial or final state), so that a GPU call running the benchmark first finds fla's
    kernels compiled: a cold compile of fla's KDA kernels at a new specialisation takes 200-260 s on an H100."""
    from attnlab.attention.ops.fla_launch import HOPPER_EXTRA_CONFIGS, FastLaunch, _is_hopper

    backend = _gpu_backend(True, "fla_hopper")
    if not _is_hopper():
        pytest.skip("the extra configs are added on Hopper only")
    import fla.ops.kda.chunk_bwd as cb

    proxy = cb.chunk_kda_bwd_kernel_wy_dqkg_fused
    assert isinstance(proxy, FastLaunch), "fla_launch.install() did not run"
    tuner, keep = proxy.autotuner, list(proxy.autotuner.configs)
    extra = HOPPER_EXTRA_CONFIGS[("fla.ops.kda.chunk_bwd", "chunk_kda_bwd_kernel_wy_dqkg_fused")]
    B, T, H, K, V = 4, 4096, 16, 128, 128
    q, k, v, beta, g, _ = _inputs("bounded" if bounded else "channel", B, T, H, K, V, device="cuda")
    b = [t.clone().requires_grad_(True) for t in (q, k, v, beta, g)]
    o_ref, _ = chunk_delta_rule(*b, None, None, False, None)
    do = torch.randn_like(o_ref)
    (o_ref * do).sum().backward()
    rel = lambda x, y: ((x.double() - y).abs().max() / y.abs().max().clamp_min(1e-6)).item()  # noqa: E731
    try:
        for bk, bv, warps, stages in extra:
            tuner.configs = [c for c in keep if (c.kwargs.get("BK"), c.kwargs.get("BV"), c.num_warps,
                                                 c.num_stages) == (bk, bv, warps, stages)]
            assert len(tuner.configs) == 1, f"({bk}, {bv}, {warps}, {stages}) is not in the kernel's list"
            tuner.cache.clear()
            proxy.configs.clear()
            a = [t.to(torch.bfloat16).requires_grad_(True) for t in (q, k, v, beta)] + [g.float().requires_grad_(True)]
            o, _ = delta_rule_op(*a, None, None, False, None, backend=backend, gate_lower_bound=LB if bounded else None)
            (o.double() * do).sum().backward()
            for name, x, y in zip("q k v beta g".split(), a, b):
                err = rel(x.grad, y.grad)
                assert torch.isfinite(x.grad).all() and err < 5e-2, \
                    f"config ({bk}, {bv}, {warps} warps, {stages} stages) d{name}: relative error {err:.2e}"
    finally:
        tuner.configs = keep
        tuner.cache.clear()
        proxy.configs.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_gpu_compiled_module_matches_eager(name):
    """The module under torch.compile(fullgraph=True) (inductor) with impl "auto" (the custom ops; KDA's saved
    intermediates are graph outputs of the forward op fed to the backward op) against eager, bf16."""
    from attnlab import attention  # noqa: F401
    from attnlab.attention.base import AttentionArgs, AttentionContext
    from attnlab.attention.registry import REGISTRY

    _gpu_backend(True)
    torch._dynamo.reset()
    args = AttentionArgs(dim=128, n_heads=2, n_kv_heads=2, head_dim=64, impl="auto")
    mech = REGISTRY[name]
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
    from attnlab.attention.ops.delta_rule.fla import cached_cu_seqlens
    from attnlab.attention.ops.delta_rule.triton.dqkwg import chunk_indices_for

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
