"""Multi-GPU correctness: FSDP on K devices vs one device at the same global batch, and resume across world sizes.

    python -m attnlab.tools.multigpu_check                             # CUDA: 1 vs 2 vs 4 GPUs, resume 4->2, 2->4, 4->1
    python -m attnlab.tools.multigpu_check --nprocs 1,2 --resume 2:1 --device cpu   # gloo, CPU processes
    python -m attnlab.tools.multigpu_check --flavor 0.6B --seq 1024 -- --model.layer_pattern parallax # extra train args
    python -m attnlab.tools.multigpu_check --nprocs 1,2,4 --resume 4:2,2:4 --replicate 2   # HSDP 2 x 2 on 4 GPUs
    python -m attnlab.tools.multigpu_check --attention gdn --context-parallel -- --model.layer_pattern gdn   # CP 1/2/4

What it runs (each its own torchrun launch of python -m attnlab.train; Parallax + Muon, block_causal, compile off by
default):
  1. a seed checkpoint on one process (sharded and unsharded initialisation draw different random numbers);
  2. for every K in --nprocs: ``--steps`` steps on K processes from that seed, local batch G/max(K) per
     process and global batch G, so runs with fewer processes use gradient accumulation; checkpoint every
     steps/2. FSDP shards over K (Muon then runs its distributed path), so "1 vs K" also checks that
     distributed Muon equals single-device Muon and that gradient accumulation equals data parallelism;
  3. for every a:b in --resume: the a-process run's checkpoint at steps/2, resumed on b processes to --steps,
     compared with the uninterrupted runs (the data loader reshards its position, see attnlab/data/loader.py).
With ``--replicate R``, every run on more than R processes that R divides is HSDP (R replicas of K/R shards,
``parallelism.data_parallel_replicate_degree``), so "1 vs 4" checks HSDP against one device and the resumes move
a checkpoint between the HSDP and the plain FSDP layout. With ``--context-parallel``, every run on K > 1
processes splits each sequence over them instead (``parallelism.context_parallel_degree`` K, one data-parallel rank
with the whole global batch), so "1 vs K" checks context parallelism and the resumes change the CP degree.
Validation runs at the checkpoint steps and the last step on every process (each rank must run the same
number of validation batches, or a collective hangs); its losses are not compared, since K ranks read K times
the held-out batches. Loss curves are read from each run's metrics.jsonl; the table prints max |Δloss| against the 1-process run
and PASS/FAIL against --tol. Default tolerances: 1e-4 in float32 (CPU: only summation order differs),
3e-2 with bf16 (GPU: the 1-device run uses autocast over fp32 weights, FSDP bf16 parameters with fp32
reduction; differences grow over steps, so the tolerance is for ~12 steps).

The default data are synthetic (attnlab.testing.tiny_runs.make_corpus: a word-level tokenizer and documents that each
fill one packed row exactly), because only then do 1 and K processes see identical global batches. With real data
(--data/--tokenizer) each rank packs its own document stream, so rows differ and the curves agree only
statistically.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attnlab.testing.tiny_runs import losses, make_corpus, tiny_args
from attnlab.tools.launch import child_env, train_command


def base_args(args, corpus, dump: Path, steps: int, *extra: str) -> list[str]:
    out = tiny_args(corpus, dump, steps, args.seq, args.local_batch, "--training.global_batch_size",
                    str(args.global_batch), "--checkpoint.interval", str(max(1, args.steps // 2)),
                    "--validation.freq", str(max(1, args.steps // 2)), "--model.flavor", args.flavor, "--model.attention", args.attention,
                    "--model.attn_mask_type", "block_causal", "--optimizer.name", args.optimizer,
                    "--optimizer.lr", str(args.lr), "--checkpoint.keep_latest_k", "0", *extra)
    if args.vocab:
        out += ["--model.vocab_size", str(args.vocab)]
    if args.device == "cpu" and args.optimizer == "muon":
        out += ["--optimizer.muon_ns_dtype", "float32"]  # bf16 Newton-Schulz would amplify fp32 summation-order noise
    if args.device == "cuda":
        out = [a for a in out if a != "--debug.deterministic"]  # some CUDA kernels have no deterministic mode
        out += ["--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32"]
    return out + args.extra


def layout(args, k: int) -> list[str]:
    """Parallelism flags of a ``k``-process run: context parallelism over all k with ``--context-parallel``, HSDP
    over ``--replicate`` replicas where it applies, else FSDP."""
    r = args.replicate
    if args.context_parallel and k > 1:
        return ["--parallelism.context_parallel_degree", str(k), "--training.local_batch_size", str(args.global_batch)]
    if r > 1 and k > r and k % r == 0:
        return ["--parallelism.data_parallel_replicate_degree", str(r), "--parallelism.data_parallel_shard_degree",
                str(k // r)]
    return []


def launch(args, train_args: list[str], nproc: int, log: Path) -> tuple[bool, float]:
    """Training on ``nproc`` processes (torchrun unless 1); keeps the caller's PYTHONPATH (wheels elsewhere)."""
    env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = train_command(train_args, nproc)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        text, ok = p.stdout + p.stderr, p.returncode == 0
    except subprocess.TimeoutExpired:
        text, ok = f"TIMEOUT after {args.timeout}s", False
    log.write_text(text)
    if not ok:
        print(f"  FAILED ({nproc} procs), log {log}:\n{text[-2500:]}", file=sys.stderr, flush=True)
    return ok, time.time() - t0


