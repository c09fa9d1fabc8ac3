"""Small-scale replication of the Parallax paper's direction: equal-token runs of a ~68M model.

    python -m benchmarks.replicate --corpus DIR --out DIR [--budget-s 520] [--runs all]
        [--steps 300 --batch 64 --seq-len 1024 --flavor repl-68M] [--val-tokens 0] [--no-analyze]
    python -m benchmarks.replicate --corpus DIR --out DIR --suite dose|horizon|adamw|context [--seeds 0,1] [--runs ARMS]
        [--budget-s 540] [--chunk-steps N] [--best-gain 0.1] [--gains 1,0.3,0.1] [--adamw-lrs 5e-4,1e-3,2e-3] [--gpus N]

Suites (the probe's starting strength, the horizon, the mask) are named arm sets at fixed steps, each
arm run once per seed (``<arm>_s<seed>``, ``--debug.seed``), in ``<out>/<suite>/`` with the tokenizer shared in
``<out>/tokenizer`` (see :func:`suite_arms`); ``--gpus N`` trains N runs at once, one per GPU:

- ``dose`` (160 steps, Muon): softmax; Parallax at each ``--gains`` starting ρ-norm gain
  (``attention.parallax.rho_norm_init``); Parallax at ``--best-gain`` with the ρ-norm lr at 1× optimizer.lr
  (``optimizer.lr_mult_patterns``) instead of the norm group's 0.015×;
- ``horizon`` (1,600 steps, validation every 200): softmax and Parallax at gain 1 and at ``--best-gain`` under
  Muon, and at ``--best-gain`` with the ρ-norm lr at 1×; softmax and Parallax (gain 1) under AdamW at each of
  ``--adamw-lrs`` (with ``--adamw-warmup N`` steps of linear warmup);
- ``adamw`` (400 steps, validation every 100): the AdamW lr sweep alone, softmax and Parallax (gain 1) at each
  ``--adamw-lrs``, shorter than the horizon so that the sweep is affordable; the horizon's AdamW pair then runs at
  the lr it picks (``--suite horizon --adamw-lrs LR``);
- ``context`` (160 steps, sequence 4096, batch 16: the same tokens per step as 64 × 1024): softmax, Parallax at
  gain 1 and at ``--best-gain``, each with ``causal`` and ``block_causal`` masks.

A suite run fits device calls of limited length: ``--budget-s`` is this call's wall time, a run trains in chunks
of at most ``--chunk-steps`` steps (``training.stop_after_step``; a full checkpoint at each stop) sized to what fits
in the time left, and a run that does not finish is paused with a resumable checkpoint; the same command resumes
it from ``<run>/checkpoint`` (and skips finished runs) until the table has every run. ``<out>/<suite>/table.txt``
and ``summary.json`` keep the rows of earlier calls (other seeds or arms) beside this call's.

Runs (each ``steps`` × batch × seq tokens, equal for all but ``converted``; Parallax with the paper's ρ-norm gain 1):

| run               | mixer    | optimizer / schedule                                     |
|-------------------|----------|----------------------------------------------------------|
| softmax_muon      | softmax  | Muon lr 5e-3 wd 0.1, WSD (decay last 20 %)               |
| parallax_muon     | parallax | same                                                     |
| softmax_adamw     | softmax  | AdamW lr 1e-3 wd 0.1 β (0.9, 0.95), WSD                   |
| parallax_adamw    | parallax | same                                                     |
| parallax_muon_wd2 | parallax | Muon + weight-decay annealing γ = 2 (eq. 42)              |
| converted         | parallax | softmax_muon's checkpoint → Parallax with W_R = 0 (attnlab/tools/convert_to_parallax.py), fine-tuned steps/4 more |
| gdn_muon          | gdn      | Muon, WSD; runs last (see the budget)                    |

Pipeline: a BPE tokenizer (``--vocab`` tokens) is trained on the first ``--tokenizer-docs`` documents of
``train-00.jsonl.gz`` (cached in ``<out>/tokenizer``; ``--tokenizer DIR`` reuses one); every run trains through
``train.py`` in its own process (base config ``attnlab/configs/replication/repl_base.toml``, bf16 autocast, compiled
on CUDA, one data-loader worker) on all ``train-*.jsonl.gz`` of ``--corpus`` and validates on the first
``--val-tokens`` tokens of ``val.jsonl.gz`` (full batches only) at its last step. Softmax/Parallax runs are
analysed with ``attnlab/tools/analyze.py`` (on the CPU) in the background while the next run trains; checkpoints are deleted
afterwards (``--keep-checkpoints`` keeps them) so ``<out>`` stays small. A failed run is reported in the table and
does not stop the others. Outputs, all under ``<out>``: ``summary.json``, ``table.txt`` (also printed last),
``ppl.png`` (perplexity curves of all runs), ``diagnostics_by_layer.png`` (COR/CPA/entropy/sink per layer of
every analysed run), ``<run>/{metrics.jsonl,train.log,analysis/}``, ``calibration/``.

Budget (``--budget-s``, total wall seconds from the start of this script): after the tokenizer, a short
calibration run (``--calib-steps`` steps) per mechanism (softmax, parallax, gdn) measures the fixed cost per run
(process start, compile, validation) and the training tokens/s, and warms the shared compile cache
(TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR, default ``/tmp/repl_compile_cache``); with compile on, softmax is
calibrated once more (warm cache) and every fixed cost is scaled by its warm/cold ratio. Then ``steps`` is the largest
value for which 2 softmax runs, 3 Parallax runs, the converted fine-tune (steps/4) and one more Parallax-sized
slot for GDN fit in the time left. GDN runs last and gets ``min(steps, what fits in the remaining time)``: equal
tokens if it is fast enough or the fixed costs were overestimated,
fewer otherwise (the table says so). AdamW lr: the paper's 3e-4 is for 0.6B/20k steps; a short run of a ~68M
model needs a larger one, but 3e-3 without warmup was unstable (softmax val ppl 483 against 91 under Muon at 10.5M
tokens), hence 1e-3.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import math
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(REPO, "configs", "replication", "repl_base.toml")

ADAMW_NO_LR = ["--optimizer.name", "adamw", "--optimizer.beta1", "0.9", "--optimizer.beta2", "0.95", "--optimizer.eps", "1e-8"]
ADAMW = [*ADAMW_NO_LR, "--optimizer.lr", "1e-3"]
PAPER_GAIN = "1"  # the replication runs' ρ-norm gain: the paper's recipe as written (the framework default is 0.1)
PARALLAX = ["--model.attention", "parallax", "--attention.parallax.rho_norm_init", PAPER_GAIN]
RUNS: dict[str, list[str]] = {  # in run order: converted needs softmax_muon; gdn_muon takes what time is left
    "softmax_muon": ["--model.attention", "softmax"],
    "parallax_muon": PARALLAX,
    "softmax_adamw": ["--model.attention", "softmax", *ADAMW],
    "parallax_adamw": [*PARALLAX, *ADAMW],
    "parallax_muon_wd2": [*PARALLAX, "--lr_scheduler.wd_anneal_gamma", "2.0"],
    "converted": [*PARALLAX, "--optimizer.lr_warmup_patterns", "\\.wr\\.",
                  "--optimizer.lr_warmup_steps", "10"],
    "gdn_muon": ["--model.attention", "gdn"],
}
CONVERTED_FRACTION = 4  # the converted fine-tune trains steps // 4 steps
ANALYZED = ("softmax", "parallax", "converted")
SUITES = {  # suite -> steps, validation.freq and checkpoint.interval (0 = none: validation at the first and last
    # step, checkpoints at chunk stops and the end), seq_len, batch (None = --seq-len/--batch)
    "dose": dict(steps=160, val_freq=0, ckpt_every=0, seq_len=None, batch=None),
    "horizon": dict(steps=1600, val_freq=200, ckpt_every=200, seq_len=None, batch=None),
    "context": dict(steps=160, val_freq=0, ckpt_every=0, seq_len=4096, batch=16),
    "adamw": dict(steps=400, val_freq=100, ckpt_every=0, seq_len=None, batch=None),
}
RHO_NORM_LR_1X = ["--optimizer.lr_mult_patterns", "\\.r_norm\\.=1"]  # ρ-norm gain at 1× optimizer.lr


def _gain(g: float) -> list[str]:
    return ["--model.attention", "parallax", "--attention.parallax.rho_norm_init", f"{g:g}"]


def suite_arms(suite: str, gains: list[float], best_gain: float, adamw_lrs: list[float],
               adamw_warmup: int = 0) -> dict[str, list[str]]:
    """Arm name -> train.py flags of ``suite`` (see the module docstring), in run order; ``adamw_warmup``: linear
    warmup steps of the AdamW arms (named ``..._wu<N>``; 0 = none, as the Muon arms)."""
    softmax = ["--model.attention", "softmax"]
    if suite == "dose":
        return {"softmax_muon": softmax, **{f"parallax_g{g:g}_muon": _gain(g) for g in gains},
                f"parallax_g{best_gain:g}_rnormlr1_muon": [*_gain(best_gain), *RHO_NORM_LR_1X]}
    if suite in ("horizon", "adamw"):
        arms = {} if suite == "adamw" else {"softmax_muon": softmax, "parallax_g1_muon": _gain(1.0),
                                            f"parallax_g{best_gain:g}_muon": _gain(best_gain),
                                            f"parallax_g{best_gain:g}_rnormlr1_muon": [*_gain(best_gain), *RHO_NORM_LR_1X]}
        for lr in adamw_lrs:
            adamw = [*ADAMW_NO_LR, "--optimizer.lr", f"{lr:g}"]
            wu = [] if not adamw_warmup else ["--lr_scheduler.warmup_steps", str(adamw_warmup)]
            tag = f"_wu{adamw_warmup}" if adamw_warmup else ""
            arms[f"softmax_adamw_lr{lr:g}{tag}"] = [*softmax, *adamw, *wu]
            arms[f"parallax_g1_adamw_lr{lr:g}{tag}"] = [*_gain(1.0), *adamw, *wu]
        return arms
    if suite == "context":
        arms = {}
        for mask in ("causal", "block_causal"):
            m = ["--model.attn_mask_type", mask]
            arms.update({f"softmax_muon_{mask}": [*softmax, *m], f"parallax_g1_muon_{mask}": [*_gain(1.0), *m],
                         f"parallax_g{best_gain:g}_muon_{mask}": [*_gain(best_gain), *m]})
        return arms
    raise ValueError(f"--suite {suite!r}; choose from {list(SUITES)}")


def mechanism(name: str) -> str:
    return "gdn" if name.startswith("gdn") else "softmax" if name.startswith("softmax") else "parallax"


def train_tokenizer(corpus: str, out: str, vocab: int, n_docs: int) -> str:
    """Byte-level BPE with <|bos|>/<|eos|> trained on the first ``n_docs`` training documents (cached)."""
    import gzip
    import itertools

    from attnlab.data.embedded import train_bpe

    if os.path.isfile(os.path.join(out, "tokenizer.json")):
        return out
    with gzip.open(os.path.join(corpus, "train-00.jsonl.gz"), "rt", encoding="utf-8") as f:
        train_bpe((json.loads(line)["text"] for line in itertools.islice(f, n_docs)), vocab, out, show_progress=False)
    return out


def train_one(argv: list[str]) -> None:
    """``train.py`` in this process."""
    from attnlab import train

    train.main(argv)


def plan_steps(seconds: float, fixed: dict[str, float], tps: dict[str, float], tokens_per_step: int,
               names: list[str] | None = None) -> int:
    """Largest ``steps`` for which the runs ``names`` (default: all) fit in ``seconds``: each softmax/Parallax
    run trains ``steps``, the converted fine-tune (Parallax) ``steps // 4``, and gdn_muon is budgeted as one more
    Parallax-sized run (GDN itself gets what is left at the end, see :func:`fit_steps`). ``fixed[m]`` = seconds
    per run outside the training steps, ``tps[m]`` = training tokens/s, for m in {"softmax", "parallax"} (a
    missing one borrows the other's). Returns 0 when nothing fits."""
    names = list(RUNS) if names is None else names
    total_fixed, per_step = 0.0, 0.0
    for name in names:
        mech = {"gdn": "parallax"}.get(mechanism(name), mechanism(name))
        mech = mech if mech in tps else next(iter(tps))
        total_fixed += fixed[mech]
        per_step += tokens_per_step / tps[mech] / (CONVERTED_FRACTION if name == "converted" else 1)
    return max(0, math.floor((seconds - total_fixed) / per_step))


def fit_steps(seconds: float, fixed: float, tps: float, tokens_per_step: int, cap: int) -> int:
    """Steps of one run that fit in ``seconds`` (at most ``cap``)."""
    return max(0, min(cap, math.floor((seconds - fixed) * tps / tokens_per_step)))


def chunk_stop(current: int, steps: int, chunk: int, seconds: float | None, fixed: float, tps: float,
               tokens_per_step: int) -> int:
    """Step at which the next chunk of a run at ``current`` stops: at most ``chunk`` steps (0 = no limit), at most
    ``steps``, and (with ``seconds``, the time left) only what fits at ``fixed`` s per launch and ``tps`` tokens/s.
    Returns ``current`` when nothing fits."""
    cap = steps - current if chunk <= 0 else min(chunk, steps - current)
    if seconds is not None:
        cap = fit_steps(seconds, fixed, tps, tokens_per_step, cap)
    return current + cap


def resumable_step(run_dir: str) -> int:
    """Highest ``step-N`` checkpoint under ``<run_dir>/checkpoint`` (0 if none)."""
    from attnlab.checkpoint.layout import resolve

    try:
        return resolve(run_dir).step or 0
    except FileNotFoundError:
        return 0


def truncate_metrics(run_dir: str, step: int) -> None:
    """Drop ``metrics.jsonl`` records after ``step``: a chunk killed past its last checkpoint logged steps that the
    resumed run logs again."""
    from attnlab.trainer.metrics import read_records

    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(path):
        keep = [r for r in read_records(path) if r.get("step", 0) <= step]
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)


