"""Benchmark the delta-rule family ops (deltanet, gdn, kda): fwd and fwd+bwd milliseconds per compute path.

Paths: "chunk" (PyTorch WY/UT form under torch.compile), "chunk_eager" (same, not compiled; --eager),
"fla" (fla-core 0.6.0 Triton kernels, where they import and are allowed: fla refuses the gated backward on
Hopper with 3.4 <= Triton < 3.7.1, and this script reports that as "refused"), plus SDPA causal softmax as the
reference row. Shape B4_T4096_H16_D128 in bf16 by default (the issue's target: GDN/KDA fwd+bwd <= 4 ms).

    python scripts/bench_linear.py --quick          # fewer repetitions
    python scripts/bench_linear.py --mechs gdn kda --paths chunk fla
    python scripts/bench_linear.py --device cpu --B 1 --T 256 --H 2 --D 32 --quick   # smoke test

TFLOP/s use the chunked-form FLOP count (per token and head: 4CK + C(K+V) + 6KV + 2CV forward,
x3 for fwd+bwd), the same count as the modules' ``flops_per_token``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from attention.linear_common import fla_gated_backward_ok, fla_importable, l2norm  # noqa: E402
from attention.ops.delta_rule import chunk_delta_rule  # noqa: E402
from scripts.bench_common import timeit  # noqa: E402

MECHS = {"deltanet": "none", "gdn": "scalar", "kda": "channel"}


def make_inputs(mech, B, T, H, D, dtype, device):
    gate = MECHS[mech]
    q = torch.randn(B, T, H, D, dtype=dtype, device=device)
    k = l2norm(torch.randn(B, T, H, D, dtype=dtype, device=device))
    v = torch.randn(B, T, H, D, dtype=dtype, device=device)
    beta = torch.rand(B, T, H, dtype=dtype, device=device).sigmoid()
    g = None
    if gate == "scalar":  # Mamba2-style decays at init: -exp(A_log) softplus(a + dt_bias), a few 1e-2
        g = -torch.rand(B, T, H, device=device) * 0.1
    elif gate == "channel":
        g = -torch.rand(B, T, H, D, device=device) * 0.1
    return [q, k, v, beta, g]


def fwd_bwd(op, inputs, do):
    leaves = [None if t is None else t.detach().requires_grad_(True) for t in inputs]

    def run():
        o = op(*leaves)[0]
        o.backward(do)

    return run


def chunk_flops(B, T, H, K, V, C=64):
    return B * T * H * (4 * C * K + C * (K + V) + 6 * K * V + 2 * C * V)


def bench_mech(mech, path, a, dtype):
    inputs = make_inputs(mech, a.B, a.T, a.H, a.D, dtype, a.device)
    gated = MECHS[mech] != "none"
    if path == "fla":
        ok, why = fla_importable()
        if not ok or a.device != "cuda":
            return "n/a", "n/a", why or "needs CUDA"
        from attention.ops.delta_rule.fla import fla_delta_rule as op
        bwd_ok, bwd_why = (True, "") if not gated else fla_gated_backward_ok(torch.device("cuda"))
    elif path == "chunk":
        op = torch.compile(chunk_delta_rule, dynamic=False)
        bwd_ok, bwd_why = True, ""
    else:
        op = chunk_delta_rule
        bwd_ok, bwd_why = True, ""
    do = torch.randn(a.B, a.T, a.H, a.D, dtype=dtype, device=a.device)
    note = ""
    with torch.no_grad():
        fwd = timeit(lambda: op(*inputs), a.reps, a.warmup, a.device)
    if bwd_ok:
        try:
            both = timeit(fwd_bwd(op, inputs, do), a.reps, a.warmup, a.device)
        except RuntimeError as e:  # fla raising on an unsafe GPU/Triton pair we did not foresee
            both, note = "refused", str(e).splitlines()[0][:60]
    else:
        both, note = "refused", bwd_why[:60]
    return fwd, both, note


def bench_sdpa(a, dtype):
    q, k, v = (torch.randn(a.B, a.H, a.T, a.D, dtype=dtype, device=a.device, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    with torch.no_grad():
        fwd = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), a.reps, a.warmup, a.device)

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    return fwd, timeit(run, a.reps, a.warmup, a.device), ""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mechs", nargs="+", default=list(MECHS), choices=list(MECHS))
    p.add_argument("--paths", nargs="+", default=["fla", "chunk"], choices=["fla", "chunk", "chunk_eager"])
    p.add_argument("--eager", action="store_true", help="also time the uncompiled chunk path")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for the chunk path's float32 matmuls")
    p.add_argument("--quick", action="store_true", help="3 warmup + 5 timed repetitions (default 5 + 20)")
    a = p.parse_args()
    a.warmup, a.reps = (3, 5) if a.quick else (5, 20)
    if a.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    paths = list(a.paths) + (["chunk_eager"] if a.eager and "chunk_eager" not in a.paths else [])
    dtype = getattr(torch, a.dtype)
    shape = f"B{a.B}_T{a.T}_H{a.H}_D{a.D}"
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    import triton

    print(f"# {shape} {a.dtype} on {dev}; torch {torch.__version__}, triton {triton.__version__}"
          f"{', tf32' if a.tf32 else ''}", flush=True)
    rows = [("softmax", "sdpa", *bench_sdpa(a, dtype))]
    print("done softmax/sdpa", flush=True)
    for mech in a.mechs:
        for path in paths:
            t0 = time.time()
            try:
                rows.append((mech, path, *bench_mech(mech, path, a, dtype)))
            except Exception as e:  # keep the table going; report the failure in the row
                rows.append((mech, path, "error", "error", f"{type(e).__name__}: {str(e).splitlines()[0][:50]}"))
            print(f"done {mech}/{path} in {time.time() - t0:.0f}s", flush=True)
    flops = chunk_flops(a.B, a.T, a.H, a.D, a.D)
    fmt = lambda x: f"{x:9.2f}" if isinstance(x, float) else f"{x:>9}"  # noqa: E731
    print(f"\n{'mechanism':<9} {'path':<11} {'fwd ms':>9} {'fwd+bwd':>9} {'fwd TF/s':>9}  note")
    for mech, path, fwd, both, note in rows:
        tf = f"{flops / fwd / 1e9:9.1f}" if isinstance(fwd, float) and mech != "softmax" else f"{'':>9}"
        print(f"{mech:<9} {path:<11} {fmt(fwd)} {fmt(both)} {tf}  {note}")
    fla = {r[0]: r[3] for r in rows if r[1] == "fla"}
    for mech, path, fwd, both, _ in rows:
        if path == "chunk" and isinstance(both, float) and isinstance(fla.get(mech), float) and both > 3 * fla[mech]:
            print(f"note: {mech} chunk fwd+bwd is {both / fla[mech]:.1f}x fla's (> 3x)")


if __name__ == "__main__":
    main()
