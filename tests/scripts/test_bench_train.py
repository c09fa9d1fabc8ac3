"""scripts/bench_train.py's trace summary: kernel classes, GPU-busy share and the idle gaps of a profiled step."""

from __future__ import annotations

import json

from scripts.bench_train import trace_summary


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
    text_again, busy = trace_summary(path, with_busy=True)
    assert text_again == text and busy == {"busy_ms": 4.1, "wall_ms": 10.0}  # the table's busy % column
