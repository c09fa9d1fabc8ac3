"""Our KDA intra-chunk backward kernel (:mod:`attention.ops.delta_rule.triton.kda_intra`).

CPU (TRITON_INTERPRET=1, float32): the kernel against float64 autograd through the score matrices it
differentiates, on T not a multiple of the chunk, packed documents, two channel blocks, outputs poisoned with NaN;
the tensor-core diagonal and the exact loop forced in turn, and a gate whose blocks span more than float32 can
factor (the dots alone overflow; the kernel's choice stays exact). GPU (``-m gpu``): against fla-core's own
``chunk_kda_bwd_intra`` on the benchmark shape, plain and bounded gates.
"""

import math

import pytest
import torch

from attnlab.attention.linear_common import l2norm
from attnlab.attention.ops.delta_rule.triton.kda_intra import chunk_kda_bwd_intra
from tests.attention.ops.test_delta_rule_hopper import _chunks, _poison


def reference_intra(q, k, g, beta, dAqk, dAkk, cu, BT):
    """float64 (dq_A, dk_A, db_A, dg_A): autograd of sum(Aqk * dAqk) + sum(Akk * dAkk) through the module
    docstring's score matrices (j <= i within a chunk; dg in natural-log units)."""
    B, T, H, K = q.shape
    q, k, beta = (t.double().requires_grad_() for t in (q, k, beta))
    gn = (g.double() * math.log(2)).requires_grad_()
    loss = 0
    for b, s, e, _ in _chunks(B, T, BT, cu):
        n = e - s
        gc = gn[b, s:e]
        dec = torch.exp((gc[:, None] - gc[None, :]).clamp_max(0))  # [i, j, H, K]
        low = torch.ones(n, n, dtype=torch.float64).tril()[:, :, None]
        aqk = torch.einsum("ihc,jhc,ijhc->ijh", q[b, s:e], k[b, s:e], dec) * low
        akk = torch.einsum("ihc,jhc,ijhc->ijh", k[b, s:e], k[b, s:e], dec) * low * beta[b, s:e][:, None]
        loss = loss + (aqk * dAqk[b, s:e, :, :n].double().transpose(1, 2)).sum()
        loss = loss + (akk * dAkk[b, s:e, :, :n].double().transpose(1, 2)).sum()
    return torch.autograd.grad(loss, (q, k, beta, gn))


def _inputs(B, T, H, K, BT, step, cu=None):
    """q, k (l2-normalised), g (chunk-local log2 cumsum of per-step decays drawn from ``step``), beta, dA, partials."""
    q, k = torch.randn(B, T, H, K), l2norm(torch.randn(B, T, H, K))
    beta = torch.rand(B, T, H)
    g = torch.zeros(B, T, H, K)
    d = step(B, T, H, K)
    for b, s, e, _ in _chunks(B, T, BT, cu):
        g[b, s:e] = d[b, s:e].cumsum(0)
    dAqk, dAkk = torch.randn(B, T, H, BT), torch.randn(B, T, H, BT)
    dq, dk, dg = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    db = torch.randn(B, T, H)
    return q, k, g, beta, dAqk, dAkk, dq, dk, db, dg


MILD = lambda *s: -2.0 * torch.rand(*s)  # noqa: E731  per-step log2 decay in (-2, 0]: spans <= 32 per block
STEEP = lambda *s: -40.0 * torch.rand(*s)  # noqa: E731  spans of hundreds: 2^(span/2) overflows float32