def read_metrics(run_dir: str) -> dict:
    """Last validation/training record and the median training tokens/s (log intervals after step 1)."""
    from attnlab.trainer.metrics import read_records

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    recs = read_records(path)
    val = [r for r in recs if "val_loss" in r]
    train = [r for r in recs if "loss" in r]
    tps = [r["tps"] for r in train if r["step"] > 1 and "tps" in r]
    return {"val_loss": val[-1]["val_loss"] if val else None, "val_ppl": val[-1]["val_ppl"] if val else None,
            "train_loss": train[-1]["loss"] if train else None, "step": train[-1]["step"] if train else None,
            "val_step": val[-1]["step"] if val else None,
            "tps": statistics.median(tps) if tps else None}


def finished_at(metrics: dict, steps: int) -> bool:
    """Whether the run of ``metrics`` (:func:`read_metrics`) reached ``steps``: every run validates at its last step,
    while its last logged training step can be earlier (log steps are multiples of ``metrics.log_freq``)."""
    return metrics.get("val_step") == steps and metrics.get("val_loss") is not None


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], log: str, timeout: float, append: bool = False, gpu: str | None = None) -> tuple[bool, float]:
    """Run ``cmd`` with its output in ``log``; ``gpu``: the one device it sees (``CUDA_VISIBLE_DEVICES``)."""
    t0 = time.time()
    env = _env() if gpu is None else {**_env(), "CUDA_VISIBLE_DEVICES": gpu}
    with open(log, "a" if append else "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=max(1.0, timeout)).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[replicate] killed after {timeout:.0f} s\n")
            rc = -1
    return rc == 0, time.time() - t0


