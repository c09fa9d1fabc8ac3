"""Muon: Newton–Schulz spectra against a float64 SVD, bit equality with torch.optim.Muon, per-block splits."""

import math

import pytest
import torch

import attnlab.optim.muon as muon_mod
from attnlab.optim.muon import Blocks, Muon, newton_schulz, resolve_ns_coefficients, update_scale

# (coefficients, dtype, band of converged singular values, max off-diagonal of Uᵀ O V)
NS_CASES = [
    ("quintic", torch.bfloat16, (0.6, 1.25), 0.2),
    ("quintic", torch.float32, (0.6, 1.25), 1e-4),
    ("polar_express", torch.bfloat16, (0.8, 1.2), 0.2),
    ("polar_express", torch.float32, (0.8, 1.2), 1e-4),
]


@pytest.mark.parametrize("spec,dtype,band,off_tol", NS_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("shape", [(48, 80), (80, 48)], ids=["wide48x80", "tall80x48"])
def test_newton_schulz_random_band(spec, dtype, band, off_tol, shape):
    coeffs, safety = resolve_ns_coefficients(spec, 5)
    G = torch.randn(*shape, dtype=torch.float64)
    O = newton_schulz(G.float(), coeffs, dtype, 1e-7, safety)
    assert O.dtype == dtype and O.shape == G.shape
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    D = U.T @ O.double() @ Vh.T  # [r, r]: diagonal iff O shares G's singular vectors
    lo, hi = band
    assert lo <= D.diagonal().min() and D.diagonal().max() <= hi
    assert (D - torch.diag(D.diagonal())).abs().max() < off_tol


@pytest.mark.parametrize("spec,dtype,band,off_tol", NS_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_newton_schulz_ill_conditioned(spec, dtype, band, off_tol):
    """σ from 1 to 1e-6: σ/‖G‖_F > 3e-3 converge into the band, the rest stay in [0, hi] (never blow up)."""
    coeffs, safety = resolve_ns_coefficients(spec, 5)
    U, _, Vh = torch.linalg.svd(torch.randn(64, 64, dtype=torch.float64))
    sig = torch.logspace(0, -6, 64, dtype=torch.float64)
    G = (U * sig) @ Vh
    O = newton_schulz(G.float(), coeffs, dtype, 1e-7, safety).double()
    d = (U.T @ O @ Vh.T).diagonal()
    lo, hi = band
    converged = sig / sig.norm() > 3e-3
    assert lo <= d[converged].min() and d.max() <= hi
    assert d[~converged].min() >= -0.05
    assert torch.isfinite(O).all()


def test_newton_schulz_batched_equals_loop():
    coeffs, _ = resolve_ns_coefficients("quintic", 5)
    G = torch.randn(3, 24, 40)
    batched = newton_schulz(G, coeffs, torch.float32)
    for i in range(3):
        torch.testing.assert_close(batched[i], newton_schulz(G[i], coeffs, torch.float32), rtol=1e-5, atol=1e-6)


def test_resolve_coefficients():
    assert resolve_ns_coefficients("quintic", 3) == (((3.4445, -4.775, 2.0315),) * 3, 1.0)
    steps, safety = resolve_ns_coefficients("1,2,3;4,5,6", 3)
    assert steps == ((1, 2, 3), (4, 5, 6), (4, 5, 6)) and safety == 1.0
    assert resolve_ns_coefficients("polar_express", 5)[1] == 1.02
    with pytest.raises(ValueError, match="optimizer.muon_ns_coefficients"):
        resolve_ns_coefficients("cubic", 5)
    with pytest.raises(ValueError, match="optimizer.muon_ns_steps"):
        resolve_ns_coefficients("polar_express", 6)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=["wide", "tall"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("scale,torch_fn", [("spectral", "original"), ("match_rms_adamw", "match_rms_adamw")])
def test_matches_torch_muon(shape, nesterov, scale, torch_fn):
    """Three steps on one matrix are bit-identical to torch.optim.Muon (EMA momentum, bf16 NS)."""
    w0 = torch.randn(*shape)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, ns_steps=5)
    ours = Muon([a], update_scale=scale, **kw)
    ref = torch.optim.Muon([b], adjust_lr_fn=torch_fn, **kw)
    for _ in range(3):
        g = torch.randn(*shape)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert torch.equal(a, b)
    assert not torch.equal(a, w0)


def test_step_against_float64_formula():
    """Independent re-derivation: W ← W(1 − lrλ) − lr·s·NS(Nesterov(B)) with NS in float64."""
    torch.manual_seed(1)
    rows, cols, lr, wd, mu = 40, 24, 0.05, 0.1, 0.9
    p = torch.nn.Parameter(torch.randn(rows, cols))
    opt = Muon([p], lr=lr, weight_decay=wd, momentum=mu, ns_dtype="float32")
    w, buf = p.detach().double().clone(), torch.zeros(rows, cols, dtype=torch.float64)
    coeffs, _ = resolve_ns_coefficients("quintic", 5)
    for _ in range(2):
        g = torch.randn(rows, cols)
        p.grad = g.clone()
        opt.step()
        buf = mu * buf + (1 - mu) * g.double()
        u = (1 - mu) * g.double() + mu * buf
        o = newton_schulz(u, coeffs, torch.float64)
        w = w * (1 - lr * wd) - lr * math.sqrt(rows / cols) * o
    torch.testing.assert_close(p.detach().double(), w, rtol=0, atol=2e-5)


def test_blocks_are_separate_matrices():
    """A [q|k|v]-style fused weight split into row blocks equals three separate Muon matrices."""
    sizes = (16, 8, 8)
    w0 = torch.randn(sum(sizes), 20)
    fused = torch.nn.Parameter(w0.clone())
    parts = [torch.nn.Parameter(t.clone()) for t in w0.split(sizes)]
    opt_f = Muon([fused], lr=0.02, ns_dtype="float32", blocks={fused: Blocks(0, sizes)})
    opt_p = Muon(parts, lr=0.02, ns_dtype="float32")
    for _ in range(2):
        g = torch.randn_like(w0)
        fused.grad = g.clone()
        for p, gi in zip(parts, g.split(sizes)):
            p.grad = gi.clone()
        opt_f.step()
        opt_p.step()
    torch.testing.assert_close(fused.detach(), torch.cat([p.detach() for p in parts]), rtol=1e-5, atol=1e-6)


def test_same_shape_matrices_batched_equal_separate_optimizers():
    """The step batches Newton–Schulz over same-shape matrices (and blocks); each result must equal the
    matrix's own one-parameter Muon. Mixed shapes, a blocked parameter and two groups in one optimizer."""
    torch.manual_seed(0)
    shapes = [(24, 40), (24, 40), (40, 24), (24, 40), (12, 40)]
    ws = [torch.randn(s) for s in shapes]
    together = [torch.nn.Parameter(w.clone()) for w in ws]
    groups = [{"params": together[:3]}, {"params": together[3:], "lr": 0.01, "weight_decay": 0.0}]
    blocks = {together[3]: Blocks(0, (12, 12))}  # two 12x40 blocks batch with the plain 12x40 matrix
    opt = Muon(groups, lr=0.02, ns_dtype="float32", blocks=blocks)
    alone, opts = [], []
    for i, w in enumerate(ws):
        p = torch.nn.Parameter(w.clone())
        kw = dict(lr=0.01, weight_decay=0.0) if i >= 3 else dict(lr=0.02)
        opts.append(Muon([p], ns_dtype="float32", blocks={p: Blocks(0, (12, 12))} if i == 3 else None, **kw))
        alone.append(p)
    for _ in range(3):
        for p, q in zip(together, alone):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        for o in opts:
            o.step()
    for p, q in zip(together, alone):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_update_scale_values():
    assert update_scale(3072, 1024, "spectral") == math.sqrt(3)  # alias of sqrt_max1_rows_over_cols
    assert update_scale(1024, 3072, "spectral") == 1.0
    for rows, cols in ((3072, 1024), (1024, 3072), (512, 512)):
        assert update_scale(rows, cols, "sqrt_max1_rows_over_cols") == math.sqrt(max(1, rows / cols))
        assert update_scale(rows, cols, "sqrt_fan_out_over_fan_in") == math.sqrt(rows / cols)
    assert update_scale(1024, 3072, "match_rms_adamw") == pytest.approx(0.2 * math.sqrt(3072))
    with pytest.raises(ValueError, match="optimizer.muon_update_scale"):
        update_scale(4, 4, "rms")


def test_rejects_non_matrix():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.randn(4))])


