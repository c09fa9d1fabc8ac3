"""End-to-end training throughput: tokens/s per GPU, MFU and peak memory, through the real trainer.

    python -m benchmarks.bench_train --data DIR --tokenizer DIR [--quick] [--rows softmax,parallax,...]
    python -m benchmarks.bench_train ... --optimizer adamw          # every row with AdamW (as stock torchtitan)
    python -m benchmarks.bench_train ... --nproc 4 --precisions bf16 # also on 4 GPUs: scaling efficiency

Each row launches ``train.py`` (or stock torchtitan's qwen3 for the "stock" row) for ``--steps`` steps at the
0.6B size on one GPU, compiled, with the given precision, and reads ``metrics.jsonl`` (the stock row: its log
lines). Throughput is the median over the steps after ``--warmup``. Ratios are printed against the named
baselines of the same run: Parallax vs softmax, fp8 vs bf16, ours vs stock torchtitan. Stock torchtitan trains
with AdamW; ``--optimizer adamw`` switches our rows to AdamW too (default ``config``: each config's optimizer,
Muon), and the rows ``softmax_adamw``/``parallax_adamw`` (the AdamW+WSD configs) compare both in one run.
``--nproc K`` runs every row also on K GPUs (FSDP over K, local batch --batch, global batch K x --batch) and
prints tokens/s per GPU at 1 and K GPUs and the scaling efficiency (per-GPU K / per-GPU 1). The 1-GPU rows then
run side by side, one per GPU, K at a time, before the K-GPU rows (``--no-side-by-side``: one after another).

Every row (stock too) traces ``--trace-steps`` steps (torchtitan's profiler, ending at step ``--steps`` − 1;
``--no-profile`` skips it). The table's "busy %" is the traced steps' GPU-busy time per step (union of kernel
intervals) over the row's median step time (from tok/s): a traced step itself runs slower (the profiler adds host
work per op), so its own busy share, "traced %", understates the untraced steps where the host bounds the step
(B2). Where the GPU does (B8), a document-masked row's step follows each batch's document lengths (attention work
grows with their squares), so a few traced steps need not match the median step: there "traced %" is the busy
share.
``trace_summary`` prints the GPU time by kernel class, the top kernels, the longest GPU-idle gaps with the host ops
inside them, and which host ops overlap the GPU's idle time in all (several traced steps show what one step's gaps
cannot: stalls that come every other step). Per-step tok/s varies, so medians want ~20 steps (the defaults give
steps 9–25). ``--repo DIR`` runs another checkout's ``train.py`` and configs with this script (before/after rows of
one change in one call).

``--data`` is a folder of JSONL files with a "text" field; ``--tokenizer`` a folder with tokenizer.json.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ADAMW = ["--optimizer.name", "AdamW", "--optimizer.lr", "3e-4"]
ROWS = {  # name -> (config, extra args)
    "softmax": ("qwen3_0.6b_softmax", []),
    "parallax": ("qwen3_0.6b_parallax", []),
    "parallax_p64": ("qwen3_0.6b_parallax_p64", []),
    "gdn": ("qwen3_0.6b_gdn", []),
    "kda": ("qwen3_0.6b_kda", []),
    "softmax_adamw": ("qwen3_0.6b_softmax_adamw_wsd", []),
    "parallax_adamw": ("qwen3_0.6b_parallax_adamw_wsd", []),
    # like stock torchtitan's qwen3 (plain causal mask, no document masking), for the ours-vs-stock ratio
    "softmax_adamw_causal": ("qwen3_0.6b_softmax_adamw_wsd", ["--model.attn_mask_type", "causal"]),
    "parallax_p64_adamw": ("qwen3_0.6b_parallax_p64_adamw_wsd", []),
    "gdn_adamw": ("qwen3_0.6b_gdn", ADAMW),
    "kda_adamw": ("qwen3_0.6b_kda", ADAMW),
    # selective AC recomputing the attention ops instead of keeping their outputs (less memory, one more forward)
    "gdn_adamw_recompute": ("qwen3_0.6b_gdn", ADAMW + ["--attention.sac_save", "false"]),
    "kda_adamw_recompute": ("qwen3_0.6b_kda", ADAMW + ["--attention.sac_save", "false"]),
}

RATIOS = (  # (row, baseline row, the end-to-end target): same optimizer on both sides
    ("softmax_adamw_causal", "stock", 1.05),  # same optimizer and mask
    ("parallax_adamw", "softmax_adamw", 0.82),
    ("parallax", "softmax", 0.82),
    ("parallax_p64_adamw", "softmax_adamw", 0.95),
    ("parallax_p64", "softmax", 0.95),
    ("gdn_adamw", "softmax_adamw", 0.9),
    ("kda_adamw", "softmax_adamw", 0.9),
    ("gdn", "softmax", 0.9),
)


def common(args, dump: Path, fp8: bool, nproc: int = 1) -> list[str]:
    out = ["--job.dump_folder", str(dump), "--model.hf_assets_path", args.tokenizer,
           "--training.dataset_path", args.data, "--training.local_batch_size", str(args.batch),
           "--training.global_batch_size", str(args.batch * nproc), "--training.seq_len", str(args.seq),
           "--training.steps", str(args.steps), "--metrics.log_freq", "1", "--validation.no-enable",
           "--checkpoint.no-enable", "--metrics.no-enable-tensorboard"]
    return out


def run(cmd: list[str], log: Path, repo: Path, devices: str = "", timeout: float | None = None) -> str:
    """Run ``cmd`` (on the GPUs ``devices``, a CUDA_VISIBLE_DEVICES list, when given), its output to ``log``. After
    ``timeout`` seconds the command and every process it started (torchrun's workers) are killed."""
    env = {**os.environ, "PYTHONPATH": f"{repo}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(repo),
                         start_new_session=True)
    try:
        output, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        output = p.communicate()[0] + f"\nkilled after {timeout:.0f} s\n"
    log.write_text(output)
    if p.returncode:
        print(f"FAILED: {' '.join(cmd[:6])} ...\n{output[-1500:]}", file=sys.stderr)
    return output


def summarize(records: list[dict], warmup: int) -> dict:
    """Medians of the steps after ``warmup`` (MFU is NaN where the run logged none: on a CPU), peak memory, last
    loss."""
    rows = [r for r in records if r["step"] > warmup]
    if not rows:
        return {}
    med = lambda k: statistics.median(math.nan if r[k] is None else r[k] for r in rows)  # noqa: E731
    return {"tps": med("tps"), "mfu": med("mfu"), "mem": max(r["memory_gib"] for r in rows), "loss": rows[-1]["loss"]}


def paper_config(repo: Path, name: str) -> Path:
    """The paper configuration ``name`` in checkout ``repo`` (``attnlab/configs/paper/``, or ``attnlab/configs/`` in checkouts from
    before the move, so ``--repo`` can time an older commit)."""
    new = repo / "configs" / "paper" / f"{name}.toml"
    return new if new.is_file() else repo / "configs" / f"{name}.toml"


def ours(args, name, fp8, out: Path, nproc: int = 1, devices: str = "") -> dict:
    config, extra = ROWS[name]
    dump = out / f"{name}_{'fp8' if fp8 else 'bf16'}{f'_x{nproc}' if nproc > 1 else ''}"
    repo = Path(args.repo)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0",
           "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(repo / "train.py"),
           "--job.config_file", str(paper_config(repo, config)), *common(args, dump, fp8, nproc), *extra]
    if args.optimizer == "adamw":
        cmd += ADAMW
    cmd += shlex.split(args.train_args)
    if not fp8:
        cmd += ["--model.converters", ""]
    run(cmd + profiling(args), out / f"{dump.name}.log", repo, devices)
    from attnlab.trainer.metrics import read_records

    path = dump / "metrics.jsonl"
    records = read_records(path) if path.exists() else []
    if args.profile:  # the profiler's warm-up and active steps run slower
        records = [r for r in records if r["step"] < first_profiled(args)]
    return summarize(records, args.warmup) | profiled(args, dump)


