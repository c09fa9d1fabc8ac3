"""benchmarks/replicate/: the budget arithmetic, metrics parsing, table/plots, and (slow) the whole pipeline on CPU."""

from __future__ import annotations

import json
import math
import os

import pytest

from benchmarks.replicate import run as replicate_run
from benchmarks.replicate.__main__ import main, parse_args
from benchmarks.replicate.metrics import (finished_at, read_metrics, resumable_step, summary_rows, truncate_metrics,
                                          write_summary)
from benchmarks.replicate.evaluate import EVAL_FILE, columns
from benchmarks.replicate.plan import (LONG_MECHANISMS, PAPER_ARMS, RHO_NORM_LR_1X, RUNS, chunk_stop, excluded,
                                       fit_steps, mechanism, plan_steps, suite_arms)
from benchmarks.replicate.report import arm_rows, format_table, plot_diagnostics, registry_rows
from benchmarks.replicate.run import train_tokenizer


def test_plan_steps_fits_the_budget_exactly():
    fixed = {"softmax": 20.0, "parallax": 25.0}
    tps = {"softmax": 800_000.0, "parallax": 600_000.0}
    k = 65_536
    secs = 400.0
    steps = plan_steps(secs, fixed, tps, k)

    def cost(s):  # 2 softmax, 3 parallax, converted (s // 4), one parallax-sized GDN slot
        return 2 * (20 + s * k / 8e5) + 3 * (25 + s * k / 6e5) + (25 + s / 4 * k / 6e5) + (25 + s * k / 6e5)

    assert steps > 100
    assert cost(steps) <= secs < cost(steps + 1)
    assert plan_steps(100.0, fixed, tps, k) == 0  # fixed costs alone exceed the budget


def test_fit_steps_caps_and_floors():
    assert fit_steps(100.0, 10.0, 1000.0, 100, cap=10_000) == 900
    assert fit_steps(100.0, 10.0, 1000.0, 100, cap=50) == 50
    assert fit_steps(5.0, 10.0, 1000.0, 100, cap=50) == 0


def test_mechanism_of_each_run():
    assert {n: mechanism(RUNS[n]) for n in RUNS} == {
        "softmax_muon": "softmax", "parallax_muon": "parallax", "softmax_adamw": "softmax",
        "parallax_adamw": "parallax", "parallax_muon_wd2": "parallax", "converted": "parallax", "gdn_muon": "gdn"}
    assert list(RUNS).index("softmax_muon") < list(RUNS).index("converted") < list(RUNS).index("gdn_muon")
    # the replication keeps the paper's ρ-norm gain whatever the framework default
    for name, flags in RUNS.items():
        gain = flags[flags.index("--attention.parallax.rho_norm_init") + 1] if mechanism(flags) == "parallax" else None
        assert gain == ("1" if mechanism(flags) == "parallax" else None), name


