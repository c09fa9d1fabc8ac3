"""scripts/replicate.py: the budget arithmetic, metrics parsing, table/plots, and (slow) the whole pipeline on CPU."""

from __future__ import annotations

import json
import math
import os

import pytest

from scripts import replicate as R


def test_plan_steps_fits_the_budget_exactly():
    fixed = {"softmax": 20.0, "parallax": 25.0}
    tps = {"softmax": 800_000.0, "parallax": 600_000.0}
    k = 65_536
    secs = 400.0
    steps = R.plan_steps(secs, fixed, tps, k)

    def cost(s):  # 2 softmax, 3 parallax, converted (s // 4), one parallax-sized GDN slot
        return 2 * (20 + s * k / 8e5) + 3 * (25 + s * k / 6e5) + (25 + s / 4 * k / 6e5) + (25 + s * k / 6e5)

    assert steps > 100
    assert cost(steps) <= secs < cost(steps + 1)
    assert R.plan_steps(100.0, fixed, tps, k) == 0  # fixed costs alone exceed the budget


def test_fit_steps_caps_and_floors():
    assert R.fit_steps(100.0, 10.0, 1000.0, 100, cap=10_000) == 900
    assert R.fit_steps(100.0, 10.0, 1000.0, 100, cap=50) == 50
    assert R.fit_steps(5.0, 10.0, 1000.0, 100, cap=50) == 0


def test_mechanism_of_each_run():
    assert {n: R.mechanism(n) for n in R.RUNS} == {
        "softmax_muon": "softmax", "parallax_muon": "parallax", "softmax_adamw": "softmax",
        "parallax_adamw": "parallax", "parallax_muon_wd2": "parallax", "converted": "parallax", "gdn_muon": "gdn"}
    assert list(R.RUNS).index("softmax_muon") < list(R.RUNS).index("converted") < list(R.RUNS).index("gdn_muon")


def test_read_metrics_median_tps_skips_step_one(tmp_path):
    recs = [{"step": 1, "loss": 9.0, "tps": 10.0}, {"step": 5, "loss": 8.0, "tps": 300.0},
            {"step": 10, "loss": 7.0, "tps": 100.0}, {"step": 15, "loss": 6.5, "tps": 200.0},
            {"step": 15, "val_loss": 6.9, "val_ppl": math.exp(6.9)}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    m = R.read_metrics(str(tmp_path))
    assert m == {"val_loss": 6.9, "val_ppl": math.exp(6.9), "train_loss": 6.5, "step": 15, "tps": 200.0}
    assert R.read_metrics(str(tmp_path / "missing")) == {}


def test_parse_args_rejects_unknown_runs():
    with pytest.raises(SystemExit):
        R.parse_args(["--corpus", "c", "--runs", "softmax_muon,nope"])
    assert R.parse_args(["--corpus", "c", "--budget-s", "520"]).budget_s == 520.0


def test_table_and_diagnostics_plot(tmp_path):
    rows = [{"run": "softmax_muon", "steps": 10, "tokens": 655_360, "ok": True, "seconds": 31.2, "val_ppl": 50.5,
             "val_loss": math.log(50.5)},
            {"run": "parallax_muon", "steps": 10, "tokens": 655_360, "ok": True, "seconds": 35.0, "val_ppl": 48.0,
             "val_loss": math.log(48.0), "cor": 0.5, "cpa": 0.25, "srank_wr": 12.0},
            {"run": "gdn_muon", "steps": 0, "tokens": 0, "ok": False, "seconds": 0.0, "error": "RuntimeError: no time"}]
    table = R.format_table(rows, {"tokens_per_step": 65536, "val_tokens": 262144, "compile": True, "device": "x"})
    lines = table.splitlines()
    assert lines[0].split()[:9] == ["run", "steps", "tokens", "val_ppl", "val_loss", "COR", "CPA", "srankWr", "s/run"]
    assert lines[3].split()[:10] == ["parallax_muon", "10", "655,360", "48.00", f"{math.log(48):.4f}", "0.500",
                                     "0.250", "12.00", "35", "ok"]
    assert "FAILED RuntimeError: no time" in lines[4]
    layers = [{"layer": i, "activations": {"cor": {"mean": 0.1 * i}, "entropy": {"mean": 2.0}}} for i in range(3)]
    os.makedirs(tmp_path / "parallax_muon" / "analysis")
    (tmp_path / "parallax_muon" / "analysis" / "analysis.json").write_text(json.dumps({"layers": layers}))
    path = R.plot_diagnostics(str(tmp_path), ["softmax_muon", "parallax_muon"])
    assert path and os.path.getsize(path) > 1000
    assert R.plot_diagnostics(str(tmp_path), ["softmax_muon"]) is None


def _tiny_corpus(folder):
    import gzip

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    for name, n in (("train-00.jsonl.gz", 60), ("val.jsonl.gz", 12)):
        with gzip.open(folder / name, "wt", encoding="utf-8") as f:
            for i in range(n):
                text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40 + i % 13))
                f.write(json.dumps({"text": text}) + "\n")


def test_tokenizer_is_trained_and_cached(tmp_path):
    _tiny_corpus(tmp_path)
    out = R.train_tokenizer(str(tmp_path), str(tmp_path / "tok"), 300, 20)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert tok.token_to_id("<|bos|>") is not None and 260 <= tok.get_vocab_size() <= 300
    mtime = os.path.getmtime(os.path.join(out, "tokenizer.json"))
    R.train_tokenizer(str(tmp_path), str(tmp_path / "tok"), 300, 20)  # cached: not rewritten
    assert os.path.getmtime(os.path.join(out, "tokenizer.json")) == mtime


@pytest.mark.slow
def test_pipeline_end_to_end_cpu(tmp_path):
    """softmax_muon → parallax_muon → converted (via convert_to_parallax.py) on the debug flavor, with analyses,
    plots, the table, and checkpoints removed at the end (minutes on a busy 2-core machine)."""
    _tiny_corpus(tmp_path)
    out = tmp_path / "out"
    rows = R.main(["--corpus", str(tmp_path), "--out", str(out), "--flavor", "debug", "--steps", "4", "--batch", "2",
                   "--seq-len", "32", "--vocab", "300", "--tokenizer-docs", "40", "--val-tokens", "64",
                   "--runs", "parallax_muon,converted", "--timeout", "900"])
    assert [r["run"] for r in rows] == ["softmax_muon", "parallax_muon", "converted"]
    assert all(r["ok"] for r in rows), rows
    assert [r["steps"] for r in rows] == [4, 4, 1] and rows[0]["tokens"] == 4 * 2 * 32
    assert all(math.isfinite(r["val_loss"]) for r in rows)
    assert rows[1]["cor"] is not None and rows[2]["srank_wr"] is not None
    for f in ("summary.json", "table.txt", "ppl.png", "diagnostics_by_layer.png", "converted/analysis/cor.png"):
        assert (out / f).is_file(), f
    assert not (out / "softmax_muon" / "checkpoint").exists() and not (out / "converted_init").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_tokens"] == 64 and len(summary["runs"]) == 3


def test_plan_steps_counts_only_the_requested_runs():
    fixed, tps, k = {"parallax": 10.0}, {"parallax": 1000.0}, 100  # softmax borrows parallax's numbers
    # softmax_muon + converted: 2 fixed costs, 1.25 * steps * 0.1 s
    assert R.plan_steps(60.0, fixed, tps, k, ["softmax_muon", "converted"]) == 320
