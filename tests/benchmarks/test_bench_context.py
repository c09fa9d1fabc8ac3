"""benchmarks/bench_context.py: the sweep over sequence lengths at fixed tokens per step (train.py's command per row,
the table, results.json and the plot) with the launcher replaced by one that writes each row's metrics.jsonl, its
argument checks, and (slow) a real sweep of tiny CPU runs."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_context
from tests.utils import REPO, make_corpus

TPS = {("softmax", 16): 400.0, ("softmax", 32): 200.0, ("gdn", 16): 300.0}  # ("gdn", 32) fails: no metrics


def _flag(cmd: list[str], name: str) -> str:
    return cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]  # the last occurrence wins, as in train.py


def test_sweep_keeps_tokens_per_step_and_reports_every_row(monkeypatch, tmp_path, capsys):
    launched = []

    def fake_run(cmd, log, repo, devices="", timeout=None):
        """train.py stand-in: checks the row's flags and writes 4 steps of metrics (none for a failed row)."""
        mech, T = _flag(cmd, "--model.attention"), int(_flag(cmd, "--training.seq_len"))
        launched.append((mech, T, int(_flag(cmd, "--training.local_batch_size"))))
        assert _flag(cmd, "--model.attn_mask_type") == "causal" and _flag(cmd, "--activation_checkpoint.mode") == "full"
        assert _flag(cmd, "--job.config_file") == str(REPO / "attnlab" / "configs" / "debug_cpu.toml")
        assert _flag(cmd, "--training.global_batch_size") == _flag(cmd, "--training.local_batch_size")
        assert _flag(cmd, "--training.steps") == "4" and "--profiling.enable_profiling" not in cmd
        if (mech, T) in TPS:
            dump = tmp_path / "out" / f"{mech}_T{T}"
            dump.mkdir(parents=True)
            with open(dump / "metrics.jsonl", "w") as f:
                for step in range(1, 5):  # step 1 (warm-up) is slow and left out of the median
                    tps = TPS[(mech, T)] / (10 if step == 1 else 1)
                    f.write(json.dumps({"step": step, "loss": 3.0, "tps": tps, "memory_gib": 0.5 * step,
                                        "mfu": 12.5 if mech == "softmax" else None}) + "\n")
        log.write_text("")
        return "" if (mech, T) in TPS else "torch.OutOfMemoryError: CUDA out of memory."

    monkeypatch.setattr(bench_context, "run", fake_run)
    results = bench_context.main([
        "--data", "d", "--tokenizer", "t", "--config", str(REPO / "attnlab" / "configs" / "debug_cpu.toml"),
        "--mechanisms", "softmax,gdn", "--seq-lens", "16,32", "--tokens", "64", "--steps", "4", "--warmup", "1",
        "--no-profile", "--ac", "full", "--out", str(tmp_path / "out")])
    assert launched == [("softmax", 16, 4), ("softmax", 32, 2), ("gdn", 16, 4), ("gdn", 32, 2)]
    assert results[("softmax", 32, 1)]["tps"] == 200.0 and results[("softmax", 32, 1)]["mem"] == 2.0
    assert results[("gdn", 32, 1)] == {"failed": "out of memory"}
    out = capsys.readouterr().out
    table = out[out.index("mechanism "):].splitlines()
    assert table[1].split() == ["softmax", "16", "1", "4", "400", "1.000", "1.000", "12.5", "2.0", "160.0", "n/a"]
    assert table[3].split() == ["gdn", "16", "1", "4", "300", "0.750", "1.000", "n/a", "2.0", "213.3", "n/a"]
    assert table[4].split() == ["gdn", "32", "1", "2", "failed", "(out", "of", "memory)"]
    assert "activation checkpointing: full" in out
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["tokens"] == 64 and saved["rows"]["gdn/16/1"]["tps"] == 300.0
    assert saved["rows"]["gdn/32/1"] == {"failed": "out of memory"}
    assert (tmp_path / "out" / "tps_vs_seq_len.png").read_bytes()[:4] == b"\x89PNG"

    # --results: the saved rows and a second file's (which wins where both have a row) make one table, no run
    later = tmp_path / "later.json"
    later.write_text(json.dumps({"tokens": 64, "rows": {"gdn/32/1": {**saved["rows"]["gdn/16/1"], "tps": 150.0}}}))
    launched.clear()
    merged = bench_context.main(["--results", f"{tmp_path / 'out' / 'results.json'},{later}",
                                 "--plot", str(tmp_path / "all.png")])
    assert not launched and merged[("gdn", 32, 1)]["tps"] == 150.0 and merged[("softmax", 16, 1)]["tps"] == 400.0
    out = capsys.readouterr().out
    assert out[out.index("mechanism "):].splitlines()[4].split()[:7] == ["gdn", "32", "1", "2", "150", "0.750",
                                                                          "1.000"]
    assert (tmp_path / "all.png").is_file()


