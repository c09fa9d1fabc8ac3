"""The command line of :mod:`benchmarks.replicate` (its docstring says what it runs): ``python -m
benchmarks.replicate ...``; ``--train-one FLAGS`` is the child process that trains one run (train.py's main), ``--evaluate RUN ...`` the one that
evaluates a finished run (:mod:`benchmarks.replicate.evaluate`)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

from benchmarks import replicate
from benchmarks.common import REPO
from benchmarks.replicate.metrics import report_rows
from benchmarks.replicate.plan import BASE, RUNS, SUITES, suite_arms
from benchmarks.replicate.run import finish, run_replication, run_suite, train_tokenizer


def train_one(argv: list[str]) -> None:
    """``train.py`` in this process: what ``--train-one FLAGS`` runs, in each run's own child process."""
    from attnlab import train

    train.main(argv)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with the suite's defaults filled in and the comma lists parsed; ``ap.error`` (exit 2) on flags that
    do not go together or name unknown runs."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.replicate",
                                 description=replicate.__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="",
                    help="folder with val.jsonl.gz and train-*.jsonl.gz (all train shards there are used); "
                         "required unless --report")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "replication"),
                    help="folder of the runs, plots and summary")
    ap.add_argument("--runs", default="all",
                    help=f"comma-separated subset of {list(RUNS)}, or with --suite of the suite's arms")
    ap.add_argument("--suite", choices=list(SUITES), default="",
                    help="run a named arm set (module docstring) instead of the replication runs")
    ap.add_argument("--seeds", default="0", help="--suite: comma-separated seeds (debug.seed), one run per arm and seed")
    ap.add_argument("--gains", default="1,0.3,0.1", help="--suite dose: starting ρ-norm gains of the Parallax arms")
    ap.add_argument("--best-gain", type=float, default=0.1,
                    help="--suite: the gain of the 'best gain' arms (set it from the dose suite's result)")
    ap.add_argument("--adamw-lrs", default="5e-4,1e-3,2e-3", help="--suite horizon/adamw: the AdamW lrs")
    ap.add_argument("--adamw-warmup", type=int, default=0,
                    help="--suite horizon/adamw: linear lr warmup steps of the AdamW arms (0 = none; arms get _wu<N>)")
    ap.add_argument("--ood", default="",
                    help="--suite registry/registry_long: the out-of-domain text (file, folder or glob of "
                         ".txt/.jsonl[.gz]/.parquet, kept out of training) of the ood_ppl column (empty = no column)")
    ap.add_argument("--gpus", type=int, default=1,
                    help="--suite: train this many runs at once, each on its own GPU (the first N visible ones)")
    ap.add_argument("--arm-gpus", default="",
                    help="--suite: ARM=N,...: train these arms data-parallel over N GPUs each, for arms too slow to finish "
                         "within one call on one GPU (the same global batch and documents, but each rank packs its "
                         "own share of the documents into rows); N divides --batch, N <= --gpus")
    ap.add_argument("--chunk-steps", type=int, default=0,
                    help="--suite: at most this many steps per train.py launch (0 = as many as fit the budget)")
    ap.add_argument("--ckpt-every", type=int, default=None,
                    help="--suite: full checkpoint every N steps (default: the suite's, 200 for horizon, else none)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="total wall seconds for everything: sets the steps per run (0 = use --steps)")
    ap.add_argument("--margin-s", type=float, default=30.0, help="part of --budget-s kept for the end (plots, analyses)")
    ap.add_argument("--calib-steps", type=int, default=20, help="steps of each calibration run (--budget-s)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per run without --budget-s (default 300), or override a suite's steps")
    ap.add_argument("--max-steps", type=int, default=100000, help="cap on the budgeted steps")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 64, or the suite's)")
    ap.add_argument("--seq-len", type=int, default=None, help="training sequence length (default 1024, or the suite's)")
    ap.add_argument("--flavor", default="repl-68M", help="model.flavor of every run")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size of the trained tokenizer")
    ap.add_argument("--tokenizer", default="", help="reuse this tokenizer folder instead of training one")
    ap.add_argument("--tokenizer-docs", type=int, default=5000, help="corpus documents the tokenizer is trained on")
    ap.add_argument("--val-tokens", type=int, default=0,
                    help="validation tokens, rounded down to full batches (0 = the whole val file)")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="torch.compile (auto = on CUDA)")
    ap.add_argument("--workers", type=int, default=1, choices=(0, 1),
                    help="data-loader worker processes (tokenization off the training loop; more would repeat data)")
    ap.add_argument("--cache-dir", default="/tmp/repl_compile_cache", help="shared inductor/Triton cache")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run at most")
    ap.add_argument("--no-analyze", action="store_true", help="skip analyze.py on the finished runs")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep <run>/checkpoint (large) after the analyses")
    ap.add_argument("--fresh", action="store_true", help="retrain runs that already finished in --out")
    ap.add_argument("--report", action="store_true",
                    help="--suite: rebuild <out>/<suite>'s table, summary and plots from its run folders; no training")
    ap.add_argument("extra", nargs="*", help="more train.py flags for every run (after --)")
    args = ap.parse_args(argv)
    try:
        args.seeds = [int(x) for x in args.seeds.split(",")]
        args.gains = [float(x) for x in args.gains.split(",")]
        args.adamw_lrs = [float(x) for x in args.adamw_lrs.split(",")]
    except ValueError as e:
        ap.error(f"--seeds/--gains/--adamw-lrs: comma-separated numbers expected ({e})")
    suite = SUITES.get(args.suite, {})
    args.batch = args.batch or suite.get("batch") or 64
    args.seq_len = args.seq_len or suite.get("seq_len") or 1024
    args.steps = args.steps or suite.get("steps") or 300
    valid = (list(suite_arms(args.suite, args.gains, args.best_gain, args.adamw_lrs, args.adamw_warmup)) if args.suite
             else list(RUNS))
    bad = [] if args.runs == "all" else [n for n in args.runs.split(",") if n not in valid]
    if bad:
        ap.error(f"--runs: unknown {bad}; choose from {valid}")
    try:
        args.arm_gpus = {a: int(n) for a, _, n in (x.partition("=") for x in args.arm_gpus.split(",") if x)}
    except ValueError:
        ap.error(f"--arm-gpus {args.arm_gpus!r}: ARM=N,... expected (N a whole number)")
    for arm, n in args.arm_gpus.items():
        if not args.suite or arm not in valid:
            ap.error(f"--arm-gpus: {arm!r} is not an arm of --suite {args.suite!r}; choose from {valid}")
        if not 1 <= n <= args.gpus or args.batch % n:
            ap.error(f"--arm-gpus {arm}={n}: N must divide --batch {args.batch} and be 1..--gpus {args.gpus}")
    if args.report and not args.suite:
        ap.error("--report needs --suite")
    if not args.corpus and not args.report:
        ap.error("--corpus is required (a folder with val.jsonl.gz and train-*.jsonl.gz)")
    if args.ood and not glob.glob(args.ood) and not os.path.exists(args.ood):
        ap.error(f"--ood {args.ood!r}: no such file, folder or glob")
    args.ood = os.path.abspath(args.ood) if os.path.exists(args.ood) else args.ood
    if args.gpus < 1 or (args.gpus > 1 and not args.suite):
        ap.error(f"--gpus {args.gpus}: 1, or with --suite any number up to the visible GPUs")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Train the replication runs or a suite's arms in ``--out`` (``--report``: rebuild a suite's table from its run
    folders instead), then the plots, summary.json and table.txt; returns the table's rows."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--train-one"]:
        return train_one(argv[1:])
    if argv[:1] == ["--evaluate"]:
        from benchmarks.replicate import evaluate

        return evaluate.main(argv[1:])
    t0 = time.time()
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    os.makedirs(args.cache_dir, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(args.cache_dir, "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(args.cache_dir, "triton"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: only {torch.cuda.device_count()} GPUs are visible")
    compile_on = args.compile == "on" or (args.compile == "auto" and torch.cuda.is_available())
    budget = args.budget_s
    left = (lambda: budget - (time.time() - t0)) if budget > 0 else (lambda: float(args.timeout))  # noqa: E731
    log = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "compile": compile_on,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}

    if args.report:
        suite_out = os.path.join(out, args.suite)
        path = os.path.join(suite_out, "summary.json")
        recorded = json.load(open(path)) if os.path.isfile(path) else {}  # the runs' device, args, tokens per step
        log.update({k: v for k, v in recorded.items() if k != "runs"}, report=log["started"])
        return finish(suite_out, report_rows(suite_out), [], [], log, left, t0)
    train_files = sorted(glob.glob(os.path.join(args.corpus, "train-*.jsonl.gz")))
    val_file = os.path.join(args.corpus, "val.jsonl.gz")
    if not train_files or not os.path.isfile(val_file):
        raise SystemExit(f"--corpus {args.corpus!r}: needs train-*.jsonl.gz and val.jsonl.gz")
    t = time.time()
    tok = os.path.abspath(args.tokenizer) if args.tokenizer else train_tokenizer(
        args.corpus, os.path.join(out, "tokenizer"), args.vocab, args.tokenizer_docs)
    log["tokenizer_s"] = round(time.time() - t, 1)
    print(f"[replicate] tokenizer {tok} ({log['tokenizer_s']} s); train files "
          f"{[os.path.basename(f) for f in train_files]}", flush=True)

    k = args.batch * args.seq_len
    val_steps = max(1, args.val_tokens // k) if args.val_tokens > 0 else -1
    data = train_files[0] if len(train_files) == 1 else os.path.join(args.corpus, "train-*.jsonl.gz")
    common = ["--job.config_file", BASE, "--model.flavor", args.flavor, "--model.vocab_size", str(args.vocab),
              "--model.hf_assets_path", tok, "--training.dataset_path", data,
              "--validation.dataset_path", val_file,
              "--training.seq_len", str(args.seq_len), "--validation.seq_len", str(args.seq_len),
              "--training.local_batch_size", str(args.batch), "--validation.local_batch_size", str(args.batch),
              "--validation.steps", str(val_steps), "--training.dataloader.num_workers", str(args.workers),
              *(["--compile.enable"] if compile_on else []), *args.extra]
    log.update(tokens_per_step=k, val_tokens=k * val_steps if val_steps > 0 else "all")
    if args.suite:
        suite_out = os.path.join(out, args.suite)
        os.makedirs(suite_out, exist_ok=True)
        log["suite"] = args.suite
        results, background, cleanup = run_suite(args, suite_out, common, val_file, left if budget > 0 else None, log)
        return finish(suite_out, results, background, cleanup, log, left, t0, merge=True)
    results, background, cleanup = run_replication(args, out, common, val_file, left, log)
    return finish(out, results, background, cleanup, log, left, t0)


if __name__ == "__main__":
    main()
