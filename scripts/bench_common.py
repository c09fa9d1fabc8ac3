"""Shared by the benchmark scripts: one timing helper (CUDA events on a GPU, wall clock on a CPU)."""

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
