"""benchmarks/bench_train.py's trace summary (kernel classes, GPU-busy share and the idle gaps of a profiled step) and
its argument checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import bench_train
from benchmarks.bench_train import trace_summary


@pytest.mark.parametrize("flag,value,message", [("--rows", "gdn,kdaa", "--rows: unknown ['kdaa']; choose from"),
                                                ("--precisions", "bf16,bf8", "--precisions: unknown ['bf8']")])
def test_unknown_row_or_precision_fails_before_any_run(monkeypatch, capsys, tmp_path, flag, value, message):
    monkeypatch.setattr(sys, "argv", ["bench_train", "--data", "d", "--tokenizer", "t", "--out", str(tmp_path / "o"),
                                      flag, value])
    with pytest.raises(SystemExit):
        bench_train.main()
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _after(text: str, header: str) -> list[str]:
    """The stripped lines of ``text`` after the line that starts with ``header``."""
    lines = [x.strip() for x in text.splitlines()]
    return lines[next(i for i, x in enumerate(lines) if x.startswith(header)) + 1:]


def test_trace_summary(tmp_path):
    events = [
        {"name": "ProfilerStep#11", "cat": "user_annotation", "ts": 0, "dur": 10_000},
        {"name": "_parallax_fwd_kernel", "cat": "kernel", "ts": 100, "dur": 1_500},
        {"name": "nvjet_sm90_tst_256x128", "cat": "kernel", "ts": 1_000, "dur": 3_000},  # overlaps the first
        {"name": "triton_poi_fused_add_0", "cat": "kernel", "ts": 7_000, "dur": 200},
        {"name": "aten::item", "cat": "cpu_op", "ts": 4_000, "dur": 2_500},
        {"name": "aten::mm", "cat": "cpu_op", "ts": 100, "dur": 99_999},  # a host op is no GPU time
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    text = trace_summary(path)
    assert "GPU kernel time 4.7 ms" in text
    assert "gemm" in text and "attention" in text and "inductor" in text
    # busy = [0.1, 4.0] ∪ [7.0, 7.2] = 4.1 ms of a 10 ms step; the longest gap [4.0, 7.0] holds aten::item
    assert "step wall 10.0 ms (ProfilerStep), GPU busy 4.1 ms (41 %)" in text
    assert "3.00 ms at +4.0 ms: aten::mm 100.0ms; aten::item 2.5ms" in text
    # all idle time by host op: aten::mm spans the whole gap, aten::item 2.5 ms of it
    assert "host ops during GPU idle (3.0 ms per step" in text
    assert _after(text, "host ops during GPU idle") == ["3.00 ms  aten::mm", "2.50 ms  aten::item"]
    text_again, busy = trace_summary(path, with_busy=True)
    assert text_again == text and busy == {"busy_ms": 4.1, "wall_ms": 10.0}  # the table's busy % column


def test_trace_summary_several_steps(tmp_path):
    """Two traced steps: wall, busy and idle are per step; the idle between them counts, and so do ops in it."""
    events = [
        {"name": "ProfilerStep#8", "cat": "user_annotation", "ts": 0, "dur": 5_000},
        {"name": "ProfilerStep#9", "cat": "user_annotation", "ts": 5_000, "dur": 5_000},
        {"name": "ProfilerStep#9", "cat": "gpu_user_annotation", "ts": 6_000, "dur": 5_000},  # not a third step
        {"name": "gemm_a", "cat": "kernel", "ts": 0, "dur": 4_000},
        {"name": "gemm_b", "cat": "kernel", "ts": 8_000, "dur": 2_000},
        {"name": "Optimizer.step#AdamW.step", "cat": "user_annotation", "ts": 3_500, "dur": 1_500},
        {"name": "aten::_foreach_norm", "cat": "cpu_op", "ts": 3_600, "dur": 1_000},
        {"name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 7_990, "dur": 20},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    text, busy = trace_summary(path, with_busy=True)
    assert busy == {"busy_ms": 3.0, "wall_ms": 5.0}
    assert "step wall 5.0 ms (ProfilerStep), GPU busy 3.0 ms (60 %), host in syncs/item 0.0 ms per step over 2" in text
    # the one gap [4.0, 8.0] ms (2.0 ms per step): the optimizer range overlaps 1.0 ms, the norm 0.6, the launch 0.01
    assert "host ops during GPU idle (2.0 ms per step" in text
    assert _after(text, "host ops during GPU idle") == [
        "0.50 ms  Optimizer.step#AdamW.step", "0.30 ms  aten::_foreach_norm", "0.01 ms  cudaLaunchKernel"]


def test_side_by_side_gives_each_running_row_its_own_gpu(monkeypatch):
    """The 1-GPU rows of a scaling run: at most one row per GPU at any time, every row run once, results in order."""
    import threading
    import time

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    held, lock, seen = set(), threading.Lock(), []

    def fn(job, gpu):
        with lock:
            assert gpu not in held, (job, gpu)
            held.add(gpu)
            seen.append(gpu)
        time.sleep(0.02)
        with lock:
            held.remove(gpu)
        return job * 10

    jobs = list(range(7))
    assert bench_train.side_by_side(fn, jobs, 2) == {j: j * 10 for j in jobs}
    assert set(seen) == {"4", "6"} and len(seen) == 7


def test_a_row_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    """``run(timeout=...)``: the command and its children (torchrun's workers) die; the log says so."""
    import time

    start = time.monotonic()
    out = bench_train.run(["bash", "-c", f"sleep 30 & echo $! > {tmp_path / 'child'}; wait"], tmp_path / "log",
                          tmp_path, timeout=1)
    assert time.monotonic() - start < 20 and "killed after 1 s" in out
    child = int((tmp_path / "child").read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