def _check(inputs, cu, BT, monkeypatch, **kw):
    q, k, g, beta, dAqk, dAkk, dq, dk, db, dg = inputs
    ref = reference_intra(q, k, g, beta, dAqk, dAkk, cu, BT)
    _poison(monkeypatch)
    out = chunk_kda_bwd_intra(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, cu_seqlens=cu, chunk_size=BT, **kw)
    monkeypatch.undo()
    for name, got, r, part in zip(["dq", "dk", "db", "dg"], out, ref, (dq, dk, db, dg)):
        assert torch.isfinite(got).all(), f"{name} has non-finite (unwritten or overflowed) entries"
        torch.testing.assert_close(got.double(), part.double() + r, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{name}: {m}")


CASES = [  # (B, T, H, K, BT, block_k)
    (2, 37, 2, 16, 32, None),  # one full chunk + a partial one with a partial 16-row block
    (1, 70, 1, 48, 64, 32),  # two channel blocks (the second half-masked), partial last chunk
]


@pytest.mark.parametrize("path", ["auto", "dots", "loop"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-BT{c[4]}")
def test_kda_intra_matches_reference(case, path, monkeypatch):
    B, T, H, K, BT, bk = case
    span_max = {"auto": 120.0, "dots": float("inf"), "loop": -1.0}[path]
    _check(_inputs(B, T, H, K, BT, MILD), None, BT, monkeypatch, span_max=span_max, block_k=bk)


def test_kda_intra_varlen_matches_reference(monkeypatch):
    """Documents of 7, 33 and 21 tokens (boundaries inside and on 16-row blocks, BT=32)."""
    cu = torch.tensor([0, 7, 40, 61], dtype=torch.int32)
    _check(_inputs(1, 61, 2, 16, 32, MILD, cu=cu), cu, 32, monkeypatch)


def test_kda_intra_steep_gate_stays_exact(monkeypatch):
    """Per-step log2 decays down to -40 (the plain softplus gate allows any): the per-block choice takes the loop
    where the factored dots would overflow, and the result matches. Forcing the dots on the same input does
    overflow, so this input exercises the fallback."""
    torch.manual_seed(3)
    inputs = _inputs(1, 64, 2, 16, 64, STEEP)
    _check(inputs, None, 64, monkeypatch)
    forced = chunk_kda_bwd_intra(*inputs, chunk_size=64, span_max=float("inf"))
    assert not all(torch.isfinite(t).all() for t in forced), "steep gate did not overflow the dots: test is vacuous"


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
def test_gpu_kda_intra_matches_fla(bounded, varlen):
    """Ours against fla-core 0.6.0's ``chunk_kda_bwd_intra`` at the benchmark shape (B4 T4096 H16 D128; varlen: the
    same 16,384 tokens as one row of 5 documents, boundaries inside chunks and 16-row blocks), gates as KDA makes
    them (plain: -exp(A_log) softplus, most blocks too steep for the dots; bounded: fla's lower_bound -5 sigmoid
    form), on fla's own intermediate tensors' dtypes."""
    pytest.importorskip("fla")
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra as fla_intra
    from fla.ops.utils.index import prepare_chunk_indices

    torch.manual_seed(0)
    B, T, H, K, BT = 4, 4096, 16, 128, 64
    dev = "cuda"
    cu = None
    if varlen:
        B, T = 1, B * T
        cu = torch.tensor([0, 1000, 5003, 5011, 9000, T], dtype=torch.int64, device=dev)
    a = torch.randn(B, T, H, K, device=dev)
    A = torch.empty(H, device=dev).uniform_(1, 16).log()
    if bounded:
        step = -5.0 * torch.sigmoid(A.exp()[None, None, :, None] * a)
    else:
        step = -A.exp()[None, None, :, None] * torch.nn.functional.softplus(a)
    g = torch.zeros_like(step)
    bounds = [0, T] if cu is None else cu.tolist()
    for s0, e0 in zip(bounds[:-1], bounds[1:]):  # chunk-local cumsum, restarted at documents' starts
        for c in range(s0, e0, BT):
            g[:, c:min(c + BT, e0)] = (step[:, c:min(c + BT, e0)] / math.log(2)).cumsum(1)
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = l2norm(torch.randn(B, T, H, K, device=dev)).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device=dev, dtype=torch.bfloat16)
    dAqk = torch.randn(B, T, H, BT, device=dev) * 0.1
    dAkk = torch.randn(B, T, H, BT, device=dev) * 0.1
    dq, dk, dg = (torch.randn(B, T, H, K, device=dev) for _ in range(3))
    db = torch.randn(B, T, H, device=dev)
    args = (q, k, g, beta, dAqk, dAkk)
    ci = None if cu is None else prepare_chunk_indices(cu, BT)
    ref = fla_intra(*args, dq.clone(), dk.clone(), db.clone(), dg.clone(), cu_seqlens=cu, chunk_indices=ci,
                    chunk_size=BT, safe_gate=bounded, lower_bound=-5.0 if bounded else None)
    got = chunk_kda_bwd_intra(*args, dq, dk, db, dg, cu_seqlens=cu, chunk_indices=ci, chunk_size=BT)
    for name, x, y in zip(["dq", "dk", "db", "dg"], got, ref):
        assert torch.isfinite(x).all(), name
        err = ((x.double() - y.double()).norm() / y.double().norm()).item()
        assert err < 1e-4, f"{name}: relative error {err:.2e} against fla"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kda_intra_rounds_dq_dk_to_requested_dtype(device):
    """dq_dtype / dk_dtype: the kernel rounds its float32 sums once on store (the op asks for the inputs' bf16 and
    skips two cast passes). Compiled (GPU): bitwise what a cast of the float32 result gives (round to nearest
    even). The CPU interpreter's float32 -> bf16 conversion truncates instead, so there: within one bf16 ulp."""
    torch.manual_seed(0)
    inputs = [t.to(device) for t in _inputs(1, 40, 1, 16, 32, MILD)]
    full = chunk_kda_bwd_intra(*inputs, chunk_size=32)
    low = chunk_kda_bwd_intra(*inputs, chunk_size=32, dq_dtype=torch.bfloat16, dk_dtype=torch.bfloat16)
    assert (low[0].dtype, low[1].dtype, low[2].dtype, low[3].dtype) == (torch.bfloat16,) * 2 + (torch.float32,) * 2
    for name, a, b in zip(["dq", "dk", "db", "dg"], low, full):
        if device == "cuda" or a.dtype == torch.float32:
            assert torch.equal(a, b.to(a.dtype)), name
        else:
            torch.testing.assert_close(a.float(), b, rtol=2.0 ** -7, atol=0, msg=lambda m: f"{name}: {m}")


def test_kda_intra_rejects_mismatched_shapes():
    q, k, g, beta, dAqk, dAkk, dq, dk, db, dg = _inputs(1, 20, 2, 16, 16, MILD)
    with pytest.raises(ValueError, match=r"beta \[1, 20, 1\] do not match k"):
        chunk_kda_bwd_intra(q, k, g, beta[..., :1], dAqk, dAkk, dq, dk, db, dg, chunk_size=16)
    with pytest.raises(ValueError, match="chunk_size=24 must be a multiple of 16"):
        chunk_kda_bwd_intra(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size=24)
