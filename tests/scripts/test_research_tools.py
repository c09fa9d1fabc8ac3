"""Research tools: analyze.py diagnostics, eval_ppl.py, synthetic task generators (CPU, tiny)."""

import json
import math

import pytest
import torch

from scripts import analyze, eval_ppl, synthetic
from tests.utils import read_metrics, run_train, tiny_args


def _flags(corpus, mech):
    return ["--model.attention", mech, "--model.vocab_size", "64", "--model.hf_assets_path", corpus["tokenizer"],
            "--training.seq_len", "16", "--validation.seq_len", "16"]


@pytest.fixture(scope="module")
def parallax_run(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("px")
    run_train(tiny_args(corpus, dump, 3, 16, 2, "--model.attention", "parallax", "--checkpoint.interval", "3"))
    return dump


def _analyze(run, corpus, mech, tmp_path):
    return analyze.main([str(run), "--data", corpus["val"], "--seq-len", "16", "--min-len", "8", "--rows", "3",
                         "--queries", "6", "-o", str(tmp_path), "--no-plots", "--", *_flags(corpus, mech)])


def test_analyze_parallax_keys_finite_and_json(parallax_run, corpus, tmp_path):
    res = _analyze(parallax_run, corpus, "parallax", tmp_path)
    saved = json.loads((tmp_path / "analysis.json").read_text())
    assert saved["step"] == 3 and len(saved["layers"]) == 4
    for layer in saved["layers"]:
        assert set(layer["activations"]) == set(analyze.ACTIVATION_KEYS)
        for v in layer["activations"].values():
            assert math.isfinite(v["mean"]) and all(math.isfinite(x) for x in v["quantiles"].values())
            assert len(v["head_mean"]) == 4
        assert set(layer["stable_rank"]) == {"wq", "wk", "wv", "wo", "wr", "qk_circuit", "ov_circuit", "rk_circuit"}
    s = res["summary"]
    assert s["cor"] > 0 and 0 < s["cpa"] <= 1 + 1e-9 and 0 < s["sink_p"] < 1


def test_analyze_softmax_subset_and_plots(corpus, tmp_path):
    dump = tmp_path / "sm"
    run_train(tiny_args(corpus, dump, 2, 16, 2, "--checkpoint.interval", "2"))
    analyze.main([str(dump), "--data", corpus["val"], "--seq-len", "16", "--min-len", "8", "--rows", "2",
                  "--queries", "4", "-o", str(tmp_path / "out"), "--", *_flags(corpus, "softmax")])
    saved = json.loads((tmp_path / "out" / "analysis.json").read_text())
    for layer in saved["layers"]:
        assert set(layer["activations"]) == {"entropy", "sink_p", "sink", "kv_corr"}
        assert "wr" not in layer["stable_rank"] and len(layer["stable_rank"]["qk_circuit"]) == 4
    assert (tmp_path / "out" / "entropy.png").is_file() and not (tmp_path / "out" / "cor.png").exists()


def test_cor_is_exactly_zero_when_wr_is_zero(parallax_run, corpus):
    from models.checkpoint_io import load_model

    model, cfg, _ = load_model(parallax_run, _flags(corpus, "parallax"))
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wr.weight.zero_()
    rows = [torch.tensor([0, 5, 9, 12, 7, 30, 31, 4, 8, 2, 11])]
    res = analyze.analyze(model, rows, n_queries=5, min_pos=2)
    for layer in res["layers"]:
        a = layer["activations"]
        assert a["cor"]["mean"] == 0.0 and a["cor"]["quantiles"]["0.99"] == 0.0
        assert a["probe_norm"]["mean"] == 0.0 and a["cpa"]["mean"] == 0.0
        # with ρ = 0 the Parallax weights are the softmax weights: score sink = p_i1² / Σ p_ij² ≥ 0, range = max p - min p
        assert a["score_min"]["quantiles"]["0.01"] >= 0.0


def test_stable_rank_known_matrices():
    assert analyze.stable_rank(torch.diag(torch.tensor([3.0, 1.0, 1.0]))) == pytest.approx(11 / 9, rel=1e-12)
    u = torch.linalg.qr(torch.randn(7, 7, dtype=torch.float64)).Q
    w = u[:, :3] @ torch.diag(torch.tensor([2.0, 2.0, 1.0], dtype=torch.float64)) @ u[:3]  # rank 3, σ = 2, 2, 1
    assert analyze.stable_rank(w) == pytest.approx(9 / 4, rel=1e-10)
    a, b = torch.randn(4, 9, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    assert analyze.circuit_stable_rank(a, b) == pytest.approx(analyze.stable_rank(a.T @ b), rel=1e-9)


def test_head_diagnostics_match_explicit_loops():
    torch.manual_seed(0)
    T, D = 11, 5
    q, k, v, r = (torch.randn(T, D, dtype=torch.float64) for _ in range(4))
    k[0] = 3 * q.mean(0)  # a key most queries like: a visible sink
    queries = torch.tensor([3, 6, 10])
    d = analyze.head_diagnostics(q, k, v, r, 0.7, queries, ridge=0.0)
    for n, i in enumerate(queries.tolist()):
        logits = torch.tensor([0.7 * float(q[i] @ k[j]) for j in range(i + 1)], dtype=torch.float64)
        p = torch.softmax(logits, 0)
        vbar = sum(p[j] * v[j] for j in range(i + 1))
        kbar = sum(p[j] * k[j] for j in range(i + 1))
        skv = sum(p[j] * torch.outer(v[j] - vbar, k[j] - kbar) for j in range(i + 1))
        t = torch.stack([r[i] @ k[j] for j in range(i + 1)])
        s = p * (1 + (p * t).sum() - t)
        assert torch.allclose(sum(s[j] * v[j] for j in range(i + 1)), vbar - skv @ r[i], atol=1e-10)  # eq. (8)
        assert d["cor"][n] == pytest.approx(float((skv @ r[i]).norm() / vbar.norm()), rel=1e-9)
        assert d["cpa"][n] == pytest.approx(float((skv @ r[i]).norm() / (r[i].norm() * torch.linalg.matrix_norm(skv, 2))), rel=1e-9)
        assert d["sink_p"][n] == pytest.approx(float(p[0]), rel=1e-12)
        assert d["sink"][n] == pytest.approx(float(s[0] ** 2 / (s**2).sum()), rel=1e-9)
        assert d["score_range"][n] == pytest.approx(float(s.max() - s.min()), rel=1e-9)
        assert d["entropy"][n] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-9)
        if i + 1 > D:  # full-rank covariances: the canonical correlations are at most 1 each
            assert float(d["kv_corr"][n]) <= math.sqrt(D) + 1e-6


def test_sink_hand_built():
    """One key dominates every softmax row: p_i1 → 1 and, with ρ = 0, the Parallax share → 1 too."""
    T, D = 6, 2
    q = torch.tensor([[10.0, 0.0]]).repeat(T, 1)
    k = torch.tensor([[10.0, 0.0]] + [[0.0, 1.0]] * (T - 1))
    v = torch.randn(T, D)
    d = analyze.head_diagnostics(q, k, v, torch.zeros(T, D), 1.0, torch.arange(1, T))
    assert torch.allclose(d["sink_p"], torch.ones(T - 1, dtype=torch.float64), atol=1e-30)
    assert torch.allclose(d["sink"], torch.ones(T - 1, dtype=torch.float64))
    # uniform keys: p_i1 = 1/(i+1) exactly
    d = analyze.head_diagnostics(q, torch.zeros(T, D), v, None, 1.0, torch.arange(T))
    assert torch.allclose(d["sink_p"], 1 / torch.arange(1, T + 1, dtype=torch.float64))


def test_eval_ppl_matches_trainer_validation(parallax_run, corpus, tmp_path):
    """Validation in the trainer (2 steps × batch 2 × seq 16 at step 3) is an independent computation."""
    out = tmp_path / "ppl.json"
    res = eval_ppl.main([str(parallax_run), "--data", corpus["val"], "--batch-size", "2", "--max-rows", "4",
                         "--no-progress", "-o", str(out), "--", *_flags(corpus, "parallax")])
    val = [r for r in read_metrics(parallax_run) if "val_loss" in r and r["step"] == 3][-1]
    assert res["tokens"] == 64 and res["loss"] == pytest.approx(val["val_loss"], rel=1e-5)
    assert json.loads(out.read_text())["ppl"] == pytest.approx(math.exp(res["loss"]))


def test_eval_ppl_equals_exp_mean_loss_by_hand(parallax_run, corpus):
    from data.loader import build_tokenizer
    from models.checkpoint_io import load_model

    model, cfg, _ = load_model(parallax_run, _flags(corpus, "parallax"))
    tok = build_tokenizer(cfg)
    stream = []
    for line in open(corpus["val"]):
        stream += tok.encode(json.loads(line)["text"], add_bos=True, add_eos=True)
    rows = [torch.tensor(stream[i * 17:(i + 1) * 17]) for i in range(3)]
    nll = []
    with torch.no_grad():
        for row in rows:  # documents are 17 tokens with BOS/EOS: one document per row, plain causal
            logits = model(row[None, :-1])[0].double()
            nll += (-torch.log_softmax(logits, -1)[torch.arange(16), row[1:]]).tolist()
    res = eval_ppl.evaluate(model, eval_ppl.packed_rows(corpus["val"], cfg, tok, 16), 2, 3, progress=False)
    assert res["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)


@pytest.mark.parametrize("task", synthetic.TASKS)
def test_synthetic_generators_structure(task):
    spec = synthetic.TaskSpec(vocab=16, seq_len=48, n_copy=8)
    x, y = synthetic.GENERATORS[task](spec, 5, torch.Generator().manual_seed(3))
    assert x.dtype == torch.long and x.min() >= 0 and x.max() < spec.vocab_size()
    scored = y != synthetic.IGNORE
    assert scored.any()
    if task == "compression":
        assert torch.equal(y, x[:, :-1]) and (x[:, -1] == synthetic.MARK).all()
        return
    assert x.shape == y.shape == (5, 48)
    for b in range(5):
        for t in scored[b].nonzero().flatten().tolist():
            target = int(y[b, t])
            if task in ("recall", "noisy_recall", "mqar"):  # the value follows the same key earlier in context
                key = int(x[b, t])
                earlier = [int(x[b, j + 1]) for j in range(t) if int(x[b, j]) == key]
                assert earlier and earlier[-1] == target
            elif task == "fuzzy_recall":  # the preceding key span occurred earlier, followed by the target
                assert target in x[b, :t].tolist()
            elif task == "selective_copy":  # copy order: the k-th scored position gets the k-th data token
                L = spec.seq_len - spec.n_copy
                data = [int(tk) for tk in x[b, : L - 1] if tk != synthetic.BLANK]
                assert target == data[t - (L - 1)]
            elif task == "memorization":
                assert t % 2 == 0 and target == int(x[b, t + 1])


def test_memorization_map_is_global():
    spec = synthetic.TaskSpec(vocab=16, seq_len=32)
    seen = {}
    for seed in (1, 2):
        x, y = synthetic.gen_memorization(spec, 4, torch.Generator().manual_seed(seed))
        for k, v in zip(x[:, 0::2].flatten().tolist(), y[:, 0::2].flatten().tolist()):
            assert seen.setdefault(k, v) == v


@pytest.mark.slow  # ~10 s on an idle 2-core machine, over a minute under load
def test_softmax_learns_in_context_recall():
    spec = synthetic.TaskSpec(vocab=8, seq_len=24)  # 4 keys, 4 values: chance = 0.25
    r = synthetic.train_task("recall", "softmax", spec, steps=40, batch=16, lr=2e-2, eval_batch=64)
    assert r["acc"] > 0.5, r


def test_eval_and_analyze_rebuild_the_run_from_its_config_toml(parallax_run, corpus, tmp_path):
    """Without any training flag a Parallax run is evaluated as Parallax (it was silently built as softmax): the
    training run itself leaves config.toml and its tokenizer; a copy without them needs the flags."""
    import shutil

    run = parallax_run
    assert (run / "config.toml").is_file() and (run / "tokenizer" / "tokenizer.json").is_file()
    bare = tmp_path / "bare"
    shutil.copytree(run / "checkpoint", bare / "checkpoint")
    explicit = eval_ppl.main([str(bare), "--data", corpus["val"], "--batch-size", "2", "--max-rows", "4",
                              "--no-progress", "--", *_flags(corpus, "parallax")])
    res = eval_ppl.main([str(run), "--data", corpus["val"], "--batch-size", "2", "--max-rows", "4", "--no-progress"])
    assert res["attention"] == "parallax" and res["loss"] == explicit["loss"]
    assert res["checkpoint"].endswith("step-3") and res["step"] == 3
    res = eval_ppl.main([str(run / "checkpoint" / "step-3"), "--data", corpus["val"], "--max-rows", "2",
                         "--no-progress"])  # a step folder finds its run's config too
    assert res["attention"] == "parallax"
    out = analyze.main([str(run), "--step", "3", "--data", corpus["val"], "--seq-len", "16", "--min-len", "8",
                        "--rows", "2", "--queries", "4", "-o", str(tmp_path / "an"), "--no-plots"])
    assert out["attention"] == "parallax" and "cor" in out["layers"][0]["activations"]
    with pytest.raises(SystemExit):
        eval_ppl.main([str(run), "--step", "7", "--data", corpus["val"]])  # no step-7: one clear error
    with pytest.raises(SystemExit) as e:
        eval_ppl.main([str(run), "--data", corpus["val"], "--model.attention", "softmax"])  # unknown flag
    assert e.value.code == 2


def test_analyze_records_rho_gain_and_probe_norm_per_layer(parallax_run, corpus):
    """A uniform ρ-norm gain g gives ‖ρ_i‖ = √head_dim · g at every query; both land per layer and in the summary."""
    from models.checkpoint_io import load_model

    model, cfg, _ = load_model(parallax_run, _flags(corpus, "parallax"))
    with torch.no_grad():
        for i, layer in model.layers.items():
            layer.attention.r_norm.weight.fill_(0.25 * (1 + int(i)))
    res = analyze.analyze(model, [torch.tensor([0, 5, 9, 12, 7, 30, 31, 4, 8, 2, 11])], n_queries=5, min_pos=2)
    for layer in res["layers"]:
        g = 0.25 * (1 + layer["layer"])
        assert layer["rho_norm_gain"] == pytest.approx({"mean": g, "min": g, "max": g})
        hd = model.layers[str(layer["layer"])].attention.head_dim
        assert layer["activations"]["probe_norm"]["mean"] == pytest.approx(math.sqrt(hd) * g, rel=1e-3)
    assert res["summary"]["rho_gain"] == pytest.approx(0.25 * (1 + 2 + 3 + 4) / 4)