PROFILER_WARMUP = 3  # torchtitan's default profiler warm-up steps, which run slower too


def profiling(args) -> list[str]:
    """torchtitan's profiler: ``--trace-steps`` active steps ending just before the last, after its warm-up."""
    if not args.profile:
        return []
    return ["--profiling.enable_profiling", "--profiling.profile_freq", str(args.steps - 1),
            "--profiling.profiler_active", str(args.trace_steps),
            "--profiling.profiler_warmup", str(PROFILER_WARMUP), "--profiling.save_traces_folder", "traces"]


def first_profiled(args) -> int:
    """The first step the profiler slows (its warm-up); steps from here on are left out of the medians."""
    return args.steps - args.trace_steps - PROFILER_WARMUP  # the traced steps end at --steps - 1


def check_trace_steps(ap, args) -> None:
    """``--trace-steps`` and ``--steps`` leave untraced steps after ``--warmup`` and the profiler's warm-up
    (``ap.error`` naming the flag otherwise)."""
    if args.trace_steps < 1:
        ap.error(f"--trace-steps {args.trace_steps} must be >= 1 (--no-profile traces nothing)")
    if args.profile and first_profiled(args) <= args.warmup + 1:
        ap.error(f"--steps {args.steps} leaves no untraced step after --warmup {args.warmup} and the profiler's "
                 f"{PROFILER_WARMUP} warm-up + {args.trace_steps} traced steps; raise --steps")