def test_read_metrics_median_tps_skips_step_one(tmp_path):
    recs = [{"step": 1, "loss": 9.0, "tps": 10.0}, {"step": 5, "loss": 8.0, "tps": 300.0},
            {"step": 10, "loss": 7.0, "tps": 100.0}, {"step": 15, "loss": 6.5, "tps": 200.0},
            {"step": 15, "val_loss": 6.9, "val_ppl": math.exp(6.9)}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    m = read_metrics(str(tmp_path))
    assert m == {"val_loss": 6.9, "val_ppl": math.exp(6.9), "train_loss": 6.5, "step": 15, "val_step": 15,
                 "tps": 200.0, "mem_gib": None, "spike": 0.0, "gnorm_spike": None}
    assert read_metrics(str(tmp_path / "missing")) == {}
    # finished = validated at the last step, although the last logged training step can be earlier
    assert finished_at(m, 15) and not finished_at(m, 16) and not finished_at({"step": 15}, 15)


def test_parse_args_rejects_unknown_runs():
    with pytest.raises(SystemExit):
        parse_args(["--corpus", "c", "--runs", "softmax_muon,nope"])
    assert parse_args(["--corpus", "c", "--budget-s", "520"]).budget_s == 520.0


def test_table_and_diagnostics_plot(tmp_path):
    rows = [{"run": "softmax_muon", "steps": 10, "tokens": 655_360, "ok": True, "seconds": 31.2, "val_ppl": 50.5,
             "val_loss": math.log(50.5)},
            {"run": "parallax_muon", "steps": 10, "tokens": 655_360, "ok": True, "seconds": 35.0, "val_ppl": 48.0,
             "val_loss": math.log(48.0), "cor": 0.5, "cpa": 0.25, "probe_norm": 8.0, "rho_gain": 1.0, "srank_wr": 12.0},
            {"run": "gdn_muon", "steps": 0, "tokens": 0, "ok": False, "seconds": 0.0, "error": "RuntimeError: no time"},
            {"run": "parallax_g0.1_rnormlr1_muon_s0", "steps": 10, "tokens": 655_360, "ok": False, "seconds": 9.0,
             "paused": 4, "error": "paused at step 4/10 (no time left); the same command resumes it"}]
    table = format_table(rows, {"tokens_per_step": 65536, "val_tokens": 262144, "compile": True, "device": "x"})
    lines = table.splitlines()
    assert lines[0].split()[:11] == ["run", "steps", "tokens", "val_ppl", "val_loss", "COR", "CPA", "|rho|", "gain",
                                     "srankWr", "s/run"]
    assert lines[3].split()[:12] == ["parallax_muon", "10", "655,360", "48.00", f"{math.log(48):.4f}", "0.500",
                                     "0.250", "8.00", "1.000", "12.00", "35", "ok"]
    assert "FAILED RuntimeError: no time" in lines[4]
    assert lines[5].split()[:2] == ["parallax_g0.1_rnormlr1_muon_s0", "10"] and "paused at step 4/10" in lines[5]
    assert "FAILED" not in lines[5]
    layers = [{"layer": i, "activations": {"cor": {"mean": 0.1 * i}, "entropy": {"mean": 2.0}},
               "rho_norm_gain": {"mean": 1.0}} for i in range(3)]
    os.makedirs(tmp_path / "parallax_muon" / "analysis")
    (tmp_path / "parallax_muon" / "analysis" / "analysis.json").write_text(json.dumps({"layers": layers}))
    path = plot_diagnostics(str(tmp_path), ["softmax_muon", "parallax_muon"])
    assert path and os.path.getsize(path) > 1000
    assert plot_diagnostics(str(tmp_path), ["softmax_muon"]) is None


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
    out = train_tokenizer(str(tmp_path), str(tmp_path / "tok"), 300, 20)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert tok.token_to_id("<|bos|>") is not None and 260 <= tok.get_vocab_size() <= 300
    mtime = os.path.getmtime(os.path.join(out, "tokenizer.json"))
    train_tokenizer(str(tmp_path), str(tmp_path / "tok"), 300, 20)  # cached: not rewritten
    assert os.path.getmtime(os.path.join(out, "tokenizer.json")) == mtime


@pytest.mark.slow
def test_pipeline_end_to_end_cpu(tmp_path):
    """softmax_muon → parallax_muon → converted (via convert_to_parallax.py) on the debug flavor, with analyses,
    plots, the table, and checkpoints removed at the end (minutes on a busy 2-core machine)."""
    _tiny_corpus(tmp_path)
    out = tmp_path / "out"
    rows = main(["--corpus", str(tmp_path), "--out", str(out), "--flavor", "debug", "--steps", "4", "--batch", "2",
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
    assert plan_steps(60.0, fixed, tps, k, ["softmax_muon", "converted"]) == 320


def test_suite_arms_flags():
    dose = suite_arms("dose", [1.0, 0.3, 0.1], 0.1, [])
    assert list(dose) == ["softmax_muon", "parallax_g1_muon", "parallax_g0.3_muon", "parallax_g0.1_muon",
                          "parallax_g0.1_rnormlr1_muon"]
    assert dose["parallax_g0.3_muon"] == ["--model.attention", "parallax", "--attention.parallax.rho_norm_init", "0.3"]
    assert dose["parallax_g0.1_rnormlr1_muon"][-2:] == ["--optimizer.lr_mult_patterns", r"\.r_norm\.=1"]
    assert not any("lr_mult" in f for a in list(dose)[:4] for f in dose[a])
    horizon = suite_arms("horizon", [], 0.3, [5e-4, 1e-3, 2e-3])
    assert list(horizon)[:4] == ["softmax_muon", "parallax_g1_muon", "parallax_g0.3_muon", "parallax_g0.3_rnormlr1_muon"]
    assert horizon["parallax_g0.3_rnormlr1_muon"] == [*horizon["parallax_g0.3_muon"], *RHO_NORM_LR_1X]
    assert len(horizon) == 4 + 6
    assert not any("warmup" in f for a in horizon for f in horizon[a])
    warm = suite_arms("horizon", [], 0.1, [1e-3], adamw_warmup=80)
    assert list(warm)[4:] == ["softmax_adamw_lr0.001_wu80", "parallax_g1_adamw_lr0.001_wu80"]
    assert warm["softmax_adamw_lr0.001_wu80"][-2:] == ["--lr_scheduler.warmup_steps", "80"]
    flags = horizon["parallax_g1_adamw_lr0.002"]
    assert flags[flags.index("--optimizer.name") + 1] == "adamw" and flags.count("--optimizer.lr") == 1
    assert flags[flags.index("--optimizer.lr") + 1] == "0.002"
    sweep = suite_arms("adamw", [], 0.3, [5e-4, 1e-3])
    assert list(sweep) == ["softmax_adamw_lr0.0005", "parallax_g1_adamw_lr0.0005", "softmax_adamw_lr0.001",
                           "parallax_g1_adamw_lr0.001"]
    assert sweep["parallax_g1_adamw_lr0.001"] == horizon["parallax_g1_adamw_lr0.001"]
    context = suite_arms("context", [], 0.1, [])
    assert len(context) == 6 and context["parallax_g0.1_muon_causal"][-2:] == ["--model.attn_mask_type", "causal"]
    assert context["softmax_muon_block_causal"][-1] == "block_causal"


def test_parse_args_suites():
    a = parse_args(["--corpus", "c", "--suite", "context", "--seeds", "0,1", "--runs", "softmax_muon_causal"])
    assert (a.seq_len, a.batch, a.steps, a.seeds) == (4096, 16, 160, [0, 1])
    a = parse_args(["--corpus", "c", "--suite", "horizon", "--steps", "20", "--batch", "2"])
    assert (a.seq_len, a.batch, a.steps) == (1024, 2, 20)
    assert (parse_args(["--corpus", "c"]).steps, parse_args(["--corpus", "c"]).batch) == (300, 64)
    for bad in (["--suite", "dose", "--runs", "softmax_adamw"], ["--suite", "dose", "--seeds", "a"],
                ["--suite", "nope"]):
        with pytest.raises(SystemExit):
            parse_args(["--corpus", "c", *bad])


def test_chunk_stop():
    assert chunk_stop(0, 160, 0, None, 0, 0, 100) == 160  # no budget, no chunk: the whole run
    assert chunk_stop(40, 160, 50, None, 0, 0, 100) == 90
    assert chunk_stop(150, 160, 50, None, 0, 0, 100) == 160
    # 100 s left, 10 s per launch, 1000 tokens/s at 100 tokens/step: 900 steps fit; capped by chunk and by steps
    assert chunk_stop(0, 2000, 0, 100.0, 10.0, 1000.0, 100) == 900
    assert chunk_stop(0, 2000, 300, 100.0, 10.0, 1000.0, 100) == 300
    assert chunk_stop(5, 10, 0, 100.0, 10.0, 1000.0, 100) == 10
    assert chunk_stop(7, 2000, 0, 5.0, 10.0, 1000.0, 100) == 7  # nothing fits


def test_resumable_step_and_truncate_metrics(tmp_path):
    assert resumable_step(str(tmp_path)) == 0
    for n, meta in ((40, True), (80, True), (120, False)):  # step-120: interrupted save without metadata
        d = tmp_path / "checkpoint" / f"step-{n}"
        d.mkdir(parents=True)
        if meta:
            (d / ".metadata").write_bytes(b"x")
    assert resumable_step(str(tmp_path)) == 80
    recs = [{"step": s, "loss": 1.0} for s in (1, 40, 80, 100)] + [{"step": 100, "val_loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    truncate_metrics(str(tmp_path), 80)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 40, 80]


@pytest.mark.slow
def test_dose_suite_chunks_resume_and_records_gain_cpu(tmp_path):
    """--suite dose on the debug flavor: two arms, 4 steps in chunks of 2 (stop_after_step, then resume from the
    checkpoint), the ρ-norm lr arm's own param group in the metrics, the starting gain in the analysis; a second
    call reuses the finished runs."""
    _tiny_corpus(tmp_path)
    out = tmp_path / "out"
    argv = ["--corpus", str(tmp_path), "--out", str(out), "--flavor", "debug", "--steps", "4", "--batch", "2",
            "--seq-len", "32", "--vocab", "300", "--tokenizer-docs", "40", "--val-tokens", "64", "--suite", "dose",
            "--runs", "softmax_muon,parallax_g0.1_rnormlr1_muon", "--seeds", "3", "--chunk-steps", "2",
            "--timeout", "900"]
    rows = main(argv)
    assert [r["run"] for r in rows] == ["softmax_muon_s3", "parallax_g0.1_rnormlr1_muon_s3"]
    assert all(r["ok"] and r["step"] == 4 and math.isfinite(r["val_loss"]) for r in rows), rows
    run = out / "dose" / "parallax_g0.1_rnormlr1_muon_s3"
    log = (run / "train.log").read_text()
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == sorted({r["step"] for r in recs if "loss" in r})
    assert any(r"lr/norm[\.r_norm\.]" in r for r in recs), recs[0].keys()
    assert "Training starts at step 1" in log and "checkpoint/step-2." in log and "Training starts at step 3" in log
    # 4 steps at lr ≤ 5e-3 (× 1 for the gain) move a gain of 0.1 by at most 0.02
    assert rows[1]["rho_gain"] == pytest.approx(0.1, abs=0.025) and rows[1]["probe_norm"] > 0
    assert rows[0].get("rho_gain") is None and rows[0]["cor"] is None
    for f in ("summary.json", "table.txt", "ppl.png", "diagnostics_by_layer.png"):
        assert (out / "dose" / f).is_file(), f
    assert not (run / "checkpoint").exists() and (out / "tokenizer" / "tokenizer.json").is_file()
    again = main(argv)
    assert all(r.get("cached") for r in again) and again[1]["rho_gain"] == rows[1]["rho_gain"]
    assert [r["seconds"] for r in again] == [r["seconds"] for r in rows]


def test_suite_runs_in_parallel_one_gpu_each(tmp_path, monkeypatch):
    """--gpus 2: two runs train at once, each child sees one device (CUDA_VISIBLE_DEVICES), every run lands in
    summary.json and the table keeps arm order, whatever order the runs finish in."""
    import threading
    import time

    _tiny_corpus(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    active, peak, seen, shares, lock = [0], [0], {}, {}, threading.Lock()

    def fake_run(cmd, log, timeout, append=False, gpu=None, cpus=None):
        if "--train-one" not in cmd:  # plot_ppl
            return True, 0.0
        dump = cmd[cmd.index("--job.dump_folder") + 1]
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            seen[os.path.basename(dump)] = gpu
            shares[gpu] = cpus
        time.sleep(0.3 if "softmax" in dump else 0.05)  # the first arm finishes last
        with open(os.path.join(dump, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 4, "loss": 5.0, "tps": 100.0}) + "\n")
            f.write(json.dumps({"step": 4, "val_loss": 5.1, "val_ppl": math.exp(5.1)}) + "\n")
        with lock:
            active[0] -= 1
        return True, 0.1

    monkeypatch.setattr(replicate_run, "_run", fake_run)
    runs = "softmax_muon,parallax_g1_muon,parallax_g0.1_muon"
    rows = main(["--corpus", str(tmp_path), "--out", str(tmp_path / "out"), "--flavor", "debug", "--steps", "4",
                   "--vocab", "300", "--tokenizer-docs", "40", "--suite", "dose", "--runs", runs, "--seeds", "0",
                   "--gpus", "2", "--no-analyze", "--compile", "off"])
    assert peak[0] == 2
    assert [r["run"] for r in rows] == [f"{a}_s0" for a in runs.split(",")] and all(r["ok"] for r in rows)
    assert set(seen.values()) == {"5", "7"} and len(seen) == 3
    assert sorted(shares.values()) == sorted(replicate_run.cpu_share(i, 2) for i in range(2))  # a share per GPU
    summary = json.load(open(tmp_path / "out" / "dose" / "summary.json"))
    assert [r["run"] for r in summary["runs"]] == [r["run"] for r in rows] and summary["gpus"] == 2
    with pytest.raises(SystemExit):
        parse_args(["--corpus", "x", "--gpus", "2"])  # only a suite runs several at once

    # the table is rebuilt from the run folders alone, in the summary's order, without training
    runs_before = [r["run"] for r in summary["runs"]]
    summary["runs"] = summary["runs"][:1]  # as if a second process had overwritten the summary
    json.dump(summary, open(tmp_path / "out" / "dose" / "summary.json", "w"))
    seen.clear()
    report = main(["--out", str(tmp_path / "out"), "--suite", "dose", "--report"])
    assert not seen and [r["run"] for r in report][0] == runs_before[0]
    assert sorted(r["run"] for r in report) == sorted(runs_before)
    assert all(r["ok"] and r["steps"] == 4 and r["val_ppl"] == pytest.approx(math.exp(5.1)) for r in report)
    assert "parallax_g0.1_muon_s0" in (tmp_path / "out" / "dose" / "table.txt").read_text()
    # a seed trained elsewhere (recorded in summary.json, no folder here) keeps its row and joins its arm's mean
    summary = json.load(open(tmp_path / "out" / "dose" / "summary.json"))
    elsewhere = {**summary["runs"][0], "run": "softmax_muon_s1", "seed": 1, "val_ppl": 2 * summary["runs"][0]["val_ppl"]}
    summary["runs"].insert(1, elsewhere)
    json.dump(summary, open(tmp_path / "out" / "dose" / "summary.json", "w"))
    report = main(["--out", str(tmp_path / "out"), "--suite", "dose", "--report"])
    assert [r["run"] for r in report][:2] == [runs_before[0], "softmax_muon_s1"] and report[1] == elsewhere
    assert arm_rows(report)[0]["mean"] == pytest.approx(1.5 * math.exp(5.1))


def test_suite_wide_arm_takes_its_gpus_and_observation_flags_keep_a_run(tmp_path, monkeypatch):
    """--arm-gpus: the wide arm starts first, on 2 of the 3 GPUs at once through torchrun with half the local batch
    (the same global batch), while the others take one GPU each, never more than 3 busy. A finished run whose
    flags differ only in what it records (validation.freq) is kept; one whose training differs is retrained."""
    import threading
    import time

    _tiny_corpus(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    busy, peak, launches, lock = [0], [0], {}, threading.Lock()

    def fake_run(cmd, log, timeout, append=False, gpu=None, cpus=None):
        if "--job.dump_folder" not in cmd:  # plot_ppl
            return True, 0.0
        dump = cmd[cmd.index("--job.dump_folder") + 1]
        n = len(gpu.split(","))
        with lock:
            busy[0] += n
            peak[0] = max(peak[0], busy[0])
            launches.setdefault(os.path.basename(dump), []).append((time.monotonic(), gpu, cmd, len(cpus)))
        time.sleep(0.2)
        with open(os.path.join(dump, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 4, "loss": 5.0, "tps": 100.0}) + "\n")
            f.write(json.dumps({"step": 4, "val_loss": 5.1, "val_ppl": math.exp(5.1)}) + "\n")
        with lock:
            busy[0] -= n
        return True, 0.1

    monkeypatch.setattr(replicate_run, "_run", fake_run)
    runs = "softmax_muon,parallax_g1_muon,parallax_g0.1_muon"
    argv = ["--corpus", str(tmp_path), "--out", str(tmp_path / "out"), "--flavor", "debug", "--steps", "4",
            "--batch", "4", "--vocab", "300", "--tokenizer-docs", "40", "--suite", "dose", "--runs", runs,
            "--seeds", "0", "--gpus", "3", "--arm-gpus", "parallax_g0.1_muon=2", "--no-analyze", "--compile", "off"]
    rows = main(argv)
    assert all(r["ok"] for r in rows) and peak[0] == 3
    assert [r["gpus"] for r in rows] == [1, 1, 2] and rows[2]["tokens"] == rows[0]["tokens"]
    (_, gpu, cmd, ncpu), = launches["parallax_g0.1_muon_s0"]  # GPUs 4,5: it took its GPUs first
    assert gpu == "4,5" and ncpu == 2 * len(replicate_run.cpu_share(0, 3))
    assert "torch.distributed.run" in cmd and "--nproc_per_node=2" in cmd
    i = len(cmd) - cmd[::-1].index("--training.local_batch_size")
    assert cmd[i] == "2"  # the last occurrence wins: 2 per rank, 4 in all
    assert all(ls[0][1] in ("4", "5", "6") and "--train-one" in ls[0][2]
               for name, ls in launches.items() if name != "parallax_g0.1_muon_s0")
    report = main(["--out", str(tmp_path / "out"), "--suite", "dose", "--report"])
    assert [r["gpus"] for r in report] == [1, 1, 2] and report[2]["tokens"] == report[0]["tokens"]

    # validation.freq changes what a run records, not what it trains: the finished run stays
    dump = tmp_path / "out" / "dose" / "softmax_muon_s0"
    recorded = json.load(open(dump / "train_args.json"))
    j = recorded.index("--validation.freq")
    json.dump(recorded[:j + 1] + ["7"] + recorded[j + 2:], open(dump / "train_args.json", "w"))
    launches.clear()
    again = main(argv)
    assert again[0].get("cached") and "softmax_muon_s0" not in launches
    j = recorded.index("--debug.seed")  # a training flag: retrained
    json.dump(recorded[:j + 1] + ["9"] + recorded[j + 2:], open(dump / "train_args.json", "w"))
    launches.clear()
    main(argv)
    assert "softmax_muon_s0" in launches
    for bad in ("nope=2", "parallax_g1_muon=4", "parallax_g1_muon=x", "parallax_g1_muon=3"):
        with pytest.raises(SystemExit):  # not an arm; more than --gpus; not a number; does not divide --batch
            parse_args(["--corpus", "c", "--suite", "dose", "--gpus", "3", "--batch", "4", "--arm-gpus", bad])


def test_write_summary_merges_rows_of_other_processes(tmp_path):
    write_summary(str(tmp_path), [{"run": "a", "v": 1}, {"run": "b", "v": 1}], {"x": 1}, merge=True)
    write_summary(str(tmp_path), [{"run": "c", "v": 2}], {"x": 2}, merge=True)  # another process, another run
    rows = write_summary(str(tmp_path), [{"run": "a", "v": 3}], {"x": 3}, merge=True)
    assert [(r["run"], r["v"]) for r in rows] == [("b", 1), ("c", 2), ("a", 3)]
    assert summary_rows(str(tmp_path)) == rows and json.load(open(tmp_path / "summary.json"))["x"] == 3
    assert write_summary(str(tmp_path), [{"run": "z"}], {}) == [{"run": "z"}]  # no merge: the rows given


def test_seeds_table_mean_min_max_and_delta_of_means():
    def row(arm, seed, ppl, ok=True):
        return {"run": f"{arm}_s{seed}", "arm": arm, "seed": seed, "steps": 10, "tokens": 10, "ok": ok,
                "val_ppl": ppl, "val_loss": math.log(ppl), "seconds": 1.0}

    rows = [row("softmax_muon", 0, 13.0), row("softmax_muon", 1, 12.8), row("softmax_muon", 2, 13.2),
            row("parallax_g0.1_muon", 0, 12.6), row("parallax_g0.1_muon", 1, 12.9), row("parallax_g0.1_muon", 2, 12.3),
            row("parallax_g0.1_muon", 3, 99.0, ok=False),  # unfinished: not in the arm's statistics
            row("softmax_adamw_lr0.001", 0, 21.0), row("softmax_adamw_lr0.002", 0, 20.0),
            row("parallax_g1_adamw_lr0.002", 0, 18.0), row("parallax_g1_adamw_lr0.002_wu80", 2, 16.0)]
    arms = {a["arm"]: a for a in arm_rows(rows)}
    assert arms["parallax_g0.1_muon"]["seeds"] == [0, 1, 2]
    assert arms["parallax_g0.1_muon"]["mean"] == pytest.approx(12.6)
    assert (arms["parallax_g0.1_muon"]["min"], arms["parallax_g0.1_muon"]["max"]) == (12.3, 12.9)
    assert arms["parallax_g0.1_muon"]["delta"] == pytest.approx(100 * (12.6 / 13.0 - 1))  # means, not seed 0
    assert arms["parallax_g1_adamw_lr0.002"]["delta"] == pytest.approx(100 * (18.0 / 20.0 - 1))  # best AdamW softmax
    assert arms["softmax_muon"]["delta"] is None and arms["parallax_g1_adamw_lr0.002_wu80"]["delta"] is None
    lines = format_table(rows).splitlines()
    at = lines.index(next(line for line in lines if line.startswith("arm ")))
    assert lines[at].split() == ["arm", "seeds", "ppl", "mean", "min", "max", "vs", "softmax"]
    assert lines[at + 2].split() == ["softmax_muon", "0,1,2", "13.00", "12.80", "13.20", "-"]
    assert lines[at + 3].split() == ["parallax_g0.1_muon", "0,1,2", "12.60", "12.30", "12.90", "-3.1%"]
    single = format_table([row("softmax_muon", 0, 13.0), row("parallax_g0.1_muon", 0, 12.6)])
    assert "ppl mean" not in single  # one seed per arm: the run table says it all


def test_registry_suites_cover_the_registry():
    """Every registered mechanism with a fast path has an arm named after it, with nothing but its attention set,
    followed by its paper arms; a reference-only mechanism is listed as not trained, with the registry's reason."""
    from attnlab.attention import REGISTRY
    from attnlab.config import parse_config

    arms = suite_arms("registry", [], 0.1, [])
    fast = [m for m, e in REGISTRY.items() if not e.reference_only]
    assert [a for a in arms if a in REGISTRY] == fast and all(arms[m] == ["--model.attention", m] for m in fast)
    assert excluded("registry") == {m: e.reference_only for m, e in REGISTRY.items() if e.reference_only}
    for mech, extra in PAPER_ARMS.items():
        for arm, flags in extra.items():
            assert arms[arm] == ["--model.attention", mech, *flags] and mechanism(arms[arm]) == mech
            assert list(arms).index(arm) == list(arms).index(mech) + 1
            parse_config(arms[arm])  # the flags name real options with valid values
    long = suite_arms("registry_long", [], 0.1, [])
    assert {mechanism(f) for f in long.values()} == set(LONG_MECHANISMS) and set(long) <= set(arms)


def _eval_json(dump, trained=1024):
    buckets = [{"start": a, "end": b, "tokens": 10, "loss": 1.0, "ppl": float(a + 1)}
               for a, b in ((0, 512), (512, 1024), (1024, 2048), (2048, 4096))]
    os.makedirs(dump, exist_ok=True)
    json.dump({"train_seq_len": trained, "ood": {"ppl": 90.0}, "by_position": {"buckets": buckets},
               "passkey": {"accuracy": {"1024": 0.8, "2048": 0.1},
                           "results": [{"length": 1024, "logprob": -1.0}, {"length": 1024, "logprob": -2.0},
                                       {"length": 2048, "logprob": -9.0}]}, "synthetic": {"acc": 0.99},
               "reference": {"rel_err": 2e-5}},
              open(os.path.join(dump, EVAL_FILE), "w"))


def test_eval_columns(tmp_path):
    _eval_json(tmp_path / "run")
    assert columns(str(tmp_path / "run")) == {"ood_ppl": 90.0, "pos_ppl": {"512": 513.0, "1024": 1025.0, "2048": 2049.0},
                                              "passkey_1x": 0.8, "passkey_2x": 0.1, "passkey_logp": -1.5, "mqar": 0.99,
                                              "ref_err": 2e-5}
    assert columns(str(tmp_path / "none")) == {}


def test_read_metrics_peak_memory_and_spike(tmp_path):
    recs = [{"step": s, "loss": loss, "tps": 1.0, "memory_gib": mem, "grad_norm": g}
            for s, loss, mem, g in ((1, 9.0, 1.0, 50.0), (10, 5.0, 3.0, 2.0), (20, 4.0, 2.0, 3.0),
                                    (30, 4.2, 2.0, 90.0), (40, 5.5, 2.5, 2.5), (50, 3.9, 2.0, 2.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    m = read_metrics(str(tmp_path))
    assert m["mem_gib"] == 3.0 and m["spike"] == pytest.approx(1.3)  # 5.5 over 4.2; step 1 is in the first tenth
    assert m["gnorm_spike"] == pytest.approx(90.0 / 2.5)  # over the median of steps > 1 (step 1's 50 left out)


def test_registry_table_flags_outliers_and_failures():
    """Arms over seeds: val ppl mean/min/max against softmax, the other columns averaged, and the flags that call for
    a write-up: > 25 % worse than softmax, a loss spike, a gradient-norm spike, a run that did not finish."""
    def row(arm, seed, ppl, ok=True, spike=0.01, gnorm_spike=3.0, **cols):
        return {"run": f"{arm}_s{seed}", "arm": arm, "seed": seed, "steps": 160, "tokens": 1, "ok": ok,
                "val_ppl": ppl if ok else None, "spike": spike, "gnorm_spike": gnorm_spike, "tps": 1000.0 * (seed + 1), "mem_gib": 2.0,
                "ood_ppl": 2 * ppl if ok else None, "pos_ppl": {"512": ppl}, "passkey_1x": 1.0, "passkey_2x": 0.0,
                "mqar": 0.5 + seed / 4, **({} if ok else {"error": "x"})}

    rows = [row("softmax", 0, 80.0), row("softmax", 1, 82.0), row("gla", 0, 90.0), row("gla", 1, 92.0),
            row("linear", 0, 110.0), row("linear", 1, 112.0, gnorm_spike=150.0), row("fox", 0, 80.0, spike=1.5),
            row("mesa", 0, 0, ok=False)]
    arms = {a["arm"]: a for a in registry_rows(rows)}
    assert arms["gla"]["mean"] == pytest.approx(91.0) and arms["gla"]["delta"] == pytest.approx(100 * (91 / 81 - 1))
    assert arms["gla"]["tps"] == pytest.approx(1500.0) and arms["gla"]["mqar"] == pytest.approx(0.625)
    assert arms["gla"]["pos_ppl"] == {"512": pytest.approx(91.0)} and arms["gla"]["flags"] == []
    assert arms["linear"]["flags"] == ["+37% vs softmax", "gradient-norm spike 150x"]
    assert arms["fox"]["flags"] == ["loss spike 1.50"]
    assert arms["mesa"]["flags"] == ["not finished: mesa_s0"] and arms["mesa"]["mean"] is None
    table = format_table(rows, {"suite": "registry", "excluded": {"affine_mesa": "no fast path"}})
    assert "+37% vs softmax; gradient-norm spike 150x" in table and "not trained: affine_mesa: no fast path" in table


def test_cpu_share_splits_the_cores():
    cores = sorted(os.sched_getaffinity(0))
    shares = [replicate_run.cpu_share(i, len(cores)) for i in range(len(cores))]
    assert shares == [[c] for c in cores]  # disjoint, one core each
    assert replicate_run.cpu_share(0, 1) == cores
    assert replicate_run.cpu_share(0, 2 * len(cores)) == [cores[0]]  # more runs than cores: still one core


@pytest.mark.slow
def test_registry_suite_evaluates_each_run_cpu(tmp_path):
    """--suite registry on the debug flavor: a mechanism's own arm and a paper arm train, each is evaluated in its own
    child (eval.json: out-of-domain ppl, loss by position to 4x the context, passkey, and MQAR for the mechanism's
    own arm only), the checkpoint goes once eval.json exists, and the table carries the columns."""
    _tiny_corpus(tmp_path)
    ood = tmp_path / "ood.txt"
    ood.write_text("Completely different words: ocean, harbour, lantern, orchard, violin. " * 40)
    out = tmp_path / "out"
    rows = main(["--corpus", str(tmp_path), "--out", str(out), "--flavor", "debug", "--steps", "3", "--batch", "2",
                 "--seq-len", "64", "--vocab", "300", "--tokenizer-docs", "40", "--val-tokens", "128",
                 "--suite", "registry", "--runs", "softmax,parallax_paper_g1", "--seeds", "0", "--ood", str(ood),
                 "--timeout", "900"])
    assert [r["run"] for r in rows] == ["softmax_s0", "parallax_paper_g1_s0"] and all(r["ok"] for r in rows), rows
    for r in rows:
        assert "eval_error" not in r, r
        assert math.isfinite(r["ood_ppl"]) and set(r["pos_ppl"]) == {"32", "64", "128"}, r
        assert r["ref_err"] < 1e-4, r  # the CPU paths against the float64 references on the trained weights
        assert not (out / "registry" / r["run"] / "checkpoint").exists()
    assert 0 <= rows[0]["mqar"] <= 1 and "mqar" not in rows[1]
    table = (out / "registry" / "table.txt").read_text()
    assert "parallax_paper_g1" in table and "not trained: affine_mesa" in table