def _spawn(cmd: list[str], log: str) -> subprocess.Popen:
    """A background job (analysis, conversion) writing to ``log``, on at most 4 CPU threads: with one OpenMP
    thread per core, analyses beside the training runs starve each other and slow training down."""
    env = {**_env(), "OMP_NUM_THREADS": "4"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen | None, timeout: float) -> bool:
    if proc is None:
        return False
    try:
        return proc.wait(timeout=max(1.0, timeout)) == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def _tail(path: str, n: int = 400) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--gpus", type=int, default=1,
                    help="--suite: train this many runs at once, each on its own GPU (the first N visible ones)")
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
    if args.report and not args.suite:
        ap.error("--report needs --suite")
    if not args.corpus and not args.report:
        ap.error("--corpus is required (a folder with val.jsonl.gz and train-*.jsonl.gz)")
    if args.gpus < 1 or (args.gpus > 1 and not args.suite):
        ap.error(f"--gpus {args.gpus}: 1, or with --suite any number up to the visible GPUs")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--train-one"]:
        return train_one(argv[1:])
    t0 = time.time()
    args = parse_args(argv)
    want = set(RUNS) if args.runs == "all" else set(args.runs.split(","))
    if "converted" in want:
        want.add("softmax_muon")
    names = [n for n in RUNS if n in want] if not args.suite else []
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
    print(f"[replicate] tokenizer {tok} ({log['tokenizer_s']} s); train files {[os.path.basename(f) for f in train_files]}",
          flush=True)

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

    # ---- calibration: fixed cost per run and training tokens/s per mechanism (warms the compile cache)
    fixed: dict[str, float] = {}
    tps: dict[str, float] = {}
    steps = args.steps
    if budget > 0:
        n = args.calib_steps
        mechs = list(dict.fromkeys(mechanism(nm) for nm in names))
        if compile_on:  # softmax once more with a warm compile cache: scales the other (cold) fixed costs
            mechs.append("softmax_warm")
        for mech in mechs:
            if mech == "softmax_warm" and "softmax" not in tps:
                continue
            dump = os.path.join(out, "calibration", mech)
            shutil.rmtree(dump, ignore_errors=True)
            os.makedirs(dump)
            flags = [*common, "--model.attention", mech.split("_")[0], "--job.dump_folder", dump, "--training.steps", str(n),
                     "--metrics.log_freq", "5", "--checkpoint.no-enable"]
            ok, secs = _run([sys.executable, "-m", "benchmarks.replicate", "--train-one", *flags], os.path.join(dump, "train.log"),
                            min(args.timeout, left()))
            m = read_metrics(dump)
            if ok and m.get("tps"):
                tps[mech] = m["tps"]
                fixed[mech] = secs - n * k / m["tps"] + 3.0  # + the final checkpoint save of a real run
            print(f"[replicate] calibration {mech}: ok={ok} {secs:.0f} s, tokens/s {tps.get(mech, 0):,.0f}, "
                  f"fixed {fixed.get(mech, float('nan')):.0f} s", flush=True)
        if "softmax_warm" in fixed:  # warm/cold ratio of the fixed cost, applied to every mechanism
            ratio = min(1.0, fixed.pop("softmax_warm") / fixed["softmax"])
            tps.pop("softmax_warm")
            fixed = {m: f * ratio for m, f in fixed.items()}
            log["warm_fixed_ratio"] = round(ratio, 3)
        for mech in ("softmax", "parallax"):  # a failed calibration borrows the other's numbers
            other = "parallax" if mech == "softmax" else "softmax"
            if mech not in tps and other in tps:
                tps[mech], fixed[mech] = tps[other], fixed[other]
        if "softmax" not in tps:
            raise SystemExit(f"calibration failed (see {out}/calibration/*/train.log): "
                             f"{_tail(os.path.join(out, 'calibration', 'softmax', 'train.log'))}")
        steps = min(args.max_steps, plan_steps(left() - args.margin_s, fixed, tps, k, names))
        if steps < 10:
            raise SystemExit(f"--budget-s {budget}: only {steps} steps per run fit after calibration "
                             f"(fixed {fixed}, tokens/s {tps}, {left():.0f} s left)")
        log.update(calibration={m: {"tokens_per_s": round(tps[m]), "fixed_s": round(fixed[m], 1)} for m in tps},
                   planned_steps=steps, seconds_left_after_calibration=round(left(), 1))
        print(f"[replicate] {steps} steps per run = {steps * k:,} tokens; {left():.0f} s left", flush=True)
    log_freq = str(max(1, steps // 25))

    results: list[dict] = []
    background: list[tuple[dict, str, subprocess.Popen]] = []  # (row, run dir, analyze.py process)
    convert_job: subprocess.Popen | None = None
    conv_dir = os.path.join(out, "converted_init")
    for name in names:
        dump = os.path.join(out, name)
        mech = mechanism(name)
        n_steps = steps if name != "converted" else max(1, steps // CONVERTED_FRACTION)
        if name == "gdn_muon" and budget > 0:  # what is left, at most `steps`; nothing if its calibration failed
            n_steps = fit_steps(left() - args.margin_s, fixed["gdn"], tps["gdn"], k, steps) if "gdn" in tps else 0
        row = {"run": name, "steps": n_steps, "tokens": n_steps * k}
        flags = [*common, *RUNS[name], "--job.dump_folder", dump, "--training.steps", str(n_steps),
                 "--metrics.log_freq", log_freq]
        try:
            if n_steps < 1:
                raise RuntimeError("its calibration failed (calibration/gdn/train.log)" if budget > 0 and mech not in tps
                                   else f"no time left ({left():.0f} s)")
            if name == "converted":
                if not _wait(convert_job, left()):
                    raise RuntimeError(f"conversion failed: {_tail(os.path.join(out, 'convert.log'))}")
                flags += ["--checkpoint.initial_load_path", conv_dir, "--checkpoint.initial_load_model_only"]
            done = read_metrics(dump)
            stale = name == "converted" and any(r["run"] == "softmax_muon" and not r.get("cached") for r in results)
            need_ckpt = name == "softmax_muon" and "converted" in names
            if (not args.fresh and not stale and finished_at(done, n_steps)
                    and (not need_ckpt or os.path.isdir(os.path.join(dump, "checkpoint")))):
                row.update(**done, ok=True, seconds=0.0, cached=True)  # finished earlier: reuse
                ok = True
            else:
                shutil.rmtree(dump, ignore_errors=True)  # a model-only final checkpoint cannot be resumed
                os.makedirs(dump, exist_ok=True)
                with open(os.path.join(dump, "train_args.json"), "w") as f:
                    json.dump(flags, f)
                ok, secs = _run([sys.executable, "-m", "benchmarks.replicate", "--train-one", *flags], os.path.join(dump, "train.log"),
                                min(args.timeout, left() - 10))  # keep 10 s for the table
                row.update(ok=ok, seconds=round(secs, 1), **read_metrics(dump))
                if not ok:
                    row["error"] = "see train.log: " + _tail(os.path.join(dump, "train.log"), 200).replace("\n", " | ")
        except Exception as e:  # conversion failures, no time left: report, go on
            row.update(ok=False, seconds=0.0, error=f"{type(e).__name__}: {e}")
        if row["ok"] and name == "softmax_muon" and "converted" in names:
            shutil.rmtree(conv_dir, ignore_errors=True)
            from attnlab.models.args import get_flavor

            fl = get_flavor(args.flavor)
            try:
                from attnlab.checkpoint.layout import resolve

                src = str(resolve(dump).path)
                convert_job = _spawn([sys.executable, "-m", "attnlab.tools.convert_to_parallax", src,
                                      conv_dir, "--rope-theta", str(fl.rope_theta), "--norm-eps", str(fl.norm_eps),
                                      "--rho-norm-init", PAPER_GAIN, "--no-progress"], os.path.join(out, "convert.log"))
            except FileNotFoundError as e:
                with open(os.path.join(out, "convert.log"), "w") as f:
                    f.write(str(e))
        if row["ok"] and not args.no_analyze and any(m in name for m in ANALYZED):
            background.append((row, dump, _analyze(dump, val_file, args.seq_len)))
        print(json.dumps(row), flush=True)
        results.append(row)
        write_summary(out, results, log)

    _wait(convert_job, 10)
    cleanup = [] if args.keep_checkpoints else [*(os.path.join(out, n, "checkpoint") for n in names), conv_dir]
    return finish(out, results, background, cleanup, log, left, t0)


def _analyze(dump: str, val_file: str, seq_len: int) -> subprocess.Popen:
    return _spawn([sys.executable, "-m", "attnlab.tools.analyze", dump, "--data", val_file,
                   "--rows", "8", "--queries", "16", "--seq-len", str(min(seq_len, 1024)),
                   # CPU: the per-head float64 eigh/SVD diagnostics (small matrices) are slower through
                   # cusolver next to a training run than on a few CPU cores
                   "--device", "cpu"],
                  os.path.join(dump, "analyze.log"))


ANALYSIS_KEYS = ("cor", "cpa", "probe_norm", "rho_gain", "entropy", "sink_p", "srank_wr", "srank_wq")


def _read_analysis(row: dict, dump: str) -> bool:
    path = os.path.join(dump, "analysis", "analysis.json")
    if not os.path.isfile(path):
        return False
    s = json.load(open(path))["summary"]
    row.update({key: s.get(key) for key in ANALYSIS_KEYS})
    return True


def visible_gpus(n: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each of ``n`` parallel runs: the first ``n`` devices this process sees
    (entries of its own ``CUDA_VISIBLE_DEVICES`` when that is set)."""
    seen = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (seen or [str(i) for i in range(n)])[:n]


def run_suite(args, out: str, common: list[str], val_file: str, left, log: dict):
    """Train ``args.suite``'s arms × seeds in ``out`` (module docstring), resuming unfinished runs in chunks, up to
    ``args.gpus`` runs at once (each on its own GPU, in arm order); ``left``: seconds left in this call (None = no
    budget). Returns (rows, background analyses, paths to delete at the end)."""
    spec = SUITES[args.suite]
    arms = suite_arms(args.suite, args.gains, args.best_gain, args.adamw_lrs, args.adamw_warmup)
    chosen = list(arms) if args.runs == "all" else args.runs.split(",")
    k, steps = args.batch * args.seq_len, args.steps
    val_freq = str(spec["val_freq"] or 100000)  # 100000: only steps 1 and `steps` validate
    # periodic full checkpoints: a launch killed at the end of a call loses at most ckpt_every steps
    ckpt_every = str(args.ckpt_every if args.ckpt_every is not None else spec["ckpt_every"] or 100000)
    est: dict[str, tuple[float, float]] = {}  # mechanism -> (fixed s per launch, training tokens/s), measured here
    earlier = {r["run"]: r for r in summary_rows(out)}  # earlier calls' rows (other seeds or arms) stay in the table
    jobs = [(arm, seed) for arm in chosen for seed in args.seeds]
    background, cleanup = [], []
    lock = threading.Lock()  # background, cleanup, summary.json
    free_gpus: queue.Queue = queue.Queue()
    for gpu in (visible_gpus(args.gpus) if args.gpus > 1 else [None]):
        free_gpus.put(gpu)

    def train(arm: str, seed: int, gpu: str | None) -> dict:
        """One run to its last step (or paused at the budget's end); the row of the table."""
        name, mech = f"{arm}_s{seed}", mechanism(arm)
        dump = os.path.join(out, name)
        flags = [*common, *arms[arm], "--debug.seed", str(seed), "--job.dump_folder", dump,
                 "--training.steps", str(steps), "--metrics.log_freq", str(max(1, steps // 25)),
                 "--validation.freq", val_freq, "--checkpoint.interval", ckpt_every]
        row = {"run": name, "arm": arm, "seed": seed, "steps": steps, "tokens": steps * k, "seconds": 0.0}
        args_file = os.path.join(dump, "train_args.json")
        same = not args.fresh and os.path.isfile(args_file) and json.load(open(args_file)) == flags
        done = read_metrics(dump) if same else {}
        if finished_at(done, steps):
            return {**row, **done, "ok": True, "cached": True, "seconds": earlier.get(name, {}).get("seconds", 0.0)}
        current = resumable_step(dump) if same else 0
        if current:
            truncate_metrics(dump, current)
        else:
            shutil.rmtree(dump, ignore_errors=True)
            os.makedirs(dump)
            with open(args_file, "w") as f:
                json.dump(flags, f)
        row["resumed_from"] = current
        while current < steps:
            # this mechanism's launch cost and speed, else another's at half the speed (Parallax is slower)
            fixed, tps = est.get(mech) or next(((f, t / 2) for f, t in list(est.values())), (0.0, 0.0))
            seconds = left() - args.margin_s if left is not None and tps else None
            stop = chunk_stop(current, steps, args.chunk_steps, seconds, fixed, tps, k)
            if stop <= current or (left is not None and left() <= args.margin_s):
                return {**row, "ok": False, "paused": current,
                        "error": f"paused at step {current}/{steps} (no time left); the same command resumes it"}
            chunk = ["--training.stop_after_step", str(stop)] if stop < steps else []
            timeout = min(args.timeout, left() - 10) if left is not None else args.timeout
            ok, secs = _run([sys.executable, "-m", "benchmarks.replicate", "--train-one", *flags, *chunk],
                            os.path.join(dump, "train.log"), timeout, append=True, gpu=gpu)
            row["seconds"] = round(row["seconds"] + secs, 1)
            m = read_metrics(dump)
            if not ok and left is not None and left() <= args.margin_s + 10:  # killed at the budget's end
                current = resumable_step(dump)
                return {**row, "ok": False, "paused": current, "error": f"paused at step {current}/{steps} "
                        "(stopped at the budget's end); the same command resumes it"}
            if not ok:
                return {**row, "ok": False,
                        "error": "see train.log: " + _tail(os.path.join(dump, "train.log"), 200).replace("\n", " | ")}
            if m.get("tps"):
                est[mech] = (max(0.0, secs - (stop - current) * k / m["tps"]) + 3.0, m["tps"])
            current = stop
        return {**row, "ok": True, **read_metrics(dump)}

    def job(arm: str, seed: int) -> dict:
        gpu = free_gpus.get()
        try:
            row = train(arm, seed, gpu)
        finally:
            free_gpus.put(gpu)
        dump = os.path.join(out, row["run"])
        with lock:
            if row["ok"] and not args.no_analyze:
                if row.get("cached") and _read_analysis(row, dump):
                    pass
                elif os.path.isdir(os.path.join(dump, "checkpoint")):
                    background.append((row, dump, _analyze(dump, val_file, args.seq_len)))
            if row["ok"] and not args.keep_checkpoints:
                cleanup.append(os.path.join(dump, "checkpoint"))
            print(json.dumps(row), flush=True)
            write_summary(out, [row], log, merge=True)
        return row

    log.update(seeds=args.seeds, steps=steps, gpus=args.gpus, arms={a: arms[a] for a in chosen})
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.gpus) as pool:
        rows = list(pool.map(lambda j: job(*j), jobs))  # in arm order, not finishing order
    return rows, background, cleanup


def finish(out: str, results: list[dict], background, cleanup: list[str], log: dict, left, t0: float,
           merge: bool = False) -> list[dict]:
    """Wait for the analyses, delete ``cleanup``, plot, write summary.json and table.txt, print the table.
    ``merge``: keep the rows that other calls or processes wrote to summary.json (:func:`write_summary`). Returns
    the table's rows."""
    for row, dump, proc in background:
        if not (_wait(proc, max(5.0, left() - 10)) and _read_analysis(row, dump)):
            row["analysis_error"] = _tail(os.path.join(dump, "analyze.log"), 200)
    for path in cleanup:
        shutil.rmtree(path, ignore_errors=True)
    rows = write_summary(out, results, log, merge)
    ran = [os.path.join(out, r["run"]) for r in rows if os.path.isfile(os.path.join(out, r["run"], "metrics.jsonl"))]
    if ran:
        _run([sys.executable, "-m", "attnlab.tools.plot_ppl", *ran, "-o", os.path.join(out, "ppl.png"), "--bands"],
             os.path.join(out, "plot_ppl.log"), 120)
    try:
        plot_diagnostics(out, [r["run"] for r in rows])
    except Exception as e:  # plotting must not lose the table
        log["diagnostics_plot_error"] = f"{type(e).__name__}: {e}"
    log["total_s"] = round(time.time() - t0, 1)
    rows = write_summary(out, rows, log, merge)
    table = format_table(rows, log)
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(table + "\n")
    print(table, flush=True)
    return rows


def summary_rows(out: str) -> list[dict]:
    """The rows of ``<out>/summary.json`` ([] if there is none)."""
    path = os.path.join(out, "summary.json")
    return json.load(open(path))["runs"] if os.path.isfile(path) else []


def write_summary(out: str, rows: list[dict], log: dict, merge: bool = False) -> list[dict]:
    """Write ``<out>/summary.json`` (atomically) and return its rows. ``merge``: ``rows`` replace the file's rows of
    the same run and the others stay, so suite processes that share ``out`` (one per GPU, or later calls) never
    drop each other's rows."""
    import fcntl

    path = os.path.join(out, "summary.json")
    with open(path + ".lock", "w") as lock:  # read-merge-write as one step across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if merge:  # the file's other rows first, then ``rows`` in their order
            names = {r["run"] for r in rows}
            rows = [r for r in summary_rows(out) if r["run"] not in names] + rows
        with open(path + ".tmp", "w") as f:
            json.dump({"runs": rows, **log}, f, indent=1, default=str)
        os.replace(path + ".tmp", path)
    return rows


def report_rows(out: str) -> list[dict]:
    """The table of a suite folder rebuilt from its run folders (``train_args.json``, ``metrics.jsonl``,
    ``analysis/``), without training: rows in summary.json's order, then the other runs by name. A run that
    summary.json records but whose folder is elsewhere (a seed trained on another machine) keeps its recorded row."""
    old = {r["run"]: r for r in summary_rows(out)}
    dumps = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(out, "*", "train_args.json")))
    order = {name: i for i, name in enumerate(old)}
    dumps.sort(key=lambda d: (order.get(os.path.basename(d), len(order)), os.path.basename(d)))
    rows = []
    for dump in dumps:
        name, flags = os.path.basename(dump), json.load(open(os.path.join(dump, "train_args.json")))

        def flag(key: str) -> int:  # the last occurrence wins, as in train.py
            return int(flags[len(flags) - flags[::-1].index(key)])

        steps = flag("--training.steps")
        arm, _, seed = name.rpartition("_s")
        m = read_metrics(dump)
        row = {"run": name, "arm": arm, "seed": int(seed), "steps": steps,
               "tokens": steps * flag("--training.local_batch_size") * flag("--training.seq_len"),
               "seconds": old.get(name, {}).get("seconds"), **m}
        row["ok"] = finished_at(m, steps)
        if not row["ok"]:
            row.update(paused=m.get("step") or 0, error=f"stopped near step {m.get('step') or 0}/{steps}; "
                       "the suite's command resumes it")
        _read_analysis(row, dump)
        rows.append(row)
    found = {r["run"]: r for r in rows}  # summary.json's runs whose folder is not here (another machine's) stay
    return [found.pop(name, r) for name, r in old.items()] + list(found.values())


def _recipe(arm: str) -> tuple[str, str, str]:
    """What an arm is compared within (``suite_arms`` names): its optimizer, warmup tag and mask suffix."""
    mask = next((m for m in ("_block_causal", "_causal") if arm.endswith(m)), "")
    warmup = re.search(r"_wu\d+", arm)
    return ("adamw" if "_adamw" in arm else "muon"), warmup.group() if warmup else "", mask


def arm_rows(rows: list[dict]) -> list[dict]:
    """One row per arm (runs ``<arm>_s<seed>`` that finished), in first-run order: the seeds, and the mean, min and
    max of the final validation perplexity over them. ``delta``: the arm's mean against the best (lowest-mean)
    softmax arm with the same optimizer, warmup and mask, in % (None for softmax arms and where there is none)."""
    arms: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("ok") and r.get("val_ppl") is not None:
            arms.setdefault(r.get("arm") or r["run"].rpartition("_s")[0], []).append(r)
    out = [{"arm": arm, "seeds": sorted(r["seed"] for r in rs), "mean": statistics.fmean(r["val_ppl"] for r in rs),
            "min": min(r["val_ppl"] for r in rs), "max": max(r["val_ppl"] for r in rs)} for arm, rs in arms.items()]
    for a in out:
        base = [b["mean"] for b in out if b["arm"].startswith("softmax")
                and _recipe(b["arm"]) == _recipe(a["arm"])]
        a["delta"] = (None if a["arm"].startswith("softmax") or not base
                      else 100 * (a["mean"] / min(base) - 1))
    return out


def plot_diagnostics(out: str, names: list[str]) -> str | None:
    """``diagnostics_by_layer.png``: per-layer means of COR, CPA, the probe norm ‖ρ‖, the ρ-norm gain, softmax entropy
    and sink of every analysed run."""
    keys = ("cor", "cpa", "probe_norm", "rho_gain", "entropy", "sink_p")
    series = {}
    for name in names:
        path = os.path.join(out, name, "analysis", "analysis.json")
        if os.path.isfile(path):
            series[name] = json.load(open(path))["layers"]
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6))
    for ax, key in zip(axes, keys):
        for i, (name, layers) in enumerate(series.items()):
            pts = [(lay["layer"], (lay.get("rho_norm_gain") if key == "rho_gain" else lay["activations"].get(key)))
                   for lay in layers]
            pts = [(i, v["mean"]) for i, v in pts if v]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=f"C{i}", label=name)
        ax.set_title(key)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    labelled = {}  # one legend for all panels: softmax runs have no COR/CPA, so axes[0] alone can miss them
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labelled.setdefault(label, handle)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.legend(list(labelled.values()), list(labelled), loc="center right", fontsize=7)
    path = os.path.join(out, "diagnostics_by_layer.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(rows: list[dict], log: dict | None = None) -> str:
    def fmt(v, spec):
        width = int(spec.split(".")[0])
        return f"{'-':>{width}}" if v is None else format(v, spec)

    w = max([18, *(len(r["run"]) + 1 for r in rows)])
    head = (f"{'run':<{w}}{'steps':>6}{'tokens':>12}{'val_ppl':>9}{'val_loss':>9}{'COR':>7}{'CPA':>7}{'|rho|':>7}"
            f"{'gain':>7}{'srankWr':>8}{'s/run':>7}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        status = ("ok" if r.get("ok") else r["error"] if r.get("paused") is not None
                  else "FAILED " + r.get("error", "see train.log")[:120])
        lines.append(f"{r['run']:<{w}}{r['steps']:>6}{r['tokens']:>12,}{fmt(r.get('val_ppl'), '9.2f')}"
                     f"{fmt(r.get('val_loss'), '9.4f')}{fmt(r.get('cor'), '7.3f')}{fmt(r.get('cpa'), '7.3f')}"
                     f"{fmt(r.get('probe_norm'), '7.2f')}{fmt(r.get('rho_gain'), '7.3f')}"
                     f"{fmt(r.get('srank_wr'), '8.2f')}{fmt(r.get('seconds'), '7.0f')}  {status}")
    arms = arm_rows(rows) if any("arm" in r for r in rows) else []
    if any(len(a["seeds"]) > 1 for a in arms):  # seeds side by side: the mean and its spread per arm
        w = max([18, *(len(a["arm"]) + 1 for a in arms)])
        head = f"{'arm':<{w}}{'seeds':>8}{'ppl mean':>10}{'min':>8}{'max':>8}{'vs softmax':>12}"
        lines += ["", head, "-" * len(head)]
        for a in arms:
            delta = "-" if a["delta"] is None else f"{a['delta']:+.1f}%"
            lines.append(f"{a['arm']:<{w}}{','.join(map(str, a['seeds'])):>8}{a['mean']:>10.2f}{a['min']:>8.2f}"
                         f"{a['max']:>8.2f}{delta:>12}")
    if log:
        lines.append(f"tokens/step {log.get('tokens_per_step') or 0:,}; val tokens {log.get('val_tokens')}; "
                     f"compile {log.get('compile')}; {log.get('device')}; total {log.get('total_s')} s; "
                     f"calibration {log.get('calibration', '-')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