def profiled(args, dump: Path) -> dict:
    """Print the traced step's summary; return its GPU-busy and wall ms (empty without a trace)."""
    traces = sorted(dump.glob("traces/iteration_*/rank0_trace.json"))
    if not args.profile or not traces:
        return {}
    text, busy = trace_summary(traces[-1], with_busy=True)
    print(f"--- {dump.name}: {args.trace_steps} traced step(s), GPU kernels ({traces[-1]})\n{text}", flush=True)
    return busy


KERNEL_CLASSES = (  # (class, substrings of the kernel name, lower case); first match wins
    ("attention", ("parallax", "flash", "fmha", "cudnn", "attn", "_fwd_kernel", "_bwd_")),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "sm90_", "sm80_", "cublas")),
    ("optimizer", ("multi_tensor", "foreach", "adam", "newton", "muon")),
    ("nccl", ("nccl",)),
    ("inductor (fused elementwise/norm/rope)", ("triton_",)),
    ("copy/fill", ("copy", "fill", "memset", "memcpy", "cat", "elementwise")),
)


def trace_summary(path: Path, top: int = 12, with_busy: bool = False):
    """GPU time of the traced step(s) by kernel class and the ``top`` kernels, from a chrome trace; then how
    much of the step the GPU sat idle, the largest idle gaps and the host ops running in them. With
    ``with_busy`` returns ``(text, {"busy_ms": GPU-busy ms, "wall_ms": traced step wall ms})``."""
    trace = json.load(open(path))["traceEvents"]
    events = [e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e.get("dur", 0.0) / 1e3
    total = sum(by_name.values())
    by_class: dict[str, float] = {}
    for name, ms in by_name.items():
        low = name.lower()
        cls = next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")
        by_class[cls] = by_class.get(cls, 0.0) + ms
    lines = [f"GPU kernel time {total:.1f} ms"]
    lines += [f"  {c:40s} {ms:8.1f} ms {100 * ms / total:5.1f} %" for c, ms in
              sorted(by_class.items(), key=lambda x: -x[1])]
    lines.append("  top kernels:")
    lines += [f"  {ms:8.2f} ms  {name[:110]}" for name, ms in sorted(by_name.items(), key=lambda x: -x[1])[:top]]
    idle, busy = idle_summary(trace, events)
    text = "\n".join(lines + idle)
    return (text, busy) if with_busy else text


def idle_summary(trace: list[dict], kernels: list[dict], gaps: int = 6, top: int = 12) -> tuple[list[str], dict]:
    """Wall time of the traced steps (ProfilerStep spans), GPU-busy time (union of kernel intervals), the ``gaps``
    longest idle stretches with the longest host ops (cpu_op / cuda_runtime / python) overlapping each, and the
    ``top`` host ops (cpu ops, record_function ranges, runtime calls; by name) by how much of all idle time they
    overlap: a nested op counts within its parent as well, so the list reads from the outside in. Returns the lines
    and ``{"busy_ms": busy, "wall_ms": wall}`` per traced step."""
    steps = [e for e in trace if e.get("name", "").startswith("ProfilerStep#") and "dur" in e
             and e.get("cat") != "gpu_user_annotation"]  # the host spans; the GPU's copies of them run later
    if not steps or not kernels:
        return [], {}
    n = len(steps)
    t0, t1 = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in kernels)
    busy, idle, cur_s, cur_e = 0.0, [], None, None
    for a, b in spans:
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                idle.append((a - cur_e, cur_e, a))
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    busy += cur_e - cur_s
    host = [e for e in trace if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function") and "dur" in e]
    syncs = sum(e["dur"] for e in host if "Synchronize" in e["name"] or e["name"] in ("aten::item",
                                                                                       "aten::_local_scalar_dense"))
    per = f" per step over {n} steps" if n > 1 else ""
    lines = [f"  step wall {(t1 - t0) / 1e3 / n:.1f} ms (ProfilerStep), GPU busy {busy / 1e3 / n:.1f} ms "
             f"({100 * busy / max(t1 - t0, 1):.0f} %), host in syncs/item {syncs / 1e3 / n:.1f} ms{per}",
             "  longest GPU idle gaps:"]
    for dur, a, b in sorted(idle, reverse=True)[:gaps]:
        inside = sorted((e for e in host if e["ts"] < b and e["ts"] + e["dur"] > a), key=lambda e: -e["dur"])[:3]
        lines.append(f"  {dur / 1e3:8.2f} ms at +{(a - t0) / 1e3:.1f} ms: "
                     + "; ".join(f"{e['name'][:50]} {e['dur'] / 1e3:.1f}ms" for e in inside))
    lines += idle_by_host_op(trace, sorted((a, b) for _, a, b in idle), n, top)
    return lines, {"busy_ms": busy / 1e3 / n, "wall_ms": (t1 - t0) / 1e3 / n}


def idle_by_host_op(trace: list[dict], idle: list[tuple[float, float]], n: int, top: int) -> list[str]:
    """The ``top`` host op names by the GPU-idle time (``idle``: sorted (start, end) µs) their calls overlap,
    in ms per step over ``n`` steps; ProfilerStep spans left out (they hold everything)."""
    cats = ("cpu_op", "user_annotation", "cuda_runtime", "python_function")
    starts = [a for a, _ in idle]
    total = sum(b - a for a, b in idle)
    by_name: dict[str, float] = {}
    for e in trace:
        if e.get("cat") not in cats or "dur" not in e or e["name"].startswith("ProfilerStep#"):
            continue
        lo, hi = e["ts"], e["ts"] + e["dur"]
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        ov = 0.0
        while i < len(idle) and idle[i][0] < hi:
            ov += max(0.0, min(hi, idle[i][1]) - max(lo, idle[i][0]))
            i += 1
        if ov > 0:
            by_name[e["name"]] = by_name.get(e["name"], 0.0) + ov
    lines = [f"  host ops during GPU idle ({total / 1e3 / n:.1f} ms per step; ms per step each op's calls overlap):"]
    ranked = sorted(by_name.items(), key=lambda x: -x[1])[:top]
    lines += [f"  {ms / 1e3 / n:8.2f} ms  {name[:100]}" for name, ms in ranked]
    return lines


LINE = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps: ([\d,]+).*?mfu: ([\d.]+)%")


def stock(args, fp8, out: Path, nproc: int = 1, devices: str = "") -> dict:
    """Stock torchtitan qwen3 0.6B with the same data, tokenizer, batch, compile and AC (AdamW, its default)."""
    dump = out / f"stock_{'fp8' if fp8 else 'bf16'}{f'_x{nproc}' if nproc > 1 else ''}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0",
           "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "-m", "torchtitan.train",
           "--model.name", "qwen3", "--model.flavor", "0.6B", "--training.dataset", "c4_test",
           "--compile.enable", "--compile.components", "model,loss", "--activation_checkpoint.mode", "selective",
           "--training.mixed_precision_param", "bfloat16", *common(args, dump, fp8, nproc)]
    if fp8:
        cmd += ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name",
                "tensorwise", "--quantize.linear.float8.filter_fqns", "output"]
    text = run(cmd + profiling(args), out / f"{dump.name}.log", Path(args.repo), devices)
    rows = [(int(s), float(m), float(t.replace(",", "")), float(u)) for s, m, t, u in LINE.findall(text)]
    rows = [r for r in rows if r[0] > args.warmup and not (args.profile and r[0] >= first_profiled(args))]
    if not rows:
        return {}
    return {"tps": statistics.median(r[2] for r in rows), "mfu": statistics.median(r[3] for r in rows),
            "mem": max(r[1] for r in rows), "loss": float("nan")} | profiled(args, dump)


