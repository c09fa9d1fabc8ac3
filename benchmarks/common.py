"""Shared by the benchmark scripts, which import each other for nothing: everything two of them use lives here.

- Timing (CUDA events on a GPU, wall clock on a CPU) and profiles of a function's kernels and host cost.
- Runs of a checkout's ``train.py`` (``bench_train``, ``bench_context``): the launch, the common flags, the paper
  config of a checkout of either layout, the medians of ``metrics.jsonl``, and torchtitan's profiler with the
  summary of its traces (kernel classes, GPU-busy share, idle gaps and the host ops in them).
- The attention training columns (``bench_attention``'s table, ``profile_attention``'s profiled region).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F


# ------------------------------------------------------------------ timing
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


# ------------------------------------------------------------------ train.py runs
REPO = Path(__file__).resolve().parents[1]
"""This checkout: the default ``--repo`` of the scripts that run ``train.py``, and the folder they run in."""
ADAMW = ["--optimizer.name", "AdamW", "--optimizer.lr", "3e-4"]
"""train.py flags for AdamW at the paper's lr, in place of a config's optimizer (stock torchtitan trains with it)."""
PAPER_CONFIG_DIRS = ("attnlab/configs/paper", "configs/paper", "configs")
"""Where a checkout keeps the paper configurations, newest layout first: ``attnlab/configs/paper/`` (one package),
``configs/paper/`` (before it), ``configs/`` (before the paper folder). ``--repo`` may name an older checkout."""


def paper_config(repo: Path, name: str) -> Path:
    """The paper configuration ``name`` in checkout ``repo``: the first layout of :data:`PAPER_CONFIG_DIRS` that has
    it (the newest layout's path where none has, for the caller to report)."""
    for folder in PAPER_CONFIG_DIRS:
        path = repo / folder / f"{name}.toml"
        if path.is_file():
            return path
    return repo / PAPER_CONFIG_DIRS[0] / f"{name}.toml"


def train_flags(args, dump: Path, nproc: int = 1) -> list[str]:
    """The train.py flags every timed run shares: ``args``' data, tokenizer, batch (``args.batch`` per GPU over
    ``nproc`` GPUs), sequence and steps, its output in ``dump``, metrics every step, no validation, checkpoints or
    TensorBoard."""
    return ["--job.dump_folder", str(dump), "--model.hf_assets_path", args.tokenizer,
            "--training.dataset_path", args.data, "--training.local_batch_size", str(args.batch),
            "--training.global_batch_size", str(args.batch * nproc), "--training.seq_len", str(args.seq),
            "--training.steps", str(args.steps), "--metrics.log_freq", "1", "--validation.no-enable",
            "--checkpoint.no-enable", "--metrics.no-enable-tensorboard"]


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
             *sync_count(host, n), "  longest GPU idle gaps:"]
    for dur, a, b in sorted(idle, reverse=True)[:gaps]:
        inside = sorted((e for e in host if e["ts"] < b and e["ts"] + e["dur"] > a), key=lambda e: -e["dur"])[:3]
        lines.append(f"  {dur / 1e3:8.2f} ms at +{(a - t0) / 1e3:.1f} ms: "
                     + "; ".join(f"{e['name'][:50]} {e['dur'] / 1e3:.1f}ms" for e in inside))
    lines += idle_by_host_op(trace, sorted((a, b) for _, a, b in idle), n, top)
    return lines, {"busy_ms": busy / 1e3 / n, "wall_ms": (t1 - t0) / 1e3 / n}


def sync_count(host: list[dict], n: int) -> list[str]:
    """Host syncs per step: CUDA runtime calls that wait for the GPU (stream/device/event synchronize), each
    attributed to the innermost CPU op around it (``aten::item``, ``aten::nonzero``, a collective's wait, ...)."""
    waits = [e for e in host if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"]]
    ops = sorted((e for e in host if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    by_op: dict[str, int] = {}
    for w in waits:
        around = [e for e in ops if e["ts"] <= w["ts"] and e["ts"] + e["dur"] >= w["ts"] + w["dur"]]
        name = min(around, key=lambda e: e["dur"])["name"] if around else "(no CPU op)"
        by_op[name] = by_op.get(name, 0) + 1
    parts = ", ".join(f"{name} {count / n:g}" for name, count in sorted(by_op.items(), key=lambda x: -x[1])[:8])
    return [f"  host syncs per step: {len(waits) / n:g}" + (f" ({parts})" if parts else "")]


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


# ------------------------------------------------------------------ attention training columns
Factory = Callable[..., "Callable[[], torch.Tensor] | None"]
"""An attention column: builds, from its inputs, a zero-argument callable that returns the output (None when the
implementation is unavailable)."""


def _ours(probe: bool) -> Factory:
    def make(q, k, v, r):
        from attnlab.attention.ops.parallax.triton import parallax_triton

        return lambda: parallax_triton(q, k, v, r if probe else None)

    return make


def _sdpa(backend_name: str) -> Factory:
    def make(q, k, v, r):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def gqa():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

        try:
            gqa()
            return gqa
        except RuntimeError:  # backend without native GQA: repeat K/V outside the timed region
            G = q.shape[2] // k.shape[2]
            ke, ve = (t.repeat_interleave(G, dim=1).detach().requires_grad_(t.requires_grad) for t in (kt, vt))

            def rep():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, ke, ve, is_causal=True)

            rep()
            return rep

    return make


def _fla(q, k, v, r):
    from fla.ops.parallax import parallel_parallax

    return lambda: parallel_parallax(q, r, k, v)


def _parallax_kernel(q, k, v, r):
    from parallax import parallax_func

    qt, rt, kt, vt = (t.transpose(1, 2) for t in (q, r, k, v))
    return lambda: parallax_func(qt, rt, kt, vt)


TRAIN_COLUMNS: dict[str, tuple[Factory, bool]] = {  # name -> (factory, is_parallax for the FLOP count)
    "ours-parallax": (_ours(True), True),
    "ours-softmax": (_ours(False), False),
    "sdpa-cudnn": (_sdpa("CUDNN_ATTENTION"), False),
    "sdpa-flash": (_sdpa("FLASH_ATTENTION"), False),
    "fla-parallax": (_fla, True),
    "pk-parallax": (_parallax_kernel, True),
}
"""The attention training columns, each a factory(q, k, v, r) of [B, T, H, D] inputs (``q, r`` with 16 heads,
``k, v`` with 8): ``bench_attention``'s training table times them, ``profile_attention`` profiles them."""


if __name__ == "__main__":  # a module the tools import, not a tool: running it (--help included) says what it holds
    print(__doc__)
    raise SystemExit(0)