def max_delta(a: dict[int, float], b: dict[int, float], steps) -> float:
    steps = list(steps)
    if not all(s in a and s in b for s in steps):
        return float("inf")
    return max(abs(a[s] - b[s]) for s in steps)


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import (ToolParser, dir_path, existing_dir, non_negative_float, non_negative_int,
                                      or_empty, positive_float, positive_int)

    ap = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (NCCL) or cpu (gloo)")
    ap.add_argument("--nprocs", default="", help="comma list; default 1,2,4 (cuda) / 1,2 (cpu)")
    ap.add_argument("--resume", default="", help="a:b pairs, e.g. 4:2,2:4,4:1; default 4:2,2:4,4:1 (cuda) / 2:1 (cpu)")
    ap.add_argument("--steps", type=non_negative_int, default=0, help="default 12 (cuda) / 4 (cpu); resume at steps/2")
    ap.add_argument("--flavor", default="debug", help="model.flavor")
    ap.add_argument("--attention", default="parallax", help="model.attention")
    ap.add_argument("--optimizer", default="muon", help="optimizer.name")
    ap.add_argument("--lr", type=positive_float, default=5e-3, help="optimizer.lr")
    ap.add_argument("--seq", type=non_negative_int, default=0, help="default 256 (cuda) / 16 (cpu)")
    ap.add_argument("--global-batch", type=non_negative_int, default=0,
                    help="sequences per step; default 16 (cuda) / 4 (cpu)")
    ap.add_argument("--vocab", type=non_negative_int, default=0,
                    help="model.vocab_size (default 64 with the synthetic corpus)")
    ap.add_argument("--data", default="", help="training files instead of the synthetic corpus")
    ap.add_argument("--tokenizer", type=or_empty(existing_dir), default="", help="tokenizer folder for --data")
    ap.add_argument("--tol", type=non_negative_float, default=0.0,
                    help="default 1e-4 (cpu, float32) / 3e-2 (cuda, bf16)")
    ap.add_argument("--replicate", type=positive_int, default=1,
                    help="HSDP replicas for runs on more processes than this that it divides (default 1: FSDP)")
    ap.add_argument("--context-parallel", action="store_true",
                    help="runs on K > 1 processes split every sequence over them (context parallelism) instead of "
                         "splitting the batch")
    ap.add_argument("--timeout", type=positive_int, default=600, help="seconds per launch")
    ap.add_argument("--out", type=or_empty(dir_path), default="", help="work folder (default: a temporary folder)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from attnlab.tools.common import split_train_flags

    own, extra = split_train_flags(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(own)
    args.extra = extra
    cuda = args.device == "cuda"
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    nprocs = sorted({int(k) for k in (args.nprocs or ("1,2,4" if cuda else "1,2")).split(",")} | {1})
    pairs = [tuple(int(x) for x in p.split(":")) for p in (args.resume or ("4:2,2:4,4:1" if cuda else "2:1")).split(",")
             if p]
    pairs = [(a, b) for a, b in pairs if a in nprocs and b in nprocs]
    args.steps = args.steps or (12 if cuda else 4)
    args.seq = args.seq or (256 if cuda else 16)
    args.global_batch = args.global_batch or (16 if cuda else 4)
    if args.global_batch % max(nprocs):
        ap.error(f"--global-batch {args.global_batch} must be a multiple of the largest process count {max(nprocs)}")
    args.local_batch = args.global_batch // max(nprocs)
    args.tol = args.tol or (3e-2 if cuda else 1e-4)
    out = Path(args.out or tempfile.mkdtemp(prefix="multigpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.data:
        corpus = {"tokenizer": args.tokenizer, "train": args.data, "val": args.data}
    else:
        corpus = make_corpus(out / "corpus", seq_len=args.seq,
                             n_train=args.global_batch * (args.steps + 2), n_val=4)
        args.vocab = args.vocab or 64
    half = max(1, args.steps // 2)
    print(f"{args.device}: {args.flavor} {args.attention}+{args.optimizer}, T={args.seq}, global batch "
          f"{args.global_batch} (local {args.local_batch}), {args.steps} steps; logs in {out}", flush=True)

    seed = out / "seed"
    ok, _ = launch(args, base_args(args, corpus, seed, 1, "--checkpoint.create_seed_checkpoint"), 1, out / "seed.log")
    if not ok:
        print("seed checkpoint failed; nothing compared")
        return 1
    init = ["--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0")]
    curves, times = {}, {}
    for k in nprocs:
        dump = out / f"np{k}"
        shutil.rmtree(dump, ignore_errors=True)
        ok, times[k] = launch(args, base_args(args, corpus, dump, args.steps, *init, *layout(args, k)), k,
                              out / f"np{k}.log")
        curves[k] = losses(dump) if ok and (dump / "metrics.jsonl").exists() else {}
        print(f"  {k} procs: {'ok' if ok else 'FAILED'} in {times[k]:.0f}s", flush=True)
    rows = []  # (what, steps, max delta, result)
    ref = curves[1]
    all_steps = range(1, args.steps + 1)
    for k in nprocs[1:]:
        d = max_delta(ref, curves[k], all_steps)
        if args.context_parallel:
            how = f"CP {k}, accum {max(nprocs)} vs 1"
        else:
            dp = f"HSDP {args.replicate}x{k // args.replicate}" if layout(args, k) else f"FSDP {k}"
            how = f"{dp}, accum {max(nprocs) // k} vs {max(nprocs)}"
        rows.append((f"1 vs {k} procs ({how})", f"1-{args.steps}", d))
    for a, b in pairs:
        dump = out / f"resume_{a}to{b}"
        shutil.rmtree(dump, ignore_errors=True)
        src = out / f"np{a}" / "checkpoint" / f"step-{half}"
        if not src.is_dir():
            rows.append((f"resume {a}->{b} procs at step {half}", "-", float("inf")))
            continue
        shutil.copytree(src, dump / "checkpoint" / f"step-{half}")
        ok, _ = launch(args, base_args(args, corpus, dump, args.steps, *init, *layout(args, b)), b,
                       out / f"resume_{a}to{b}.log")
        got = losses(dump) if ok and (dump / "metrics.jsonl").exists() else {}
        resumed = range(half + 1, args.steps + 1)
        if got and min(got) != half + 1:
            print(f"  resume {a}->{b}: first logged step {min(got)}, expected {half + 1} (did it resume?)")
            got = {}
        rows.append((f"resume {a}->{b} procs at step {half} vs 1 proc", f"{half + 1}-{args.steps}",
                     max_delta(ref, got, resumed)))
        rows.append((f"resume {a}->{b} procs at step {half} vs {b} procs", f"{half + 1}-{args.steps}",
                     max_delta(curves[b], got, resumed)))

    print("\nloss curves (1 proc): " + " ".join(f"{ref[s]:.4f}" for s in sorted(ref)))
    print(f"{'check':48s} {'steps':>7s} {'max|dloss|':>11s} {'tol':>8s}  result")
    failed = 0
    for what, steps, d in rows:
        res = "PASS" if d <= args.tol else "FAIL"
        failed += res == "FAIL"
        print(f"{what:48s} {steps:>7s} {d:11.3g} {args.tol:8.1g}  {res}")
    print(f"{len(rows) - failed}/{len(rows)} passed ({args.device}, tolerance {args.tol:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
