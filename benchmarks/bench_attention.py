"""Attention kernel benchmark: training fwd / fwd+bwd and decode (CUDA-graph replay) on one GPU.

    python -m benchmarks.bench_attention            # full tables
    python -m benchmarks.bench_attention --quick    # T=4096 only, decode B∈{1,32} × L∈{1k,4k,32k}
    python -m benchmarks.bench_attention --json out.json
    python -m benchmarks.bench_attention --tune-report   # ms of every candidate config of fwd / dq / dkv (< 2 min)
    python -m benchmarks.bench_attention --decode-only --quick   # decode table alone (default vs fused merge)
    python -m benchmarks.bench_attention --linear --quick        # + the linear family's rows, see below

Training rows: B=4, 16 q heads, 8 kv heads, causal, bf16, T ∈ {1024, 4096, 8192, 16384}, D ∈ {64, 128}.
FLOP counts (stated, not measured): causal softmax forward = 2·B·HQ·T²·D (two GEMMs, half the square);
Parallax forward = 2× that (two more GEMMs on the same tiles: ρ·Kᵀ and the second P·V); backward = 2.5× forward
(FlashAttention's convention), so fwd+bwd = 3.5× forward.

Decode rows: one new token, cache of L tokens (all valid), 16/8 heads, D=128, bf16; µs per call in CUDA-graph
replay; "floor" reads K and V once at 3.0 TB/s (about an H100's device-to-device copy bandwidth). Our columns come
twice: ``ours-*`` is the library default (a second merge kernel, launched as a programmatic dependent on Hopper),
``ours-*-fused`` folds the split merge into the split kernel (``merge="fused"``).

Tune report (``--tune-report``): for T=4096, D ∈ {64, 128}, probe and softmax, each kernel (fwd, dq, dkv) is
timed alone at every candidate config (the short autotune list plus ``common.TUNE_EXTRA_*``, after the
autotuner's prune), bypassing the autotuner. Compilation runs first in parallel worker processes (Triton's disk
cache then serves the timing process), so the compiles do not add up one after another.

Linear-family rows (``--linear``): the delta-rule ops (deltanet, gdn, kda, kda_bounded; every path) from
``benchmarks/bench_linear.py`` and gla, gated_linear, linear, fox, path from ``benchmarks/bench_linear_b.py``, at
B=4, T=4096, H=16, D=128 (all heads equal: these mechanisms have no GQA), each script with its own SDPA softmax row
measured in the same run. They run after this script's own tables, as those scripts' processes (their compiled
"chunk" rows have time budgets that kill a child process); ``--only-linear`` runs them alone.

Extending: add a factory to ``benchmarks.common.TRAIN_COLUMNS`` (name → factory(q, k, v, r) returning a zero-argument
callable that returns the output, or None when unavailable; ``profile_attention`` profiles the same columns) or to
``DECODE`` (name → factory(q, r, k_cache, v_cache, seqlens)). Inputs are [B, T, H, D] (``q, r`` with 16 heads,
``k, v`` with 8).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import TRAIN_COLUMNS, Factory, median_ms, queued_ms

TIMING = "queued"
"""How the training table times a call: "queued" (back-to-back calls, host launch cost overlapped as in training;
the default) or "percall" (sync after each call: adds each call's host latency)."""


def bench_ms(fn, rep: int = 20, warmup: int = 5) -> float:
    return queued_ms(fn, rep=rep // 2, warmup=warmup) if TIMING == "queued" else median_ms(fn, rep=rep, warmup=warmup)


# ------------------------------------------------------------------ decode columns
def _ours_decode(probe: bool, merge: str | None = None) -> Factory:
    def make(q, r, kc, vc, seqlens):
        from attnlab.attention.ops.parallax.triton import parallax_decode_triton

        return lambda: parallax_decode_triton(q, kc, vc, seqlens, r if probe else None, merge=merge)

    return make


def _sdpa_decode(q, r, kc, vc, seqlens):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, kc, vc))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)


def _fla_decode(q, r, kc, vc, seqlens):
    from fla.ops.parallax.decode import parallax_decode_one_step

    return lambda: parallax_decode_one_step(q, r, kc, vc)


