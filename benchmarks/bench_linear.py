"""Benchmark the delta-rule family ops (deltanet, gdn, kda, kda_bounded): fwd and fwd+bwd milliseconds per compute path.

Paths: "fla" (fla-core 0.6.0 Triton kernels, where they import and are allowed: fla refuses the gated backward
on Hopper with 3.4 <= Triton < 3.7.1, and this script reports that as "refused"), "fla_hopper" (fla's kernels
with our dqkwg kernel in the backward, ``attnlab/attention/ops/delta_rule/triton/pipeline.py``), "chunk" (PyTorch WY/UT
form under torch.compile), "chunk_eager" (same, not compiled; --eager), "module" / "module-compiled" (the
whole attention layer, ``attention/{deltanet,gdn,kda}.py`` with impl "auto", dim = H*D, projections and convs
included; "module-compiled" is ``torch.compile(fullgraph=True)`` as torchtitan compiles blocks: with fla it runs
the ``attnlab::delta_rule_*`` custom ops, no graph break; the note says which path "auto" took), plus SDPA causal
softmax as the reference row. "kda_bounded" is KDA with its bounded gate (``attention.kda.gate_lower_bound = -5``:
every log decay in [-5, 0), which runs fla's safe_gate kernels). Shape B4_T4096_H16_D128 in bf16 by default (the issue's target: GDN/KDA fwd+bwd <= 4 ms).

Rows are printed as soon as they are measured, fla rows first. The torch.compile'd "chunk" rows run in a child
process killed after ``--budget`` seconds (compiling the unrolled chunk loop at T=4096 can take minutes);
such a row reads "timeout".

    python -m benchmarks.bench_linear --quick          # fewer repetitions
    python -m benchmarks.bench_linear --quick --mechs gdn kda --paths fla_hopper fla chunk --budget 30
    python -m benchmarks.bench_linear --device cpu --B 1 --T 256 --H 2 --D 32 --quick   # smoke test
    python -m benchmarks.bench_linear --quick --mechs gdn --paths fla fla_hopper module module-compiled --budget 0 --no-sdpa
                                    # layer rows in-process (--budget 0): they reuse the fla rows' autotuning

TFLOP/s use the chunked-form FLOP count (per token and head: 4CK + C(K+V) + 6KV + 2CV forward,
x3 for fwd+bwd), the same count as the modules' ``flops_per_token``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from attnlab.attention.linear_common import l2norm
from attnlab.attention.ops.common import fla_gated_backward_ok, fla_importable
from attnlab.attention.ops.delta_rule import chunk_delta_rule, delta_rule_op
from benchmarks.common import kernel_table, python_profile, timeit

MECHS = {"deltanet": "none", "gdn": "scalar", "kda": "channel", "kda_bounded": "channel"}
LOWER_BOUND = {"kda_bounded": -5.0}  # KDA's bounded gate (fla safe_gate)


def make_inputs(mech, B, T, H, D, dtype, device):
    gate = MECHS[mech]
    q = torch.randn(B, T, H, D, dtype=dtype, device=device)
    k = l2norm(torch.randn(B, T, H, D, dtype=dtype, device=device))
    v = torch.randn(B, T, H, D, dtype=dtype, device=device)
    beta = torch.rand(B, T, H, dtype=dtype, device=device).sigmoid()
    g = None
    if gate == "scalar":  # Mamba2-style decays at init: -exp(A_log) softplus(a + dt_bias), a few 1e-2
        g = -torch.rand(B, T, H, device=device) * 0.1
    elif mech in LOWER_BOUND:  # lb * sigmoid(.): in (lb, 0), a few 1e-2 on average
        g = LOWER_BOUND[mech] * torch.sigmoid(torch.randn(B, T, H, D, device=device) - 4)
    elif gate == "channel":
        g = -torch.rand(B, T, H, D, device=device) * 0.1
    return [q, k, v, beta, g]


def fwd_bwd(op, inputs, do):
    """One forward and backward of ``op``; the gradients are returned, not accumulated into ``.grad`` (an add per
    input per call that a training step does not have: its first backward writes the gradient)."""
    leaves = [None if t is None else t.detach().requires_grad_(True) for t in inputs]
    need = [t for t in leaves if t is not None]

    def run():
        return torch.autograd.grad(op(*leaves)[0], need, do)

    return run


def chunk_flops(B, T, H, K, V, C=64):
    return B * T * H * (4 * C * K + C * (K + V) + 6 * K * V + 2 * C * V)


def bench_module(mech, path, a, dtype):
    """The whole layer (impl "auto") eager or under torch.compile(fullgraph=True): (fwd ms, fwd+bwd ms, note)."""
    from attnlab import attention  # noqa: F401  (registers the mechanisms)
    from attnlab.attention.base import AttentionArgs, AttentionContext
    from attnlab.attention.ops.delta_rule import select_impl
    from attnlab.attention.registry import REGISTRY

    dim = a.H * a.D
    args = AttentionArgs(dim=dim, n_heads=a.H, n_kv_heads=a.H, head_dim=a.D, impl="auto")
    spec = REGISTRY["kda" if mech in LOWER_BOUND else mech]
    opts = spec.options(gate_lower_bound=LOWER_BOUND[mech]) if mech in LOWER_BOUND else spec.options()
    m = spec.cls(args, opts).to(a.device)
    with torch.no_grad():
        m.init_weights(0.02)
    m = m.to(dtype)
    x = torch.randn(a.B, a.T, dim, dtype=dtype, device=a.device, requires_grad=True)
    ctx = AttentionContext(positions=torch.arange(a.T, device=a.device).expand(a.B, a.T))
    note = "auto -> " + select_impl("auto", x, MECHS[mech] != "none", True)
    fn = m
    if path == "module-compiled":
        torch._dynamo.utils.counters.clear()
        fn = torch.compile(m, fullgraph=True)
    dy = torch.randn(a.B, a.T, dim, dtype=dtype, device=a.device)

    def run():
        fn(x, ctx).backward(dy)
        for t in (x, *m.parameters()):  # as a training step's zero_grad(set_to_none=True): no accumulation
            t.grad = None

    both = timeit(run, a.reps, a.warmup, a.device)  # first: compiles the training graph
    with torch.no_grad():
        fwd = timeit(lambda: fn(x, ctx), a.reps, a.warmup, a.device)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values()) if path == "module-compiled" else 0
    return fwd, both, note + (f", {breaks} graph breaks" if breaks else "")


def bench_mech(mech, path, a, dtype):
    if path.startswith("module"):
        return bench_module(mech, path, a, dtype)
    inputs = make_inputs(mech, a.B, a.T, a.H, a.D, dtype, a.device)
    gated = MECHS[mech] != "none"
    if path == "fla":
        ok, why = fla_importable()
        if not ok or a.device != "cuda":
            return "n/a", "n/a", why or "needs CUDA"
        from attnlab.attention.ops.delta_rule.fla import fla_delta_rule as op
        bwd_ok, bwd_why = (True, "") if not gated else fla_gated_backward_ok(torch.device("cuda"))
    elif path == "fla_hopper":
        ok, why = fla_importable()
        if not ok or a.device != "cuda":
            return "n/a", "n/a", why or "needs CUDA"
        op = functools.partial(delta_rule_op, backend="fla_hopper")
        bwd_ok, bwd_why = True, ""
    elif path == "chunk":
        op = torch.compile(chunk_delta_rule, dynamic=False)
        bwd_ok, bwd_why = True, ""
    else:
        op = chunk_delta_rule
        bwd_ok, bwd_why = True, ""
    if mech in LOWER_BOUND and path in ("fla", "fla_hopper"):  # fla's KDA kernels with safe_gate (our op)
        op = functools.partial(delta_rule_op, backend=path, gate_lower_bound=LOWER_BOUND[mech])
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
    if a.profile and isinstance(both, float):
        run = fwd_bwd(op, inputs, do)
        print(f"# kernels of 3 fwd+bwd calls, {mech} {path}\n{kernel_table(run)}", flush=True)
        print(f"# Python side of 3 fwd+bwd calls, {mech} {path}\n{python_profile(run)}", flush=True)
    return fwd, both, note


def bench_sdpa(a, dtype):
    q, k, v = (torch.randn(a.B, a.H, a.T, a.D, dtype=dtype, device=a.device, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    with torch.no_grad():
        fwd = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), a.reps, a.warmup, a.device)

    def run():
        return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)

    return fwd, timeit(run, a.reps, a.warmup, a.device), ""


PATH_ORDER = ["fla", "fla_hopper", "chunk", "chunk_eager", "module", "module-compiled"]
HEADER = f"{'mechanism':<11} {'path':<15} {'fwd ms':>9} {'fwd+bwd':>9} {'fwd TF/s':>9}  note"


def format_row(row, flops):
    mech, path, fwd, both, note = row
    fmt = lambda x: f"{x:9.2f}" if isinstance(x, float) else f"{x:>9}"  # noqa: E731
    op_row = mech != "softmax" and not path.startswith("module")  # layer rows include the projections
    tf = f"{flops / fwd / 1e9:9.1f}" if isinstance(fwd, float) and op_row else f"{'':>9}"
    return f"{mech:<11} {path:<15} {fmt(fwd)} {fmt(both)} {tf}  {note}"


def run_row(mech, path, a, dtype):
    """One row; compiled rows ("chunk", "module-compiled") run in a child process under the --budget limit."""
    try:
        if path not in ("chunk", "module-compiled") or a.budget <= 0:
            return (mech, path, *bench_mech(mech, path, a, dtype))
        cmd = [sys.executable, "-m", "benchmarks.bench_linear", "--_row", mech, path] + a.argv
        # own process group, so the compile workers inductor forks are stopped with the child
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=a.budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return (mech, path, "timeout", "timeout", f"compile+run > --budget {a.budget:.0f}s")
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not lines:
            return (mech, path, "error", "error", (err.strip().splitlines() or ["no output"])[-1][:60])
        return tuple(json.loads(lines[-1])["row"])
    except Exception as e:  # keep the table going; report the failure in the row
        return (mech, path, "error", "error", f"{type(e).__name__}: {str(e).splitlines()[0][:50]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=4, help="batch size")
    p.add_argument("--T", type=int, default=4096, help="sequence length")
    p.add_argument("--H", type=int, default=16, help="heads")
    p.add_argument("--D", type=int, default=128, help="head dimension")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the inputs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--mechs", nargs="+", default=list(MECHS), choices=list(MECHS), help="mechanisms to time")
    p.add_argument("--paths", nargs="+", default=["fla", "fla_hopper", "chunk"], choices=PATH_ORDER,
                   help="implementations to time")
    p.add_argument("--eager", action="store_true", help="also time the uncompiled chunk path")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for the chunk path's float32 matmuls")
    p.add_argument("--quick", action="store_true", help="3 warmup + 5 timed repetitions (default 5 + 20)")
    p.add_argument("--budget", type=float, default=40.0,
                   help="seconds allowed per compiled 'chunk' row (compile + timing, child process); 0 = in-process")
    p.add_argument("--profile", action="store_true",
                   help="after each timed op row (in-process rows only), print its torch.profiler kernel table")
    p.add_argument("--no-sdpa", action="store_true", help="skip the softmax (SDPA) reference row")
    p.add_argument("--_row", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.argv = [x for i, x in enumerate(sys.argv[1:]) if x != "--_row"]
    a.warmup, a.reps = (3, 5) if a.quick else (5, 20)
    if a.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    dtype = getattr(torch, a.dtype)
    if a._row:  # child process of run_row: one row as a JSON line
        a.budget = 0
        print(json.dumps({"row": list(run_row(*a._row, a, dtype))}), flush=True)
        return
    paths = list(a.paths) + (["chunk_eager"] if a.eager and "chunk_eager" not in a.paths else [])
    paths = sorted(dict.fromkeys(paths), key=PATH_ORDER.index)  # fla rows first
    shape = f"B{a.B}_T{a.T}_H{a.H}_D{a.D}"
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    import triton

    flops = chunk_flops(a.B, a.T, a.H, a.D, a.D)
    print(f"# {shape} {a.dtype} on {dev}; torch {torch.__version__}, triton {triton.__version__}"
          f"{', tf32' if a.tf32 else ''}", flush=True)
    print(HEADER, flush=True)
    rows = []
    for path in paths:
        for mech in a.mechs:
            t0 = time.time()
            rows.append(run_row(mech, path, a, dtype))
            print(f"{format_row(rows[-1], flops)}  [{time.time() - t0:.0f}s]", flush=True)
    if not a.no_sdpa:
        rows.append(("softmax", "sdpa", *bench_sdpa(a, dtype)))
        print(format_row(rows[-1], flops), flush=True)
    print(f"\n{HEADER}")
    for row in rows:
        print(format_row(row, flops))
    fla = {r[0]: r[3] for r in rows if r[1] in ("fla", "fla_hopper") and isinstance(r[3], float)}
    for mech, path, fwd, both, _ in rows:
        if path == "chunk" and isinstance(both, float) and isinstance(fla.get(mech), float) and both > 3 * fla[mech]:
            print(f"note: {mech} chunk fwd+bwd is {both / fla[mech]:.1f}x fla's (> 3x)")


if __name__ == "__main__":
    main()
