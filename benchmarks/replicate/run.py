"""Running the replication: the tokenizer, train.py launches (``-m benchmarks.replicate --train-one``, one GPU each
where several run at once) with their timeouts, the calibration and the runs of the replication, a suite's runs
resumed in chunks, and the background jobs (conversion, ``attnlab.tools.analyze``) and the end (plots, summary,
table)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from attnlab.tools.launch import train_command
from benchmarks.common import REPO
from benchmarks.replicate.evaluate import EVAL_FILE
from benchmarks.replicate.evaluate import columns as eval_columns
from benchmarks.replicate.metrics import (finished_at, read_analysis, read_metrics, resumable_step, summary_rows,
                                          truncate_metrics, write_summary)
from benchmarks.replicate.plan import (ANALYZED, CONVERTED_FRACTION, EVALUATED, PAPER_GAIN, RUNS, SUITES, chunk_stop,
                                       excluded, fit_steps, mechanism, plan_steps, suite_arms, training_flags)
from benchmarks.replicate.report import format_table, plot_diagnostics


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


def _env() -> dict:
    """The children's environment: this checkout first on PYTHONPATH (``-m benchmarks.replicate``, ``-m attnlab...``),
    unbuffered output so that a killed run's log ends where it stopped."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], log: str, timeout: float, append: bool = False, gpu: str | None = None,
         cpus: list[int] | None = None) -> tuple[bool, float]:
    """Run ``cmd`` with its output in ``log``; ``gpu``: the devices it sees (``CUDA_VISIBLE_DEVICES``: one, or a
    comma list for a data-parallel run);
    ``cpus``: the cores it may run on (its compile workers too)."""
    t0 = time.time()
    env = _env() if gpu is None else {**_env(), "CUDA_VISIBLE_DEVICES": gpu}
    if cpus:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(len(cpus))
    with open(log, "a" if append else "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=max(1.0, timeout),
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None).returncode
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
    """Whether the background job ``proc`` (None: none started) exits 0 within ``timeout`` s; killed past it."""
    if proc is None:
        return False
    try:
        return proc.wait(timeout=max(1.0, timeout)) == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def _tail(path: str, n: int = 400) -> str:
    """The last ``n`` characters of the log ``path`` (empty if unreadable), for a failed run's row."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _analyze(dump: str, val_file: str, seq_len: int) -> subprocess.Popen:
    """``attnlab.tools.analyze`` of the finished run ``dump`` on ``val_file``, in the background
    (``<dump>/analyze.log``)."""
    return _spawn([sys.executable, "-m", "attnlab.tools.analyze", dump, "--data", val_file,
                   "--rows", "8", "--queries", "16", "--seq-len", str(min(seq_len, 1024)),
                   # CPU: the per-head float64 eigh/SVD diagnostics (small matrices) are slower through
                   # cusolver next to a training run than on a few CPU cores
                   "--device", "cpu"],
                  os.path.join(dump, "analyze.log"))


def cpu_share(i: int, n: int) -> list[int]:
    """The ``i``-th of ``n`` equal, contiguous shares of the cores this process may use: runs side by side on one
    host each compile, autotune and load data on their own cores, so one run's compilation does not slow another's
    steps (four unpinned runs on a 64-core host trained at 150-280k tokens/s instead of ~500k)."""
    cores = sorted(os.sched_getaffinity(0))
    k = max(1, len(cores) // n)
    return cores[i * k:(i + 1) * k] or cores


def visible_gpus(n: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each of ``n`` parallel runs: the first ``n`` devices this process sees
    (entries of its own ``CUDA_VISIBLE_DEVICES`` when that is set)."""
    seen = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (seen or [str(i) for i in range(n)])[:n]


