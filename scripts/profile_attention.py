"""Profile one fwd+bwd of our Parallax / softmax kernels and SDPA-cuDNN under Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        -o $OUT/attn python scripts/profile_attention.py
    ncu --import $OUT/attn.ncu-rep --page details --csv > attn.csv

Warm-up calls (autotuning, cuDNN plan selection) run before ``cudaProfilerStart``; exactly one fwd+bwd of each
column runs inside the profiled region, so the report holds one launch per kernel and column. Shape: the issue's
target cell B=4, 16 q / 8 kv heads, T=4096, D=128, bf16, causal (override with --T / --D).
Without ncu the script still prints the per-kernel CUDA time from ``torch.profiler`` for the same region.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.bench_attention import TRAIN  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--columns", default="ours-parallax,ours-softmax,sdpa-cudnn")
    ap.add_argument("--torch-profiler", action="store_true", help="print torch.profiler kernel times instead")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(h):
        return torch.randn(a.B, a.T, h, a.D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    q, k, v, r = rnd(16), rnd(8), rnd(8), rnd(16)
    calls = {}
    for name in a.columns.split(","):
        fn = TRAIN[name][0](q, k, v, r)
        if fn is None:
            print(f"{name}: unavailable")
            continue
        out = fn()
        do = torch.randn_like(out)

        def step(fn=fn, do=do):
            o = fn()
            torch.autograd.grad(o, (q, k, v, r) if "parallax" in name else (q, k, v), do, allow_unused=True)

        for _ in range(3):
            step()
        calls[name] = step
    torch.cuda.synchronize()
    if a.torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for step in calls.values():
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        return
    torch.cuda.cudart().cudaProfilerStart()
    for name, step in calls.items():
        torch.cuda.nvtx.range_push(name)
        step()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(calls))


if __name__ == "__main__":
    main()