DECODE: dict[str, Factory] = {
    "ours-parallax": _ours_decode(True),
    "ours-parallax-fused": _ours_decode(True, "fused"),
    "ours-softmax": _ours_decode(False),
    "ours-softmax-fused": _ours_decode(False, "fused"),
    "sdpa": _sdpa_decode,
    "fla-parallax": _fla_decode,
}


# ------------------------------------------------------------------ timing
def graph_us(fn: Callable[[], object], iters: int = 50) -> float:
    """µs per call replaying a CUDA graph that holds ``iters`` calls (launch overhead amortised)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (5 * iters)


def run_train(T: int, D: int, names: list[str], B=4, HQ=16, HKV=8) -> dict:
    dev, dt = "cuda", torch.bfloat16
    q, r = torch.randn(B, T, HQ, D, device=dev, dtype=dt), 0.3 * torch.randn(B, T, HQ, D, device=dev, dtype=dt)
    k, v = torch.randn(B, T, HKV, D, device=dev, dtype=dt), torch.randn(B, T, HKV, D, device=dev, dtype=dt)
    for t in (q, k, v, r):
        t.requires_grad_(True)
    flops_sm = 2 * B * HQ * T * T * D
    row = {}
    for name in names:
        factory, is_px = TRAIN_COLUMNS[name]
        try:
            fn = factory(q, k, v, r)
            do = None

            def fwd_bwd():
                nonlocal do
                o = fn()
                do = torch.randn_like(o) if do is None else do
                o.backward(do)
                for t in (q, k, v, r):
                    t.grad = None

            t0 = time.time()  # the first fwd + bwd: compiles and autotunes all three kernels at a new key
            fwd_bwd()
            torch.cuda.synchronize()
            first = time.time() - t0

            with torch.no_grad():
                ms_f = bench_ms(fn)
            fwd_bwd()
            ms_fb = bench_ms(fwd_bwd)
        except Exception as e:  # noqa: BLE001 — a missing/crashing baseline is reported, not fatal
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            print(f"  T={T} D={D} {name}: {row[name]['error']}", flush=True)
            continue
        fl = flops_sm * (2 if is_px else 1)
        row[name] = {"fwd_ms": ms_f, "fwdbwd_ms": ms_fb, "fwd_tflops": fl / ms_f / 1e9,
                     "fwdbwd_tflops": 3.5 * fl / ms_fb / 1e9, "first_call_s": first}
        print(f"  T={T} D={D} {name:14s} fwd {ms_f:7.3f} ms ({row[name]['fwd_tflops']:5.0f} TF/s)  fwd+bwd "
              f"{ms_fb:7.3f} ms ({row[name]['fwdbwd_tflops']:5.0f} TF/s)  first fwd+bwd {first:.1f}s", flush=True)
    return row


def run_decode(B: int, L: int, names: list[str], HQ=16, HKV=8, D=128, quiet=False) -> dict:
    dev, dt = "cuda", torch.bfloat16
    q, r = torch.randn(B, 1, HQ, D, device=dev, dtype=dt), 0.3 * torch.randn(B, 1, HQ, D, device=dev, dtype=dt)
    kc, vc = torch.randn(B, L, HKV, D, device=dev, dtype=dt), torch.randn(B, L, HKV, D, device=dev, dtype=dt)
    seqlens = torch.full((B,), L, device=dev, dtype=torch.int32)
    row = {"floor_us": 2 * kc.numel() * kc.element_size() / 3.0e12 * 1e6}
    for name in names:
        try:
            us = graph_us(DECODE[name](q, r, kc, vc, seqlens))
        except Exception as e:  # noqa: BLE001
            row[name] = None
            print(f"  decode B={B} L={L} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        row[name] = us
        if not quiet:
            print(f"  decode B={B:3d} L={L:5d} {name:14s} {us:8.1f} us", flush=True)
    del kc, vc
    torch.cuda.empty_cache()
    return row


def available(names: list[str]) -> list[str]:
    out = []
    for n in names:
        mod = {"fla-parallax": "fla", "pk-parallax": "parallax"}.get(n)
        if mod is not None:
            try:
                __import__(mod)
            except Exception as e:  # noqa: BLE001
                print(f"[skip] {n}: {type(e).__name__}: {e}")
                continue
        out.append(n)
    return out


def fmt(x, spec="7.3f"):
    return format(x, spec) if isinstance(x, (int, float)) else "   -   "


def report(train: dict, decode: dict) -> str:
    lines = []
    names = sorted({n for row in train.values() for n in row}, key=list(TRAIN_COLUMNS).index)
    lines.append("## training, ms (B=4, HQ=16, HKV=8, bf16, causal)")
    lines.append("| shape | pass | " + " | ".join(names) + " |")
    lines.append("|---" * (len(names) + 2) + "|")
    for key, row in train.items():
        for p in ("fwd", "fwdbwd"):
            cells = [fmt(row.get(n, {}).get(f"{p}_ms")) for n in names]
            lines.append(f"| {key} | {p} | " + " | ".join(cells) + " |")
    lines.append("\n## training, TFLOP/s (stated FLOP counts; Parallax counted as 2x softmax)")
    lines.append("| shape | pass | " + " | ".join(names) + " |")
    lines.append("|---" * (len(names) + 2) + "|")
    for key, row in train.items():
        for p in ("fwd", "fwdbwd"):
            cells = [fmt(row.get(n, {}).get(f"{p}_tflops"), "5.0f") for n in names]
            lines.append(f"| {key} | {p} | " + " | ".join(cells) + " |")
    if decode:
        dn = sorted({n for row in decode.values() for n in row if n != "floor_us"}, key=list(DECODE).index)
        lines.append("\n## decode, us per call (CUDA graph; 1 new token, 16/8 heads, D=128, bf16)")
        lines.append("| B, L | " + " | ".join(dn) + " | floor | ours-parallax / sdpa | fused / default |")
        lines.append("|---" * (len(dn) + 4) + "|")

        def div(row, a, b):
            return row[a] / row[b] if row.get(a) and row.get(b) else None

        for key, row in decode.items():
            lines.append(f"| {key} | " + " | ".join(fmt(row.get(n), "8.1f") for n in dn)
                         + f" | {row['floor_us']:.1f} | {fmt(div(row, 'ours-parallax', 'sdpa'), '.2f')}"
                         + f" | {fmt(div(row, 'ours-parallax-fused', 'ours-parallax'), '.2f')} |")
    lines.append("\n## ratios against the issue-8 targets")
    lines.extend(targets(train, decode))
    return "\n".join(lines)


def targets(train: dict, decode: dict) -> list[str]:
    out = []

    def get(shape, name, p):
        v = train.get(shape, {}).get(name, {})
        return v.get(f"{p}_ms") if isinstance(v, dict) else None

    def ratio(line, a, b, target):
        if a and b:
            out.append(f"- {line}: {a / b:.2f}x (target <= {target}x) {'OK' if a / b <= target else 'MISSED'}")
        else:
            out.append(f"- {line}: n/a")

    s = "T4096_D128"
    ratio("Parallax fwd+bwd / SDPA-cuDNN fwd+bwd (T=4096, D=128)", get(s, "ours-parallax", "fwdbwd"),
          get(s, "sdpa-cudnn", "fwdbwd"), 1.8)
    ratio("Parallax fwd / SDPA-cuDNN fwd (T=4096, D=128)", get(s, "ours-parallax", "fwd"),
          get(s, "sdpa-cudnn", "fwd"), 2.0)
    ratio("Parallax D=64 fwd+bwd / our softmax D=128 fwd+bwd (T=4096)", get("T4096_D64", "ours-parallax", "fwdbwd"),
          get(s, "ours-softmax", "fwdbwd"), 1.0)
    ratio("Parallax D=64 fwd+bwd / SDPA-cuDNN D=128 fwd+bwd (T=4096)", get("T4096_D64", "ours-parallax", "fwdbwd"),
          get(s, "sdpa-cudnn", "fwdbwd"), 1.0)
    ratio("our softmax fwd+bwd / SDPA-cuDNN fwd+bwd (T=4096, D=128)", get(s, "ours-softmax", "fwdbwd"),
          get(s, "sdpa-cudnn", "fwdbwd"), 1.3)
    for base in ("fla-parallax", "pk-parallax"):
        ratio(f"Parallax fwd+bwd / {base} fwd+bwd (T=4096, D=128)", get(s, "ours-parallax", "fwdbwd"),
              get(s, base, "fwdbwd"), 1.0)
    worst = [(row["ours-parallax"] / row["sdpa"], k) for k, row in decode.items()
             if row.get("ours-parallax") and row.get("sdpa")]
    if worst:
        w, k = max(worst)
        out.append(f"- decode ours-parallax / SDPA, worst cell {k}: {w:.2f}x (target <= 1.0x) "
                   f"{'OK' if w <= 1.0 else 'MISSED'}")
    return out


def best_configs() -> list[str]:
    """The autotuner's pick per key for each of our kernels (printed so the short lists can be re-pruned)."""
    from attnlab.attention.ops.parallax.triton import autotuned_kernels

    out = []
    for kern in autotuned_kernels().values():
        for key, cfg in getattr(kern, "cache", {}).items():
            out.append(f"{kern.fn.__name__} key={key[:7]} -> {cfg}")
    return out


