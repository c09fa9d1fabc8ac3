"""Profile one fwd+bwd of our Parallax / softmax kernels and SDPA-cuDNN under Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        -o $OUT/attn python -m benchmarks.profile_attention
    ncu --import $OUT/attn.ncu-rep --page details --csv > attn.csv

Warm-up calls (autotuning, cuDNN plan selection) run before ``cudaProfilerStart``; exactly one fwd+bwd of each
column runs inside the profiled region, so the report holds one launch per kernel and column. Shape: the issue's
target cell B=4, 16 q / 8 kv heads, T=4096, D=128, bf16, causal (override with --T / --D).
Without ncu the script still prints the per-kernel CUDA time from ``torch.profiler`` for the same region.

    python -m benchmarks.profile_attention --spills --D 128 --kernels dq,dkv   # no GPU needed

``--spills`` compiles every candidate config (short autotune list + ``common.TUNE_EXTRA_*``) for sm_90a offline
and prints ptxas' registers, spill bytes and shared memory per config: a cheap first filter before timing with
``benchmarks/bench_attention.py --tune-report`` (ptxas spill bytes are static; ncu's local-memory requests count
the dynamic traffic).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import TRAIN_COLUMNS


def spill_report(D: int, probe: bool, kernels: list[str], dtype: str = "bf16") -> list[str]:
    """Offline sm_90a compile of each candidate config (as a launch at T=4096 sees it:
    ``attnlab/attention/ops/sm90.py``); ptxas registers / spill stores / loads / smem, and whether the K/V loads became
    async copies."""
    from attnlab.attention.ops.parallax.triton import autotuned_kernels, common
    from attnlab.attention.ops.sm90 import compile_sm90, loop_local_memory, resources

    kernels_by_pass = autotuned_kernels()
    kern = {"fwd": (kernels_by_pass["fwd"], common.FWD_SPECS + common.TUNE_EXTRA_FWD, ("BM", "BN")),
            "dq": (kernels_by_pass["dq"], common.DQ_SPECS + common.TUNE_EXTRA_DQ, ("BM", "BN")),
            "dkv": (kernels_by_pass["dkv"], common.DKV_SPECS + common.TUNE_EXTRA_DKV, ("BN", "BM"))}
    base = dict(HQ=16, HKV=8, D=D, HAS_PROBE=probe, IS_VARLEN=False, WINDOW=False, DOT_PREC="tf32", Q_OFFSET=False)
    fp32 = {"LSE", "TBAR", "TAU", "BETA"}
    lines = []
    for name in kernels:
        fn, specs, tiles = kern[name]
        fn = fn.fn
        for spec in dict.fromkeys(specs):
            # every constexpr given: a missing one would be typed as a pointer argument below
            consts = {**base, "TMA": False, **({"WS": False} if name == "fwd" else {}),
                      **common.spec_kwargs(spec, tiles)}
            if name == "dkv":
                consts["LONG_OFF"] = False
            sig = {a: "constexpr" if a in consts else "fp32" if a in ("qk_scale", "scale") else
                   "i32" if a in ("W", "T", "NT", "NT_K") else "*i32" if a in ("CU", "CU_K") else
                   "*fp32" if a in fp32 else f"*{dtype}" for a in fn.arg_names}
            try:
                ints = dict(T=4096, **{a: 4 * 4096 for a in ("NT", "NT_K") if a in fn.arg_names})
                k = compile_sm90(fn, sig, consts, spec[2], spec[3], ints=ints)
                r, (ldl, stl) = resources(k), loop_local_memory(k)
                line = (f"{name:3s} D={D} {'parallax' if probe else 'softmax '} {spec}: regs {r['regs']}  spill "
                        f"stores {r['spill_st']} B  loads {r['spill_ld']} B  LDL/STL in loops {ldl}/{stl}  "
                        f"smem {r['smem'] // 1024} KB  "
                        f"async copies {r['async']}")
            except Exception as e:  # noqa: BLE001 — report and go on (e.g. too much shared memory)
                line = f"{name:3s} D={D} {spec}: {type(e).__name__}: {str(e)[:100]}"
            print(line, flush=True)
            lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=4096, help="sequence length")
    ap.add_argument("--D", type=int, default=128, help="head dimension")
    ap.add_argument("--B", type=int, default=4, help="batch size")
    ap.add_argument("--columns", default="ours-parallax,ours-softmax,sdpa-cudnn",
                    help="comma list of implementations to profile")
    ap.add_argument("--torch-profiler", action="store_true", help="print torch.profiler kernel times instead")
    ap.add_argument("--spills", action="store_true", help="offline ptxas register/spill report, no GPU needed")
    ap.add_argument("--kernels", default="fwd,dq,dkv", help="for --spills")
    ap.add_argument("--softmax", action="store_true", help="for --spills: no probe")
    a = ap.parse_args()
    if a.spills:
        spill_report(a.D, not a.softmax, a.kernels.split(","))
        return
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(h):
        return torch.randn(a.B, a.T, h, a.D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    q, k, v, r = rnd(16), rnd(8), rnd(8), rnd(16)
    calls = {}
    for name in a.columns.split(","):
        fn = TRAIN_COLUMNS[name][0](q, k, v, r)
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
        from benchmarks.common import kernel_table

        print(kernel_table(lambda: [step() for step in calls.values()], calls=1, rows=25))
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
