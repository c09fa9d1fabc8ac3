"""Our dqkwg Triton kernel (the Hopper-safe replacement of fla's ``chunk_bwd_kernel_dqkwg``) and the
``fla_hopper`` path.

CPU (TRITON_INTERPRET=1): the kernel against a float64 PyTorch reference of exactly what it computes, gated and
ungated, with and without dw, T not a multiple of the chunk, packed documents, several K and V blocks, outputs
poisoned with NaN beforehand (float32 only: the Triton 3.9 CPU interpreter's bf16 tl.dot is wrong, so the
bf16 kernel test is a GPU test). GPU (``-m gpu``): the whole fla_hopper path (fla's kernels + ours) forward and
backward against the recurrent oracle, with an initial state and a final-state gradient; against the float64 chunk
path, dense and with packed documents, in test_delta_rule_ops.py (impl "triton", which runs fla_hopper).
"""

import functools

import pytest
import torch

from attnlab.attention.linear_common import l2norm
from attnlab.attention.ops.delta_rule import delta_rule, delta_rule_op, naive_recurrent_delta_rule, select_impl
from attnlab.attention.ops.delta_rule.triton.dqkwg import chunk_bwd_dqkwg, chunk_indices_for


fla_hopper = functools.partial(delta_rule_op, backend="fla_hopper")  # fla-core with our dqkwg / KDA intra kernels