def sweep_decode(cells=((1, 4096), (1, 32768), (32, 4096), (32, 32768), (128, 4096))) -> list[str]:
    """Time the decode kernel over tile / split parameters (module globals of kernels.ops)."""
    from attnlab.attention.ops.parallax.triton import ops as kops

    lines = []
    base = (dict(kops.DECODE_CFG), kops.MIN_KEYS_PER_SPLIT, kops.WAVES)
    for bn in (64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                for min_keys, waves in ((64, 1), (128, 1), (256, 1), (64, 2), (256, 2)):
                    kops.DECODE_CFG.update(BN=bn, num_warps=warps, num_stages=stages)
                    kops.MIN_KEYS_PER_SPLIT, kops.WAVES = min_keys, waves
                    cells_us = []
                    for B, L in cells:
                        try:
                            cells_us.append(run_decode(B, L, ["ours-parallax"], quiet=True)["ours-parallax"])
                        except Exception as e:  # noqa: BLE001
                            cells_us.append(None)
                            print(e)
                    line = f"BN={bn} w={warps} s={stages} min_keys={min_keys} waves={waves}: " + " ".join(
                        fmt(u, "8.1f") for u in cells_us)
                    print(line, flush=True)
                    lines.append(line)
    kops.DECODE_CFG.update(base[0])
    kops.MIN_KEYS_PER_SPLIT, kops.WAVES = base[1], base[2]
    return lines


# ------------------------------------------------------------------ tune report
TUNE_T, TUNE_DS, TUNE_B, TUNE_HQ, TUNE_HKV, TUNE_DEVICE, TUNE_DTYPE = 4096, (64, 128), 4, 16, 8, "cuda", torch.bfloat16


TUNE_KERNELS = ("fwd", "dq", "dkv")
TUNE_VARIANTS = False
"""--tune-variants: each candidate also with TMA tile loads in its mask-free loop (TMA: K/V in the forward and
the row pass, Q/ρ/dO in the column pass) and, in the forward, that loop warp-specialised (WS, 8 warps); such specs
carry two more entries (tma, ws)."""


def tune_jobs() -> list[tuple[int, bool, str, tuple]]:
    """(D, probe, kernel, (tile0, tile1, warps, stages[, kv_tma, ws])) for every candidate the report times; tiles
    are (BM, BN) for fwd/dq and (BN, BM) for dkv, as in common.py."""
    from attnlab.attention.ops.parallax.triton import common

    lists = {"fwd": (common.FWD_SPECS + common.TUNE_EXTRA_FWD + [TUNE_FILL], common.prune_fwd, ("BM", "BN")),
             "dq": (common.DQ_SPECS + common.TUNE_EXTRA_DQ + [TUNE_FILL], common.prune_bwd, ("BM", "BN")),
             "dkv": (common.DKV_SPECS + common.TUNE_EXTRA_DKV, common.prune_bwd, ("BN", "BM"))}
    jobs = []
    for D in TUNE_DS:
        for probe in (True, False):
            for kern, (specs, prune, names) in lists.items():
                specs = list(dict.fromkeys(specs))
                kept = {_config_key(c.kwargs, c.num_warps, c.num_stages)
                        for c in prune(common.configs(specs, names), {}, D=D, HAS_PROBE=probe)}
                if kern not in TUNE_KERNELS:
                    continue
                kept_specs = [s for s in specs if _config_key(common.spec_kwargs(s, names), *s[2:4]) in kept]
                jobs += [(D, probe, kern, s) for s in kept_specs]
                if TUNE_VARIANTS:  # warp specialisation: the forward only, at 8 warps (Triton 3.6)
                    flags = ((1, 0), (0, 1), (1, 1)) if kern == "fwd" else ((1, 0),)
                    jobs += [(D, probe, kern, s + f) for s in kept_specs if len(s) == 4 and s != TUNE_FILL
                             for f in flags if s[2] >= 8 or not f[1]]
    return list(dict.fromkeys(jobs))


def _config_key(kwargs: dict, warps: int, stages: int) -> tuple:
    """A candidate's identity: its meta-parameters (flags that are off count as absent), warps and stages."""
    return tuple(sorted((k, v) for k, v in kwargs.items() if v is not False)), warps, stages


TUNE_FILL = (64, 64, 4, 3)  # config that computes lse, t̄ (fwd) and τ, β (dq) for the timing pass


def _tune_tensors(D: int, probe: bool, real: bool = True) -> dict:
    """Inputs plus every buffer the three launches read or write. real: run the forward (and the row pass) at
    TUNE_FILL so lse, t̄, τ, β hold real values; the compile workers skip this (values don't matter there)."""

    B, T, HQ, HKV, dev, dt = TUNE_B, TUNE_T, TUNE_HQ, TUNE_HKV, TUNE_DEVICE, TUNE_DTYPE
    g = torch.Generator(device=dev).manual_seed(0)
    q, do = (torch.randn(B, T, HQ, D, device=dev, dtype=dt, generator=g) for _ in range(2))
    k, v = (torch.randn(B, T, HKV, D, device=dev, dtype=dt, generator=g) for _ in range(2))
    r = 0.3 * torch.randn(B, T, HQ, D, device=dev, dtype=dt, generator=g) if probe else None
    lse = torch.zeros(HQ, B * T, device=dev)
    x = dict(q=q, k=k, v=v, r=r, do=do, o=torch.zeros_like(q), lse=lse, vbar=torch.zeros_like(q),
             tbar=torch.zeros_like(lse), tau=torch.zeros_like(lse), beta=torch.zeros_like(lse), dq=torch.empty_like(q),
             dr=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
    if real:
        _tune_call(x, "fwd", TUNE_FILL, D, out=x)()
        _tune_call(x, "dq", TUNE_FILL, D)()
    return x


def _tune_call(x: dict, kern: str, spec: tuple, D: int, out: dict | None = None) -> Callable[[], None]:
    """One launch of ``kern`` at ``spec`` (no autotuner); the forward writes into ``out`` or scratch buffers."""
    from attnlab.attention.ops.parallax.triton import ops as kops

    from attnlab.attention.ops.parallax.triton.common import spec_kwargs

    cfg = dict(spec_kwargs(spec, ("BN", "BM") if kern == "dkv" else ("BM", "BN")), num_warps=spec[2],
               num_stages=spec[3])
    scale = D**-0.5
    if kern == "fwd":
        o, lse, vbar, tbar = (out[n] if out is not None else torch.empty_like(x[n])
                              for n in ("o", "lse", "vbar", "tbar"))
        return lambda: kops.launch_fwd(x["q"], x["k"], x["v"], x["r"], o, lse, vbar, tbar, None, scale, 0, 0,
                                       config=cfg)
    common = (x["do"], x["q"], x["k"], x["v"], x["r"], x["o"], x["lse"], x["vbar"], x["tbar"], x["tau"], x["beta"],
              None, scale, 0, 0)
    if kern == "dq":
        return lambda: kops.launch_dq(*common, x["dq"], x["dr"], config=cfg)
    return lambda: kops.launch_dkv(*common, x["dk"], x["dv"], config=cfg)


def tune_worker(index: int, count: int) -> None:
    """Compile (one launch each) the jobs index, index + count, ...; fills Triton's disk cache."""
    jobs = tune_jobs()[index::count]
    cells: dict = {}
    for D, probe, kern, spec in jobs:
        x = cells.get((D, probe)) or cells.setdefault((D, probe), _tune_tensors(D, probe, real=False))
        try:
            _tune_call(x, kern, spec, D)()
        except Exception as e:  # noqa: BLE001 — e.g. out of shared memory: reported by the timing pass
            print(f"[worker {index}] D={D} probe={probe} {kern} {spec}: {type(e).__name__}", flush=True)
    torch.cuda.synchronize()


def tune_report(workers: int) -> list[str]:
    """Per-kernel ms of every candidate config; compiles in ``workers`` processes first."""
    import subprocess

    t0 = time.time()
    if workers > 0:
        cmd = [sys.executable, "-m", "benchmarks.bench_attention", "--tune-kernels", ",".join(TUNE_KERNELS),
               "--tune-ds", ",".join(map(str, TUNE_DS))]
        cmd += ["--tune-variants"] * TUNE_VARIANTS + ["--tune-worker"]
        procs = [subprocess.Popen(cmd + [f"{i}/{workers}"]) for i in range(workers)]
        for p in procs:
            p.wait()
        print(f"# compiled {len(tune_jobs())} configs in {workers} processes: {time.time() - t0:.0f}s", flush=True)
    rows: dict = {}
    for D, probe, kern, spec in tune_jobs():
        key = (D, probe)
        if key not in rows:
            rows[key] = {"x": _tune_tensors(D, probe), "res": []}
        try:
            ms = bench_ms(_tune_call(rows[key]["x"], kern, spec, D), rep=10, warmup=2)
        except Exception as e:  # noqa: BLE001
            ms = None
            print(f"  D={D} probe={probe} {kern} {spec}: {type(e).__name__}: {str(e)[:100]}", flush=True)
        rows[key]["res"].append((kern, spec, ms))
    lines = [f"## tune report: ms per kernel alone, T={TUNE_T}, B={TUNE_B}, {TUNE_HQ}/{TUNE_HKV} heads, bf16, causal "
             f"({time.time() - t0:.0f}s); config = (tile, tile, warps, stages): (BM, BN) fwd/dq, (BN, BM) dkv; "
             "* = best, [short] = in the current short list"]
    from attnlab.attention.ops.parallax.triton import common

    short = {"fwd": common.FWD_SPECS, "dq": common.DQ_SPECS, "dkv": common.DKV_SPECS}
    for (D, probe), row in rows.items():
        lines.append(f"### D={D} {'parallax' if probe else 'softmax'}")
        for kern in TUNE_KERNELS:
            res = [(ms, spec) for k, spec, ms in row["res"] if k == kern]
            best = min((ms for ms, _ in res if ms is not None), default=None)
            cells = [f"{spec}{'[short]' if spec in short[kern] else ''}={fmt(ms, '.3f').strip()}"
                     f"{'*' if ms is not None and ms == best else ''}" for ms, spec in res]
            lines.append(f"- {kern:3s}: " + "  ".join(cells))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T=4096 only; decode B in {1, 32} x L in {1k, 4k, 32k}")
    ap.add_argument("--only", default="", help="comma-separated column names (default: all available)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode table")
    ap.add_argument("--json", default="", help="also write the raw numbers here")
    ap.add_argument("--sweep", action="store_true",
                    help="wide autotune lists (PARALLAX_WIDE_TUNE=1) at T=4096 for our kernels, then a decode sweep")
    ap.add_argument("--tune-report", action="store_true",
                    help="ms of fwd, dq, dkv alone at each candidate config, T=4096, D in {64, 128}, probe/softmax")
    ap.add_argument("--tune-workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)),
                    help="compile processes for --tune-report (0: compile in the timing process)")
    ap.add_argument("--timing", choices=("queued", "percall"), default="queued",
                    help="queued: back-to-back calls between two events (default); percall: sync after each call")
    ap.add_argument("--tune-kernels", default="fwd,dq,dkv", help="kernels the tune report times")
    ap.add_argument("--tune-ds", default="64,128", help="head dims the tune report times")
    ap.add_argument("--tune-variants", action="store_true",
                    help="tune report: candidates also with TMA tile loads and a warp-specialised loop")
    ap.add_argument("--tune-worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--decode-only", action="store_true", help="skip the training tables")
    ap.add_argument("--decode-cells", default="", help="decode cells as BxL,BxL,... (e.g. 1x1024,1x4096)")
    ap.add_argument("--linear", action="store_true", help="then the linear family's rows (bench_linear*.py)")
    ap.add_argument("--only-linear", action="store_true", help="only the linear family's rows")
    args = ap.parse_args()
    if args.only_linear:
        run_linear(args.quick)
        return
    global TUNE_KERNELS, TUNE_VARIANTS, TUNE_DS, TIMING
    TUNE_KERNELS, TUNE_VARIANTS = tuple(args.tune_kernels.split(",")), args.tune_variants
    TUNE_DS = tuple(int(d) for d in args.tune_ds.split(","))
    TIMING = args.timing
    if args.tune_worker:
        tune_worker(*map(int, args.tune_worker.split("/")))
        return
    if args.tune_report:
        import triton

        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
        print("\n".join(tune_report(args.tune_workers)))
        return
    if args.sweep:
        os.environ["PARALLAX_WIDE_TUNE"] = "1"
        for D in (64, 128):
            run_train(4096, D, ["ours-parallax", "ours-softmax"])
        print("\n".join(best_configs()))
        sweep_decode()
        return
    names = available(args.only.split(",") if args.only else list(TRAIN_COLUMNS))
    Ts = [4096] if args.quick else [1024, 4096, 8192, 16384]
    import triton

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    train = {}
    Ds = () if args.decode_only else (64, 128)
    for D in Ds:
        # T=4096 (the targets' shape) first: autotune keys hold no T, so a column keeps the tiles picked there
        for T in sorted(Ts, key=lambda t: t != 4096):
            train[f"T{T}_D{D}"] = run_train(T, D, names)
    train = {f"T{T}_D{D}": train[f"T{T}_D{D}"] for D in Ds for T in Ts}  # back in table order
    decode = {}
    if not args.no_decode:
        dnames = [n for n in DECODE if n != "fla-parallax" or "fla-parallax" in names]
        Bs, Ls = ([1, 32], [1024, 4096, 32768]) if args.quick else ([1, 8, 32, 128], [1024, 4096, 16384, 32768])
        cells = [tuple(map(int, c.split("x"))) for c in args.decode_cells.split(",")] if args.decode_cells else [
            (B, L) for B in Bs for L in Ls]
        for B, L in cells:
            decode[f"B{B}_L{L}"] = run_decode(B, L, dnames)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "train": train, "decode": decode}, f, indent=1)
    print("\n".join(best_configs()))
    print("\n" + report(train, decode))
    if args.linear:
        run_linear(args.quick)


def run_linear(quick: bool) -> None:
    """The linear family's rows: ``bench_linear.py`` (delta rule) then ``bench_linear_b.py`` (the rest), each in its
    own process, at their default shape B4 T4096 H16 D128."""
    import subprocess

    q = ["--quick"] if quick else []
    for cmd in (["benchmarks.bench_linear", "--mechs", "deltanet", "gdn", "kda", "kda_bounded",
                 "--paths", "fla", "fla_hopper", "chunk"], ["benchmarks.bench_linear_b"]):
        print(f"\n# linear family: python -m {' '.join(cmd + q)}", flush=True)
        subprocess.run([sys.executable, "-m", *cmd, *q], check=True)


if __name__ == "__main__":
    main()