def test_tall_and_wide_batch_together_within_bf16(monkeypatch):
    """A tall matrix joins the batch of its transposed (wide) shape; in the default bf16 Newton–Schulz the batched
    update equals each matrix's own one-parameter Muon within bf16 rounding."""
    torch.manual_seed(1)
    shapes = [(32, 64), (64, 32), (64, 32), (32, 64)]  # like wo (1024x2048) and wq (2048x1024)
    together = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    alone = [torch.nn.Parameter(p.detach().clone()) for p in together]
    opt = Muon(together, lr=0.02)
    opts = [Muon([p], lr=0.02) for p in alone]
    calls = []
    ns = muon_mod.newton_schulz
    monkeypatch.setattr(muon_mod, "newton_schulz",
                        lambda G, *a, **kw: (calls.append(tuple(G.shape)), ns(G, *a, **kw))[1])
    for _ in range(3):
        for p, q in zip(together, alone):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        calls.clear()
        opt.step()
        assert calls == [(4, 32, 64)]  # one batched call for all four
        for o in opts:
            o.step()
    for p, q in zip(together, alone):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=2e-3)  # lr 0.02 x bf16's 2^-8 x ~|O|


def _one_step_update(shape, scale, blocks=None):
    """W_before − W_after of one Muon step (no weight decay, float32 NS) on a fixed gradient."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(*shape))
    g = torch.randn(*shape)
    w0 = p.detach().clone()
    opt = Muon([p], lr=0.1, weight_decay=0.0, ns_dtype="float32", update_scale=scale,
               blocks={p: blocks} if blocks else None)
    p.grad = g
    opt.step()
    return w0 - p.detach()


@pytest.mark.parametrize("rows,cols", [(48, 16), (16, 48)], ids=["tall", "wide"])
def test_fan_out_over_fan_in_vs_max1_ratio(rows, cols):
    """PyTorch weights are [out, in]: Dion's √(fan_out/fan_in) equals √max(1, rows/cols) on a tall matrix and is
    √(rows/cols) of it on a wide one."""
    jordan = _one_step_update((rows, cols), "sqrt_max1_rows_over_cols")
    dion = _one_step_update((rows, cols), "sqrt_fan_out_over_fan_in")
    expected = 1.0 if rows >= cols else math.sqrt(rows / cols)
    torch.testing.assert_close(dion, jordan * expected)
    torch.testing.assert_close(_one_step_update((rows, cols), "spectral"), jordan, rtol=0, atol=0)


def test_update_scale_per_head_block():
    """Per-head mode scales each [head_dim, dim] block by its own shape: 16 × 64 blocks get √(16/64) = 0.5 from
    √(fan_out/fan_in) and 1 from √max(1, rows/cols)."""
    blocks = Blocks(0, (16,) * 4)
    jordan = _one_step_update((64, 64), "sqrt_max1_rows_over_cols", blocks)
    dion = _one_step_update((64, 64), "sqrt_fan_out_over_fan_in", blocks)
    torch.testing.assert_close(dion, 0.5 * jordan)
    whole = _one_step_update((64, 64), "sqrt_max1_rows_over_cols")
    assert not torch.allclose(whole, jordan)  # blocks are orthogonalised separately


def test_bad_update_scale_names_the_key():
    with pytest.raises(ValueError, match=r"optimizer.muon_update_scale='fan_ratio'.*sqrt_fan_out_over_fan_in"):
        Muon([torch.nn.Parameter(torch.randn(4, 4))], update_scale="fan_ratio")
