"""Shared by the benchmark scripts: timing helpers (CUDA events on a GPU, wall clock on a CPU)."""

from __future__ import annotations

import time

import torch


def timeit(fn, reps: int, warmup: int = 1, device: str = "cuda") -> float:
    """Mean milliseconds per call of ``fn`` over ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def median_ms(fn, rep: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``rep`` individually CUDA-event-timed calls (robust to stragglers)."""
    return queued_ms(fn, rep=1, groups=rep, warmup=warmup)


def queued_ms(fn, rep: int = 10, groups: int = 5, warmup: int = 5) -> float:
    """Median over ``groups`` of the mean milliseconds per call of ``rep`` back-to-back calls between two events.

    The stream stays busy from the second call on, so host-side launch cost (custom-op dispatch, autotuner lookup)
    overlaps the GPU work, as it does in a training step; :func:`median_ms` syncs after every call and so adds each
    call's host latency to its time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(groups):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(rep):
            fn()
        b.record()
        torch.cuda.synchronize()
        means.append(a.elapsed_time(b) / rep)
    return sorted(means)[len(means) // 2]


def kernel_events(fn, calls: int = 3):
    """torch.profiler's per-kernel averages (``key_averages()``) of the GPU kernels run by ``calls`` calls of ``fn``
    (already warm): an event's ``self_device_time_total / calls`` is that kernel's GPU µs per call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages()


def kernel_table(fn, calls: int = 3, rows: int = 20) -> str:
    """torch.profiler table of the GPU kernels run by ``calls`` calls of ``fn`` (already warm), by total CUDA time."""
    return kernel_events(fn, calls).table(sort_by="cuda_time_total", row_limit=rows)


def python_profile(fn, calls: int = 3, rows: int = 15) -> str:
    """cProfile of ``calls`` calls of ``fn`` (no device sync inside): the Python-side cost of launching them,
    by own time — shows where a CPU-bound (launch-bound) op spends its time."""
    import cProfile
    import io
    import pstats

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # CUDA backward on this thread, where cProfile looks
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
    sync()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(rows)
    # host time to enqueue the calls without profiling: ~ the GPU time per call if a call synchronises inside
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    buf.write(f"host enqueue {1e3 * (t1 - t0) / calls:.3f} ms/call, enqueue + drain {1e3 * (t2 - t0) / calls:.3f} ms/call\n")
    return buf.getvalue()


if __name__ == "__main__":  # a module the tools import, not a tool: running it (--help included) says what it holds
    print(__doc__)
    raise SystemExit(0)
