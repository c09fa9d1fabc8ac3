"""benchmarks/common.py's helpers for runs of train.py: the paper config of a checkout of either layout, the trace
summary (kernel classes, GPU-busy share and the idle gaps of a profiled step), rows side by side on their own GPUs,
and the launch's timeout."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import common
from benchmarks.common import paper_config, trace_summary


def test_paper_config_of_either_checkout_layout(tmp_path):
    """``--repo`` may name a checkout of the one-package layout (attnlab/configs/paper/), of the layout before it
    (configs/paper/), or older (configs/): the newest layout that has the config wins."""
    name = "qwen3_0.6b_gdn"
    assert paper_config(common.REPO, name) == common.REPO / "attnlab" / "configs" / "paper" / f"{name}.toml"
    assert paper_config(common.REPO, name).is_file()
    layouts = {"new": "attnlab/configs/paper", "pre-move": "configs/paper", "oldest": "configs"}
    for label, folder in layouts.items():
        (tmp_path / label / folder).mkdir(parents=True)
        (tmp_path / label / folder / f"{name}.toml").write_text("")
        assert paper_config(tmp_path / label, name) == tmp_path / label / folder / f"{name}.toml", label
    both = tmp_path / "both"
    for folder in ("configs/paper", "attnlab/configs/paper"):
        (both / folder).mkdir(parents=True)
        (both / folder / f"{name}.toml").write_text("")
    assert paper_config(both, name) == both / "attnlab" / "configs" / "paper" / f"{name}.toml"
    empty = tmp_path / "empty"  # none has it: the new layout's path, which the caller reports as missing
    assert paper_config(empty, name) == empty / "attnlab" / "configs" / "paper" / f"{name}.toml"


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
        {"name": "cudaStreamSynchronize", "cat": "cuda_runtime", "ts": 5_000, "dur": 1_000},  # inside aten::item
        {"name": "cudaDeviceSynchronize", "cat": "cuda_runtime", "ts": 200_000, "dur": 10},  # inside no CPU op
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
    assert _after(text, "host ops during GPU idle") == ["3.00 ms  aten::mm", "2.50 ms  aten::item",
                                                         "1.00 ms  cudaStreamSynchronize"]
    assert "host syncs per step: 2 (aten::item 1, (no CPU op) 1)" in text  # the innermost op around each wait
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
    assert common.side_by_side(fn, jobs, 2) == {j: j * 10 for j in jobs}
    assert set(seen) == {"4", "6"} and len(seen) == 7


def test_a_row_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    """``run(timeout=...)``: the command and its children (torchrun's workers) die; the log says so."""
    import time

    start = time.monotonic()
    out = common.run(["bash", "-c", f"sleep 30 & echo $! > {tmp_path / 'child'}; wait"], tmp_path / "log",
                          tmp_path, timeout=1)
    assert time.monotonic() - start < 20 and "killed after 1 s" in out
    child = int((tmp_path / "child").read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