@pytest.mark.parametrize("flags,message", [
    (["--tokens", "100", "--seq-lens", "16,32"], "--tokens 100 is not a positive multiple of T = 16 (--seq-lens)"),
    (["--seq-lens", "4k"], "--seq-lens '4k': not a comma list of integers"),
    (["--mechanisms", "softmax,nope"], "no paper config qwen3_0.6b_<name>.toml for ['nope']; choose from"),
    (["--config", str(REPO / "attnlab" / "configs" / "debug_cpu.toml"), "--mechanisms", "parallax_p64"],
     "['parallax_p64'] are not registered attention names"),
    (["--steps", "12"], "--steps 12 leaves no untraced step"),
])
def test_bad_arguments_fail_before_any_run(capsys, tmp_path, flags, message):
    with pytest.raises(SystemExit):
        bench_context.main(["--data", "d", "--tokenizer", "t", "--out", str(tmp_path / "o"), *flags])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_repo_of_the_layout_before_the_move(capsys, tmp_path):
    """``--repo`` naming a checkout from before the move (configs/paper/, train.py at its root): its train.py runs
    its paper config, and an unknown mechanism is refused with that checkout's configs listed."""
    old = tmp_path / "old"
    (old / "configs" / "paper").mkdir(parents=True)
    (old / "configs" / "paper" / "qwen3_0.6b_gdn.toml").write_text("")
    flags = ["--data", "d", "--tokenizer", "t", "--repo", str(old), "--no-profile", "--steps", "4", "--warmup", "1"]
    args = bench_context.parse_args([*flags, "--mechanisms", "gdn"])
    cmd = bench_context.command(args, "gdn", 4096, tmp_path / "run")
    assert cmd[1] == str(old / "train.py")
    assert _flag(cmd, "--job.config_file") == str(old / "configs" / "paper" / "qwen3_0.6b_gdn.toml")
    with pytest.raises(SystemExit):
        bench_context.parse_args([*flags, "--mechanisms", "gdn,kda"])
    assert "no paper config qwen3_0.6b_<name>.toml for ['kda']; choose from ['gdn']" in capsys.readouterr().err


@pytest.mark.slow  # two real train.py launches on the CPU: ~25 s idle, a minute on a loaded 2-core machine
def test_tiny_cpu_sweep(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    results = bench_context.main([
        "--data", corpus["train"], "--tokenizer", corpus["tokenizer"],
        "--config", str(REPO / "attnlab" / "configs" / "debug_cpu.toml"), "--mechanisms", "softmax",
        "--seq-lens", "16,32",
        "--tokens", "32", "--steps", "3", "--warmup", "1", "--no-profile", "--train-args", "--model.vocab_size 64 --lr_scheduler.warmup_steps 1",
        "--out", str(tmp_path / "out")])
    assert all(results[("softmax", T, 1)]["tps"] > 0 for T in (16, 32))
    assert (tmp_path / "out" / "tps_vs_seq_len.png").is_file()


def test_context_parallel_rows_run_on_n_processes_with_the_degree_set(tmp_path):
    """``--cp 1,2``: the degree-2 rows run torchrun with 2 processes and CP degree 2, every row of the sweep with
    compile off; a T that 2 x cp does not divide, and a degree above --gpus, are refused."""
    args = bench_context.parse_args(["--data", "d", "--tokenizer", "t", "--mechanisms", "gdn", "--seq-lens", "64",
                                     "--tokens", "128", "--cp", "1,2", "--no-profile", "--steps", "4", "--warmup", "1"])
    cmd = bench_context.command(args, "gdn", 64, tmp_path / "run", cp=2)
    assert "--nproc_per_node=2" in cmd and _flag(cmd, "--parallelism.context_parallel_degree") == "2"
    assert "--compile.no-enable" in cmd and _flag(cmd, "--training.local_batch_size") == "2"
    assert _flag(cmd, "--training.global_batch_size") == "2"  # one data-parallel rank holds the whole batch
    one = bench_context.command(args, "gdn", 64, tmp_path / "run", cp=1)
    assert "torch.distributed.run" not in one and "--compile.no-enable" in one
    assert "--parallelism.context_parallel_degree" not in one
    for flags in (["--seq-lens", "66", "--tokens", "132", "--cp", "2"], ["--cp", "4", "--gpus", "2"]):
        with pytest.raises(SystemExit):
            bench_context.parse_args(["--data", "d", "--tokenizer", "t", "--no-profile", *flags])


def test_rows_run_side_by_side_each_on_its_own_gpus(monkeypatch, tmp_path):
    """``--gpus 4 --cp 1,2``: the one-GPU rows four at a time on GPUs 0-3, the CP = 2 rows two at a time on 0,1
    and 2,3; no two rows running at once share a GPU. Rows killed at --row-timeout report it."""
    import threading
    import time

    lock, running, seen = threading.Lock(), set(), []

    def fake_run(cmd, log, repo, devices="", timeout=None):
        gpus = set(devices.split(","))
        with lock:
            assert not gpus & running, f"{devices} already in use"
            running.update(gpus)
            seen.append((_flag(cmd, "--training.seq_len"), devices))
        time.sleep(0.05)
        with lock:
            running.difference_update(gpus)
        log.write_text("")
        return "step 1\nkilled after 9 s\n"  # no metrics: every row ran past --row-timeout

    monkeypatch.setattr(bench_context, "run", fake_run)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    results = bench_context.main(["--data", "d", "--tokenizer", "t", "--mechanisms", "softmax,gdn", "--seq-lens",
                                  "16,32", "--tokens", "64", "--cp", "1,2", "--gpus", "4", "--no-profile", "--steps",
                                  "4", "--warmup", "1", "--out", str(tmp_path / "o")])
    assert all(r == {"failed": "timeout"} for r in results.values())
    assert len(seen) == 8 and {d for _, d in seen[:4]} == {"0", "1", "2", "3"}
    assert {d for _, d in seen[4:]} == {"0,1", "2,3"}