def _chunks(B, T, BT, cu):
    """(batch row, first token, last token + 1, global chunk index) of every chunk, fla's order."""
    out = []
    if cu is None:
        for b in range(B):
            for i, s in enumerate(range(0, T, BT)):
                out.append((b, s, min(s + BT, T), b * (-(-T // BT)) + i))
    else:
        bounds = cu.tolist()
        for s0, e0 in zip(bounds[:-1], bounds[1:]):
            for s in range(s0, e0, BT):
                out.append((0, s, min(s + BT, e0), len(out)))
    return out


def reference_dqkwg(q, k, v, do, h, dh, w, g, dv, scale, cu, BT):
    """Float64 loop over (chunk, head) of the formulas in ``dqkwg.py``'s docstring."""
    B, T, H, K = q.shape
    f = lambda t: None if t is None else t.double()  # noqa: E731
    q, k, v, do, h, dh, w, g, dv = map(f, (q, k, v, do, h, dh, w, g, dv))
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    dw = None if w is None else torch.zeros_like(w)
    dg = None if g is None else torch.zeros(B, T, H, dtype=torch.float64)
    for b, s, e, c in _chunks(B, T, BT, cu):
        n = e - s
        for hh in range(H):
            qc, kc, vc, doc = q[b, s:e, hh], k[b, s:e, hh], v[b, s:e, hh], do[b, s:e, hh]
            hc, dhc = h.flatten(0, 1)[c, hh], dh.flatten(0, 1)[c, hh]  # [K, V]
            ds = (doc @ vc.T) * torch.ones(n, n, dtype=torch.float64).tril()
            if g is None:
                dq[b, s:e, hh] = scale * (doc @ hc.T + ds @ kc)
                dk[b, s:e, hh] = vc @ dhc.T + scale * ds.T @ qc
            else:
                gc = g[b, s:e, hh]
                gl = gc[-1]
                ds = ds * torch.exp2((gc[:, None] - gc[None, :]).clamp_max(0)) * scale
                dq_c = scale * torch.exp2(gc)[:, None] * (doc @ hc.T) + ds @ kc
                dk_state = torch.exp2(gl - gc)[:, None] * (vc @ dhc.T)
                dk_c = dk_state + ds.T @ qc
                dq[b, s:e, hh], dk[b, s:e, hh] = dq_c, dk_c
                dgc = (dq_c * qc).sum(1) - (dk_c * kc).sum(1)
                dgc[-1] += torch.exp2(gl) * (hc * dhc).sum() + (dk_state * kc).sum()
                dg[b, s:e, hh] = dgc
            if w is not None:
                dw[b, s:e, hh] = -(dv[b, s:e, hh] @ hc.T)
    return dq, dk, dw, dg


def _inputs(B, T, H, K, V, gated, with_w, cu=None, BT=16, dtype=torch.float32):
    NT = len(_chunks(B, T, BT, cu))
    NT_row = NT if cu is not None else -(-T // BT)
    r = lambda *s: torch.randn(*s).to(dtype)  # noqa: E731
    q, k = r(B, T, H, K), l2norm(torch.randn(B, T, H, K)).to(dtype)
    v, do = r(B, T, H, V), r(B, T, H, V)
    h, dh = r(B, NT_row, H, K, V) * 0.5, r(B, NT_row, H, K, V) * 0.5
    w = r(B, T, H, K) if with_w else None
    dv = r(B, T, H, V) if with_w else None
    g = None
    if gated:  # chunk-local cumsum of log2 decays, restarted at every chunk (and document) start
        g = torch.zeros(B, T, H)
        step = -0.3 * torch.rand(B, T, H)
        for b, s, e, _ in _chunks(B, T, BT, cu):
            g[b, s:e] = step[b, s:e].cumsum(0)
    return q, k, v, do, h, dh, w, g, dv


def _poison(monkeypatch):
    """Every empty/empty_like the launcher allocates starts as NaN: unwritten outputs cannot pass."""
    real_empty, real_like = torch.empty, torch.empty_like
    nan = lambda t: t.fill_(float("nan")) if t.is_floating_point() else t  # noqa: E731
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan(real_like(*a, **kw)))


CASES = [  # (B, T, H, K, V, BT, block_k, block_v)
    (2, 37, 2, 16, 16, 16, None, None),  # T = 2 chunks + 5
    (1, 45, 1, 32, 48, 16, 16, 16),  # 2 K blocks, 3 V blocks, partial last chunk
]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("with_w", [True, False], ids=["dw", "no_dw"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}-BT{c[5]}-BK{c[6]}")
def test_dqkwg_matches_reference(gated, with_w, case, monkeypatch):
    B, T, H, K, V, BT, bk, bv = case
    q, k, v, do, h, dh, w, g, dv = _inputs(B, T, H, K, V, gated, with_w, BT=BT)
    ref = reference_dqkwg(q, k, v, do, h, dh, w, g, dv, 0.7, None, BT)
    _poison(monkeypatch)
    out = chunk_bwd_dqkwg(q, k, v, do, h, dh, w=w, g=g, dv=dv, scale=0.7, chunk_size=BT, block_k=bk, block_v=bv)
    monkeypatch.undo()
    for name, a, b in zip(["dq", "dk", "dw", "dg"], out, ref):
        if b is None:
            assert a is None, name
            continue
        assert torch.isfinite(a).all(), f"{name} has unwritten (NaN) entries"
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_dqkwg_varlen_matches_reference(gated, monkeypatch):
    """Documents of 7, 33 and 21 tokens (boundaries inside and on chunk edges, BT=16)."""
    cu = torch.tensor([0, 7, 40, 61], dtype=torch.int32)
    T, H, K, V, BT = 61, 2, 16, 32, 16
    q, k, v, do, h, dh, w, g, dv = _inputs(1, T, H, K, V, gated, True, cu=cu, BT=BT)
    assert chunk_indices_for(cu, BT).tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1]]
    ref = reference_dqkwg(q, k, v, do, h, dh, w, g, dv, 0.5, cu, BT)
    _poison(monkeypatch)
    out = chunk_bwd_dqkwg(q, k, v, do, h, dh, w=w, g=g, dv=dv, scale=0.5, cu_seqlens=cu, chunk_size=BT)
    monkeypatch.undo()
    for name, a, b in zip(["dq", "dk", "dw", "dg"], out, ref):
        if b is not None:
            assert torch.isfinite(a).all(), f"{name} has unwritten (NaN) entries"
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_fla_hopper_dispatch_on_cpu():
    q = torch.randn(1, 5, 1, 4)
    assert select_impl("auto", q, gated=True, needs_grad=True) == "chunk"
    with pytest.raises(RuntimeError, match="attention.impl='triton'"):
        delta_rule(q, q, q, q[..., 0].sigmoid(), -q[..., 0].abs(), impl="triton")


# ------------------------------------------------------------------------------------------------ GPU
GATES = ["none", "scalar", "channel"]


def _make(B, T, H, K, V, gate, device="cuda"):
    q = torch.randn(B, T, H, K, device=device)
    k = l2norm(torch.randn(B, T, H, K, device=device))
    v = torch.randn(B, T, H, V, device=device)
    beta = torch.rand(B, T, H, device=device)
    g = {"none": None, "scalar": -0.2 * torch.rand(B, T, H, device=device),
         "channel": -0.2 * torch.rand(B, T, H, K, device=device)}[gate]
    return q, k, v, beta, g


def _fwd_bwd(fn, inputs, h0, do, dht, **kw):
    leaves = [None if t is None else t.clone().requires_grad_(True) for t in (*inputs, h0)]
    *ins, hh = leaves
    o, hT = fn(*ins, initial_state=hh, output_final_state=True, **kw)
    ((o.float() * do).sum() + (hT * dht).sum()).backward()
    return [o.detach().float(), hT.detach()] + [None if t is None else t.grad for t in leaves]


def _compare(got, ref, tol, what):
    names = ["o", "hT", "dq", "dk", "dv", "dbeta", "dg", "dh0"]
    for name, a, b in zip(names, got, ref):
        if b is None:
            continue
        assert a is not None and torch.isfinite(a).all(), f"{what} {name}: missing or non-finite"
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6)).item()
        assert err < tol, f"{what} {name}: relative error {err:.3g} >= {tol}"


@pytest.mark.gpu
@pytest.mark.parametrize("gate", GATES)
def test_fla_hopper_matches_recurrent_small(gate):
    """Small T against the token-by-token oracle in float64 (independent of the chunked form)."""
    pytest.importorskip("fla")
    B, T, H, K, V = 1, 77, 4, 64, 64
    inputs = _make(B, T, H, K, V, gate)
    h0 = torch.randn(B, H, K, V, device="cuda") * 0.1
    do, dht = torch.randn(B, T, H, V, device="cuda"), torch.randn(B, H, K, V, device="cuda")
    got = _fwd_bwd(fla_hopper, inputs, h0, do, dht)
    ref = _fwd_bwd(naive_recurrent_delta_rule, [None if t is None else t.double() for t in inputs],
                   h0.double(), do.double(), dht.double())
    _compare(got, ref, 1e-2, f"fla_hopper[{gate}] vs recurrent")


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["none", "scalar"])
def test_our_dqkwg_matches_reference_on_gpu(gate):
    """Compiled (not interpreted) kernel, bf16 tiles at the training tile sizes (BT=64, K=V=128)."""
    B, T, H, K, V, BT = 1, 200, 2, 128, 128, 64
    dev = "cuda"
    q, k, v, do, h, dh, w, g, dv = (None if t is None else t.to(dev) for t in
                                    _inputs(B, T, H, K, V, gate == "scalar", True, BT=BT, dtype=torch.bfloat16))
    ref = reference_dqkwg(*(None if t is None else t.cpu() for t in (q, k, v, do, h, dh, w, g, dv)), 0.1, None, BT)
    out = chunk_bwd_dqkwg(q, k, v, do, h, dh, w=w, g=g, dv=dv, scale=0.1, chunk_size=BT)
    for name, a, b in zip(["dq", "dk", "dw", "dg"], out, ref):
        if b is not None:
            err = (a.double().cpu() - b).abs().max() / b.abs().max()
            assert err < 2e-2, f"{name}: relative error {err:.3g}"


@pytest.mark.gpu
def test_auto_picks_fla_hopper_on_hopper_with_old_triton():
    pytest.importorskip("fla")
    from attnlab.attention.ops.common import fla_gated_backward_ok

    q = torch.randn(1, 8, 1, 16, device="cuda")
    picked = select_impl("auto", q, gated=True, needs_grad=True)
    ok, _ = fla_gated_backward_ok(q.device)
    assert picked == ("fla" if ok else "fla_hopper")