class GpuSlots:
    """The GPUs a suite may use, each with its share of the cores: a run takes the n it needs at once (so two
    data-parallel runs waiting for GPUs never hold one each) and gives them back when it ends."""

    def __init__(self, free: list[tuple[str | None, list[int] | None]]):
        self.free, self.cond = list(free), threading.Condition()

    def take(self, n: int) -> list[tuple[str | None, list[int] | None]]:
        with self.cond:
            self.cond.wait_for(lambda: len(self.free) >= n)
            taken, self.free = self.free[:n], self.free[n:]
            return taken

    def give(self, taken: list[tuple[str | None, list[int] | None]]) -> None:
        with self.cond:
            self.free += taken
            self.cond.notify_all()


def run_replication(args, out: str, common: list[str], val_file: str, left, log: dict):
    """Train the replication runs of ``args.runs`` (module docstring of :mod:`benchmarks.replicate`) in ``out`` one
    after another; with ``--budget-s``, calibrate first and size the steps to fit ``left()`` seconds. Returns (rows,
    background analyses, paths to delete at the end)."""
    want = set(RUNS) if args.runs == "all" else set(args.runs.split(","))
    if "converted" in want:
        want.add("softmax_muon")
    names = [n for n in RUNS if n in want]
    budget, k = args.budget_s, args.batch * args.seq_len
    compile_on = log["compile"]  # main's choice for every run

    # ---- calibration: fixed cost per run and training tokens/s per mechanism (warms the compile cache)
    fixed: dict[str, float] = {}
    tps: dict[str, float] = {}
    steps = args.steps
    if budget > 0:
        n = args.calib_steps
        mechs = list(dict.fromkeys(mechanism(RUNS[nm]) for nm in names))
        if compile_on:  # softmax once more with a warm compile cache: scales the other (cold) fixed costs
            mechs.append("softmax_warm")
        for mech in mechs:
            if mech == "softmax_warm" and "softmax" not in tps:
                continue
            dump = os.path.join(out, "calibration", mech)
            shutil.rmtree(dump, ignore_errors=True)
            os.makedirs(dump)
            flags = [*common, "--model.attention", mech.split("_")[0], "--job.dump_folder", dump,
                     "--training.steps", str(n), "--metrics.log_freq", "5", "--checkpoint.no-enable"]
            ok, secs = _run([sys.executable, "-m", "benchmarks.replicate", "--train-one", *flags],
                            os.path.join(dump, "train.log"), min(args.timeout, left()))
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
        mech = mechanism(RUNS[name])
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
                ok, secs = _run([sys.executable, "-m", "benchmarks.replicate", "--train-one", *flags],
                                os.path.join(dump, "train.log"), min(args.timeout, left() - 10))  # 10 s for the table
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
    return results, background, cleanup