def side_by_side(fn, jobs: list, gpus: int, per_job: int = 1) -> dict:
    """``{job: fn(job, devices)}`` with at most ``gpus // per_job`` calls at once, each given ``per_job`` GPUs (a
    CUDA_VISIBLE_DEVICES list of entries: the i-th GPU is the i-th of the caller's own list where it has one) that
    no other running call holds."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    names = [visible[i] if i < len(visible) else str(i) for i in range(gpus)]
    slots = max(1, gpus // per_job)
    free: queue.Queue = queue.Queue()
    for i in range(slots):
        free.put(",".join(names[i * per_job:(i + 1) * per_job]))

    def call(job):
        gpu = free.get()
        try:
            return fn(job, gpu)
        finally:
            free.put(gpu)

    with ThreadPoolExecutor(slots) as pool:
        return dict(zip(jobs, pool.map(call, jobs)))


def busy(r: dict, tokens: int) -> str:
    """GPU-busy ms of the traced step over the median step's ms (``tokens`` per step per GPU / tok/s)."""
    return f"{100 * r['busy_ms'] / (1e3 * tokens / r['tps']):.0f}" if "busy_ms" in r else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="training data (train.py's training.dataset_path)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder (model.hf_assets_path)")
    ap.add_argument("--rows", default="softmax,parallax,parallax_p64,gdn,stock",
                    help="comma list of model rows to time")
    ap.add_argument("--precisions", default="bf16,fp8", help="comma list of bf16/fp8")
    ap.add_argument("--batch", type=int, default=2, help="local batch size")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length")
    ap.add_argument("--steps", type=int, default=30, help="training steps per row")
    ap.add_argument("--warmup", type=int, default=8, help="steps left out of the median")
    ap.add_argument("--out", default="", help="also write the raw records (JSON) here")
    ap.add_argument("--optimizer", choices=("config", "adamw"), default="config",
                    help="config: each config's optimizer (Muon); adamw: AdamW on every row (stock uses AdamW)")
    ap.add_argument("--nproc", type=int, default=1, help="also run every row on this many GPUs (scaling)")
    ap.add_argument("--side-by-side", action=argparse.BooleanOptionalAction, default=True,
                    help="with --nproc K: the 1-GPU rows run K at a time, one per GPU")
    ap.add_argument("--quick", action="store_true", help="softmax and parallax in bf16 only, 12 steps")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="trace steps of every row: the busy %% column and a kernel/idle summary per row")
    ap.add_argument("--trace-steps", type=int, default=1, help="steps the profiler traces (with --profile)")
    ap.add_argument("--train-args", default="",
                    help="more train.py arguments for our rows, e.g. '--training.dataloader.num_workers 0'")
    ap.add_argument("--repo", default=str(REPO), help="checkout whose train.py and configs run (default: this one)")
    args = ap.parse_args()
    args.repo = str(Path(args.repo).resolve())
    if args.quick:
        args.rows, args.precisions, args.steps, args.warmup = "softmax,parallax", "bf16", 12, 6
    unknown = [r for r in args.rows.split(",") if r not in ROWS and r != "stock"]
    if unknown:
        ap.error(f"--rows: unknown {unknown}; choose from {['stock', *ROWS]}")
    unknown = [p for p in args.precisions.split(",") if p not in ("bf16", "fp8")]
    if unknown:
        ap.error(f"--precisions: unknown {unknown}; choose from ['bf16', 'fp8']")
    check_trace_steps(ap, args)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_train_"))
    out.mkdir(parents=True, exist_ok=True)
    tokens = args.batch * args.seq  # per GPU per step
    jobs = [(name, prec) for prec in args.precisions.split(",") for name in args.rows.split(",")]

    def one(job: tuple[str, str], k: int, devices: str = "") -> dict:
        name, prec = job
        r = (stock(args, prec == "fp8", out, k, devices) if name == "stock"
             else ours(args, name, prec == "fp8", out, k, devices))
        line = (f"tps {r['tps']:9,.0f}  mfu {r['mfu']:5.1f}%  mem {r['mem']:5.1f}GiB  busy % {busy(r, tokens)}"
                if r else "failed")
        print(f"{name:14s} {prec:5s} x{k} {line}" + (f" [GPU {devices}]" if devices else ""), flush=True)
        return r

    if args.nproc > 1 and args.side_by_side:
        results = side_by_side(lambda job, gpu: one(job, 1, gpu), jobs, args.nproc)
    else:
        results = {job: one(job, 1) for job in jobs}
    scaled = {job: one(job, args.nproc) for job in jobs} if args.nproc > 1 else {}
    (out / "results.json").write_text(json.dumps(
        {f"{k[0]}/{k[1]}": v for k, v in results.items()} | {f"{k[0]}/{k[1]}/x{args.nproc}": v
                                                              for k, v in scaled.items()}, indent=1))

    def ratio(a, b):
        ra, rb = results.get(a), results.get(b)
        return f"{ra['tps'] / rb['tps']:.3f}" if ra and rb else "n/a"

    print(f"\nB{args.batch}_T{args.seq} 0.6B, {args.steps} steps (median after {args.warmup}), optimizer "
          f"{'AdamW' if args.optimizer == 'adamw' else 'per config'}; logs in {out}")
    print(f"{'row':20s} {'prec':5s} {'tok/s/GPU':>10s} {'MFU%':>6s} {'GiB':>6s} {'step ms':>8s} {'busy %':>7s} "
          f"{'busy ms':>8s} {'traced ms':>9s} {'traced %':>8s}")
    for (name, prec), r in results.items():
        if r:
            prof = f"{'n/a':>8s} {'n/a':>9s} {'n/a':>8s}"
            if "busy_ms" in r:
                prof = f"{r['busy_ms']:8.1f} {r['wall_ms']:9.1f} {100 * r['busy_ms'] / r['wall_ms']:8.0f}"
            step_ms = 1e3 * tokens / r["tps"]
            print(f"{name:20s} {prec:5s} {r['tps']:10,.0f} {r['mfu']:6.1f} {r['mem']:6.1f} {step_ms:8.1f} "
                  f"{busy(r, tokens):>7s} {prof}")
    for prec in args.precisions.split(","):
        for num, den, target in RATIOS:
            if (num, prec) in results and (den, prec) in results:
                print(f"[{prec}] {num}/{den} {ratio((num, prec), (den, prec))} (target >= {target})")
    for name in args.rows.split(","):
        if (name, "fp8") in results and (name, "bf16") in results:
            print(f"[{name}] fp8/bf16 {ratio((name, 'fp8'), (name, 'bf16'))} (target >= 1.15)")
    if scaled:
        print(f"\nscaling 1 -> {args.nproc} GPUs (local batch {args.batch} each)")
        print(f"{'row':14s} {'prec':5s} {'tok/s/GPU x1':>12s} {f'x{args.nproc}':>12s} {'efficiency':>10s} {'GiB':>6s}")
        for (name, prec), r in scaled.items():
            r1 = results.get((name, prec))
            eff = f"{r['tps'] / r1['tps']:10.3f}" if r and r1 else f"{'n/a':>10s}"
            print(f"{name:14s} {prec:5s} {r1['tps'] if r1 else 0:12,.0f} {r['tps'] if r else 0:12,.0f} {eff} "
                  f"{r['mem'] if r else 0:6.1f}")


if __name__ == "__main__":
    main()
