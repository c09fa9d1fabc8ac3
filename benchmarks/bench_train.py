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
``benchmarks.common.trace_summary`` prints the GPU time by kernel class, the top kernels, the longest GPU-idle gaps
with the host ops inside them, and which host ops overlap the GPU's idle time in all (several traced steps show what
one step's gaps cannot: stalls that come every other step). Per-step tok/s varies, so medians want ~20 steps (the
defaults give steps 9–25). ``--repo DIR`` runs another checkout's ``train.py`` and paper configs with this script
(before/after rows of one change in one call; ``benchmarks.common.paper_config`` finds them in either layout).

``--data`` is a folder of JSONL files with a "text" field; ``--tokenizer`` a folder with tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (ADAMW, REPO, busy, check_trace_steps, first_profiled, paper_config, profiled,
                               profiling, run, side_by_side, summarize, train_flags)

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


def ours(args, name, fp8, out: Path, nproc: int = 1, devices: str = "") -> dict:
    """Our row ``name`` (:data:`ROWS`) through ``--repo``'s train.py on ``nproc`` GPUs: its medians, memory and loss
    (and busy/wall ms when traced), empty where the run logged no step after the warm-up."""
    config, extra = ROWS[name]
    dump = out / f"{name}_{'fp8' if fp8 else 'bf16'}{f'_x{nproc}' if nproc > 1 else ''}"
    repo = Path(args.repo)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0",
           "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(repo / "train.py"),
           "--job.config_file", str(paper_config(repo, config)), *train_flags(args, dump, nproc), *extra]
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


LINE = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps: ([\d,]+).*?mfu: ([\d.]+)%")


def stock(args, fp8, out: Path, nproc: int = 1, devices: str = "") -> dict:
    """Stock torchtitan qwen3 0.6B with the same data, tokenizer, batch, compile and AC (AdamW, its default)."""
    dump = out / f"stock_{'fp8' if fp8 else 'bf16'}{f'_x{nproc}' if nproc > 1 else ''}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0",
           "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "-m", "torchtitan.train",
           "--model.name", "qwen3", "--model.flavor", "0.6B", "--training.dataset", "c4_test",
           "--compile.enable", "--compile.components", "model,loss", "--activation_checkpoint.mode", "selective",
           "--training.mixed_precision_param", "bfloat16", *train_flags(args, dump, nproc)]
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