def run_suite(args, out: str, common: list[str], val_file: str, left, log: dict):
    """Train ``args.suite``'s arms × seeds in ``out`` (module docstring), resuming unfinished runs in chunks, up to
    ``args.gpus`` GPUs busy at once: a run on one GPU, or an arm of ``args.arm_gpus`` data-parallel over its N GPUs
    (the same global batch, N × less local batch; each rank packs its interleaved share of the documents, so the
    rows differ from a one-GPU run's), in arm order with those first; ``left``: seconds left in this
    call (None = no budget). Returns (rows, background analyses, paths to delete at the end)."""
    spec = SUITES[args.suite]
    arms = suite_arms(args.suite, args.gains, args.best_gain, args.adamw_lrs, args.adamw_warmup)
    chosen = list(arms) if args.runs == "all" else args.runs.split(",")
    k, steps = args.batch * args.seq_len, args.steps
    val_freq = str(spec["val_freq"] or 100000)  # 100000: only steps 1 and `steps` validate
    # periodic full checkpoints: a launch killed at the end of a call loses at most ckpt_every steps
    ckpt_every = str(args.ckpt_every if args.ckpt_every is not None else spec["ckpt_every"] or 100000)
    # (mechanism, GPUs) -> (fixed s per launch, training tokens/s over its GPUs), measured here
    est: dict[tuple[str, int], tuple[float, float]] = {}
    earlier = {r["run"]: r for r in summary_rows(out)}  # earlier calls' rows (other seeds or arms) stay in the table
    # seed-major: a mechanism's second seed starts once its first has filled the shared compile cache; the wide
    # (slowest) arms first, so that they start at the beginning of a call
    jobs = [(arm, seed) for seed in args.seeds for arm in sorted(chosen, key=lambda a: -args.arm_gpus.get(a, 1))]
    evaluated = args.suite in EVALUATED
    background, cleanup = [], []
    lock = threading.Lock()  # background, cleanup, summary.json
    slots = GpuSlots([(gpu, cpu_share(i, args.gpus) if gpu is not None else None)
                      for i, gpu in enumerate(visible_gpus(args.gpus) if args.gpus > 1 else [None])])

    def train(arm: str, seed: int, gpu: str | None, cpus: list[int] | None) -> dict:
        """One run to its last step (or paused at the budget's end) on ``gpu`` (one device, or a comma list of
        ``args.arm_gpus[arm]`` for a data-parallel run); the row of the table."""
        name, mech, n = f"{arm}_s{seed}", mechanism(arms[arm]), args.arm_gpus.get(arm, 1)
        dump = os.path.join(out, name)
        flags = [*common, *arms[arm], "--debug.seed", str(seed), "--job.dump_folder", dump,
                 "--training.steps", str(steps), "--metrics.log_freq", str(max(1, steps // 25)),
                 "--validation.freq", val_freq, "--checkpoint.interval", ckpt_every]
        if n > 1:  # the last occurrence wins: the same global batch over n data-parallel ranks
            flags += ["--training.local_batch_size", str(args.batch // n),
                      "--validation.local_batch_size", str(args.batch // n)]
        row = {"run": name, "arm": arm, "seed": seed, "steps": steps, "tokens": steps * k, "seconds": 0.0, "gpus": n}
        args_file = os.path.join(dump, "train_args.json")
        same = (not args.fresh and os.path.isfile(args_file)
                and training_flags(json.load(open(args_file))) == training_flags(flags))
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
            fixed, tps = est.get((mech, n)) or next(((f, t / 2) for f, t in list(est.values())), (0.0, 0.0))
            seconds = left() - args.margin_s if left is not None and tps else None
            stop = chunk_stop(current, steps, args.chunk_steps, seconds, fixed, tps, k)
            if stop <= current or (left is not None and left() <= args.margin_s):
                return {**row, "ok": False, "paused": current,
                        "error": f"paused at step {current}/{steps} (no time left); the same command resumes it"}
            chunk = ["--training.stop_after_step", str(stop)] if stop < steps else []
            timeout = min(args.timeout, left() - 10) if left is not None else args.timeout
            ok, secs = _run([sys.executable, "-m", "benchmarks.replicate", "--train-one", *flags, *chunk] if n == 1
                            else train_command([*flags, *chunk], n),
                            os.path.join(dump, "train.log"), timeout, append=True, gpu=gpu, cpus=cpus)
            row["seconds"] = round(row["seconds"] + secs, 1)
            m = read_metrics(dump)
            if not ok and left is not None and left() <= args.margin_s + 10:  # killed at the budget's end
                current = resumable_step(dump)
                return {**row, "ok": False, "paused": current, "error": f"paused at step {current}/{steps} "
                        "(stopped at the budget's end); the same command resumes it"}
            if not ok:
                return {**row, "ok": False,
                        "error": "see train.log: " + _tail(os.path.join(dump, "train.log"), 200).replace("\n", " | ")}
            if m.get("tps"):  # train.py's tokens/s is per GPU
                est[(mech, n)] = (max(0.0, secs - (stop - current) * k / (n * m["tps"])) + 3.0, n * m["tps"])
            current = stop
        return {**row, "ok": True, **read_metrics(dump)}

    def evaluate(row: dict, arm: str, seed: int, gpu: str | None, cpus: list[int] | None) -> None:
        """The run's :mod:`~benchmarks.replicate.evaluate` columns on its GPU (once: ``eval.json`` stays with the
        run); the MQAR cell rides on the first seed of the mechanism's own arm (registered defaults)."""
        dump = os.path.join(out, row["run"])
        if not os.path.isdir(os.path.join(dump, "checkpoint")) and not os.path.isfile(os.path.join(dump, EVAL_FILE)):
            row["eval_error"] = "no checkpoint left to evaluate (--fresh retrains the run)"
        elif not os.path.isfile(os.path.join(dump, EVAL_FILE)):
            mech = mechanism(arms[arm])
            cmd = [sys.executable, "-m", "benchmarks.replicate", "--evaluate", dump, "--val", val_file,
                   *(["--ood", args.ood] if args.ood else []),
                   *(["--synthetic", mech, "--seed", str(seed)] if arm == mech and seed == args.seeds[0] else [])]
            timeout = min(args.timeout, left() - 10) if left is not None else args.timeout
            ok, secs = _run(cmd, os.path.join(dump, "eval.log"), timeout, gpu=gpu and gpu.split(",")[0], cpus=cpus)
            row["eval_seconds"] = round(secs, 1)
            if not ok:
                row["eval_error"] = _tail(os.path.join(dump, "eval.log"), 200).replace("\n", " | ")
        row.update(eval_columns(dump))

    def job(arm: str, seed: int) -> dict:
        taken = slots.take(args.arm_gpus.get(arm, 1))
        gpu = None if taken[0][0] is None else ",".join(g for g, _ in taken)
        cpus = None if taken[0][1] is None else [c for _, cs in taken for c in cs]
        try:
            row = train(arm, seed, gpu, cpus)
            if row["ok"] and evaluated:
                evaluate(row, arm, seed, gpu, cpus)
        finally:
            slots.give(taken)
        dump = os.path.join(out, row["run"])
        with lock:
            if row["ok"] and not args.no_analyze and mechanism(arms[arm]) in ANALYZED:
                if row.get("cached") and read_analysis(row, dump):
                    pass
                elif os.path.isdir(os.path.join(dump, "checkpoint")):
                    background.append((row, dump, _analyze(dump, val_file, args.seq_len)))
            # an evaluated suite keeps the checkpoint until eval.json exists: the next call evaluates it again
            if row["ok"] and not args.keep_checkpoints and not (evaluated and "eval_error" in row):
                cleanup.append(os.path.join(dump, "checkpoint"))
            print(json.dumps(row), flush=True)
            write_summary(out, [row], log, merge=True)
        return row

    log.update(seeds=args.seeds, steps=steps, gpus=args.gpus, arm_gpus=args.arm_gpus, arms={a: arms[a] for a in chosen},
               excluded=excluded(args.suite), ood=args.ood)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.gpus) as pool:
        rows = list(pool.map(lambda j: job(*j), jobs))
    order = [f"{arm}_s{seed}" for seed in args.seeds for arm in chosen]
    return sorted(rows, key=lambda r: order.index(r["run"])), background, cleanup  # arm order, not finishing order


def finish(out: str, results: list[dict], background, cleanup: list[str], log: dict, left, t0: float,
           merge: bool = False) -> list[dict]:
    """Wait for the analyses, delete ``cleanup``, plot, write summary.json and table.txt, print the table.
    ``merge``: keep the rows that other calls or processes wrote to summary.json (:func:`write_summary`). Returns
    the table's rows."""
    for row, dump, proc in background:
        if not (_wait(proc, max(5.0, left() - 10)) and read_analysis(row, dump)):
            row["analysis_error"] = _tail(os.path.join(dump, "analyze.log"), 200)
    for path in cleanup:
        shutil.rmtree(path, ignore_errors=True)
    rows = write_summary(out, results, log, merge)
    ran = [os.path.join(out, r["run"]) for r in rows if os.path.isfile(os.path.join(out, r["run"], "metrics.jsonl"))]
    if ran:  # a registry suite's arms: their validation curves (the training batches are the same for every arm)
        val_only = ["--val-only", "--skip", "1"] if log.get("suite") in EVALUATED else []
        _run([sys.executable, "-m", "attnlab.tools.plot_ppl", *ran, "-o", os.path.join(out, "ppl.png"), "--bands",
              *val_only], os.path.join(out, "plot_ppl.log"), 120)
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
