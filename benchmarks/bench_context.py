"""Training throughput against sequence length at a fixed number of tokens per step, on one device.

    python -m benchmarks.bench_context --data DIR --tokenizer DIR [--mechanisms softmax,parallax,gdn,...]
        [--seq-lens 4096,16384,32768,65536] [--tokens 65536] [--ac full] [--gpus 4] [--plot tps_vs_seq_len.png]
    python -m benchmarks.bench_context ... --cp 1,2,4 --seq-lens 32768,65536,131072 --tokens 131072 --gpus 4
    python -m benchmarks.bench_context --results OUT1/results.json,OUT2/results.json --plot all.png   # no runs

Every (mechanism, T) row launches ``--repo``'s ``train.py`` with the mechanism's 0.6B paper config
(``attnlab/configs/paper/qwen3_0.6b_<mechanism>.toml``, or ``configs/paper/`` in a checkout from before the move; with
``--config FILE``, FILE and ``--model.attention <mechanism>`` for every row), ``training.seq_len`` T and local batch
``--tokens`` / T, so every T trains on the same tokens per step. The mask is plain causal, every row one sequence of
T tokens: under the document mask a corpus of short documents would make a long T measure short documents. No float8
(the configs' bf16), ``--steps`` steps. The numbers are read from the run's metrics.jsonl as ``benchmarks.bench_train``
reads them (the helpers of ``benchmarks.common``): tok/s is the median over the steps after ``--warmup``; MFU counts
the attention FLOPs a causal mask leaves (T(T+1)/2 query-key pairs per sequence for softmax;
``attnlab.models.args.ModelArgs.training_flops``); GiB is the peak reserved memory; busy % is the traced steps'
GPU-busy time over the median step (``--profile``, ``benchmarks.common.trace_summary``, printed per row). ``--ac``
sets activation checkpointing on every row: ``config`` keeps each config's (selective per op in the paper configs),
``full`` recomputes every block in the backward, which the longest T may need to fit.

With ``--cp N1,N2,...`` every (mechanism, T) runs once per context-parallel degree N, on N GPUs with each sequence
split over them (``parallelism.context_parallel_degree`` N, docs/context_parallel.md; compile off on every row of
the sweep, since context parallelism refuses it): the same tokens per step, tok/s and MFU per GPU, and the table's
``/cp1`` column is the row's tok/s per GPU over the same mechanism's at N = 1 and the same T. ``--gpus K`` runs the
rows side by side, K // N at a time, each on its own N of the K GPUs (at one GPU each, one-GPU rows of eight
mechanisms take an eighth of the wall time on eight GPUs; the numbers are each GPU's own).

Prints a line per row as it finishes, then the table (with tok/s over softmax's at the same T and degree when softmax
is among the mechanisms), and writes ``<out>/results.json`` and the plot of tok/s against T, one line per mechanism
and degree (``--plot``, default ``<out>/tps_vs_seq_len.png``). ``--results`` reads the rows of earlier runs'
results.json files (later files win) and prints and plots them without running anything: sweeps split over several
calls make one table.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
import threading
from pathlib import Path

from benchmarks.common import (ADAMW, PAPER_CONFIG_DIRS, REPO, busy, check_trace_steps, first_profiled, paper_config,
                               profiled, profiling, run, side_by_side, summarize, train_flags)

MECHANISMS = "softmax,parallax,parallax_p64,gdn,kda,hla,lla,cala"
AC_MODES = ("config", "none", "selective", "full")


def config_for(args, mechanism: str) -> tuple[Path, list[str]]:
    """(config file, extra train.py flags) of ``mechanism``'s rows."""
    if args.config:
        return Path(args.config), ["--model.attention", mechanism]
    return paper_config(Path(args.repo), f"qwen3_0.6b_{mechanism}"), []


def command(args, mechanism: str, seq_len: int, dump: Path, cp: int = 1) -> list[str]:
    """train.py's command line for one row: ``--tokens`` / seq_len sequences of seq_len tokens per step, each split
    over ``cp`` GPUs."""
    config, extra = config_for(args, mechanism)
    row = argparse.Namespace(**{**vars(args), "batch": args.tokens // seq_len, "seq": seq_len})
    launch = [sys.executable] if cp == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cp}", "--master_port=0",
        "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]
    cmd = [*launch, str(Path(args.repo) / "train.py"), "--job.config_file", str(config),
           *train_flags(row, dump), *extra, "--model.attn_mask_type", "causal", "--model.converters", ""]
    if cp > 1:
        cmd += ["--parallelism.context_parallel_degree", str(cp)]
    if max(args.cp) > 1:  # every degree alike: the /cp1 column compares the same program
        cmd += ["--compile.no-enable"]
    if args.ac != "config":
        cmd += ["--activation_checkpoint.mode", args.ac]
    if args.optimizer == "adamw":
        cmd += ADAMW
    return cmd + shlex.split(args.train_args) + profiling(args)


def measure(args, mechanism: str, seq_len: int, cp: int, out: Path, devices: str = "") -> dict:
    """Run one row (on the GPUs ``devices`` when given); its tok/s, MFU, memory, loss (and busy/wall ms when
    traced), or {"failed": why} ("timeout", "out of memory" or "error", read from the row's log)."""
    from attnlab.trainer.metrics import read_records

    dump = out / (f"{mechanism}_T{seq_len}" + (f"_cp{cp}" if cp > 1 else ""))
    log = run(command(args, mechanism, seq_len, dump, cp), out / f"{dump.name}.log", Path(args.repo), devices,
              args.row_timeout or None)
    path = dump / "metrics.jsonl"
    records = read_records(path) if path.exists() else []
    if args.profile:  # the profiler's warm-up and traced steps run slower
        records = [r for r in records if r["step"] < first_profiled(args)]
    r = summarize(records, args.warmup)
    if not r:
        return {"failed": "timeout" if "\nkilled after " in log else "out of memory" if "OutOfMemoryError" in log
                else "error"}
    return r | profiled(args, dump)


def _ok(r: dict | None) -> bool:
    """Whether a row ran (it has a tok/s)."""
    return bool(r) and "tps" in r


def _mfu(r: dict) -> str:
    return f"{r['mfu']:6.1f}" if math.isfinite(r["mfu"]) else f"{'n/a':>6s}"


def _label(mech: str, cp: int) -> str:
    return mech if cp == 1 else f"{mech} cp{cp}"


def table(results: dict, tokens: int) -> str:
    """One line per (mechanism, T, CP degree) of ``results``: batch, tok/s, tok/s over softmax's at that T and
    degree, over the mechanism's own at one GPU (per GPU), MFU, GiB, step ms, busy % (per GPU under context
    parallelism: each GPU runs tokens / cp of every step)."""
    lines = [f"{'mechanism':14s} {'T':>7s} {'cp':>3s} {'batch':>5s} {'tok/s/GPU':>10s} {'/softmax':>8s} {'/cp1':>6s} "
             f"{'MFU%':>6s} {'GiB':>6s} {'step ms':>9s} {'busy %':>6s}"]
    for (mech, T, cp), r in results.items():
        base, one = results.get(("softmax", T, cp)), results.get((mech, T, 1))
        head = f"{mech:14s} {T:7d} {cp:3d} {tokens // T:5d}"
        if not _ok(r):
            lines.append(f"{head} {'failed':>10s} ({r.get('failed', 'error')})")
            continue
        ratio = f"{r['tps'] / base['tps']:8.3f}" if _ok(base) else f"{'n/a':>8s}"
        scaled = f"{r['tps'] / one['tps']:6.3f}" if _ok(one) else f"{'n/a':>6s}"
        lines.append(f"{head} {r['tps']:10,.0f} {ratio} {scaled} {_mfu(r)} {r['mem']:6.1f} "
                     f"{1e3 * tokens / cp / r['tps']:9.1f} {busy(r, tokens // cp):>6s}")
    return "\n".join(lines)


def plot(results: dict, tokens: int, path: Path) -> None:
    """tok/s (per GPU) against T (log2 axis), one line per mechanism and CP degree; failed rows are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    lines: dict[tuple[str, int], list] = {}
    for (mech, T, cp), r in results.items():
        if _ok(r):
            lines.setdefault((mech, cp), []).append((T, r["tps"]))
    for (mech, cp), points in lines.items():
        ax.plot(*zip(*sorted(points)), marker="o", label=_label(mech, cp))
    seq_lens = sorted({T for _, T, _ in results})
    ax.set_xscale("log", base=2)
    ax.set_xticks(seq_lens, [f"{T // 1024}k" if T % 1024 == 0 else str(T) for T in seq_lens])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("training tokens/s per GPU")
    ax.set_title(f"{tokens:,} tokens per step, causal mask")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: the lines fill the plot
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(results: dict, tokens: int, path: Path) -> None:
    """results.json: {"tokens": tokens per step, "rows": {"<mechanism>/<T>/<cp>": row}}."""
    rows = {f"{m}/{T}/{cp}": r for (m, T, cp), r in results.items()}
    path.write_text(json.dumps({"tokens": tokens, "rows": rows}, indent=1))


def load(paths: list[str]) -> tuple[dict, int]:
    """(rows, tokens per step) of results.json files written by :func:`save`; a row of a later file replaces the
    same row of an earlier one. Files of different tokens per step are refused: their rows do not compare."""
    results: dict[tuple[str, int, int], dict] = {}
    tokens = set()
    for p in paths:
        try:
            saved = json.loads(Path(p).read_text())
            tokens.add(saved["tokens"])
            for key, r in saved["rows"].items():
                mech, T, cp = key.rsplit("/", 2)
                results[(mech, int(T), int(cp))] = r
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--results {p}: not a bench_context results.json ({type(e).__name__}: {e})")
    if len(tokens) != 1:
        raise SystemExit(f"--results: the files ran at different tokens per step {sorted(tokens)}")
    return results, tokens.pop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="training data (train.py's training.dataset_path)")
    ap.add_argument("--tokenizer", help="tokenizer folder (model.hf_assets_path)")
    ap.add_argument("--mechanisms", default=MECHANISMS,
                    help="comma list: paper configs qwen3_0.6b_<name> (with --config: registered attention names)")
    ap.add_argument("--seq-lens", default="4096,16384,32768,65536", help="comma list of sequence lengths T")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per step at every T (local batch = tokens / T)")
    ap.add_argument("--config", default="", help="one training TOML for every row, with --model.attention <name>")
    ap.add_argument("--ac", choices=AC_MODES, default="config",
                    help="activation checkpointing on every row (config: each config's own)")
    ap.add_argument("--cp", default="1", help="comma list of context-parallel degrees: each row once per degree N, "
                    "on N GPUs")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs to run rows side by side on (K // N rows at once)")
    ap.add_argument("--row-timeout", type=float, default=0,
                    help="seconds after which a row is killed and reported failed (0: no limit)")
    ap.add_argument("--results", default="", help="comma list of results.json files to print and plot (no runs)")
    ap.add_argument("--steps", type=int, default=20, help="training steps per row")
    ap.add_argument("--warmup", type=int, default=8, help="steps left out of the median")
    ap.add_argument("--optimizer", choices=("config", "adamw"), default="config",
                    help="config: each config's optimizer (Muon); adamw: AdamW on every row")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="trace steps of every row: the busy %% column and a kernel/idle summary per row")
    ap.add_argument("--trace-steps", type=int, default=1, help="steps the profiler traces (with --profile)")
    ap.add_argument("--train-args", default="", help="more train.py arguments for every row")
    ap.add_argument("--out", default="", help="folder for the logs, runs, results.json and plot (default: a temp one)")
    ap.add_argument("--plot", default="", help="plot file (default: <out>/tps_vs_seq_len.png)")
    ap.add_argument("--repo", default=str(REPO), help="checkout whose train.py and configs run (default: this one)")
    args = ap.parse_args(argv)
    args.repo = str(Path(args.repo).resolve())
    if args.results:
        args.results = args.results.split(",")
        return args
    if not (args.data and args.tokenizer):
        ap.error("--data and --tokenizer are required (unless --results)")
    for flag in ("seq_lens", "cp"):
        try:
            setattr(args, flag, [int(t) for t in getattr(args, flag).split(",")])
        except ValueError:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)!r}: not a comma list of integers")
    if min(args.cp) < 1 or args.gpus < 1:
        ap.error(f"--cp {args.cp} / --gpus {args.gpus}: degrees and GPUs must be >= 1")
    if args.gpus > 1 and max(args.cp) > args.gpus:
        ap.error(f"--cp {max(args.cp)} needs that many GPUs; --gpus is {args.gpus}")
    for T in args.seq_lens:
        if T < 1 or args.tokens % T:
            ap.error(f"--tokens {args.tokens} is not a positive multiple of T = {T} (--seq-lens)")
        for cp in args.cp:
            if T % (2 * cp):
                ap.error(f"--cp {cp}: T = {T} (--seq-lens) must be a multiple of 2 x the degree")
    args.mechanisms = args.mechanisms.split(",")
    if args.config:
        if not Path(args.config).is_file():
            ap.error(f"--config {args.config}: no such file")
        from attnlab import attention  # noqa: F401  (registers every mechanism)
        from attnlab.attention.registry import REGISTRY

        unknown = [m for m in args.mechanisms if m not in REGISTRY]
        if unknown:
            ap.error(f"--mechanisms: {unknown} are not registered attention names (with --config); "
                     f"choose from {sorted(REGISTRY)}")
    else:
        unknown = [m for m in args.mechanisms if not config_for(args, m)[0].is_file()]
        if unknown:
            have = sorted({p.stem.removeprefix("qwen3_0.6b_") for folder in PAPER_CONFIG_DIRS
                           for p in (Path(args.repo) / folder).glob("qwen3_0.6b_*.toml")})
            ap.error(f"--mechanisms: no paper config qwen3_0.6b_<name>.toml for {unknown}; choose from {have}")
    check_trace_steps(ap, args)
    if not args.profile and args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}; raise --steps")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.results:
        results, tokens = load(args.results)
        plot_path = Path(args.plot or "tps_vs_seq_len.png")
        plot(results, tokens, plot_path)
        print(f"{tokens:,} tokens per step, rows of {', '.join(args.results)}; plot {plot_path}")
        print(table(results, tokens))
        return results
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_context_"))
    out.mkdir(parents=True, exist_ok=True)
    rows = [(m, T, cp) for cp in args.cp for m in args.mechanisms for T in args.seq_lens]

    done: dict[tuple[str, int, int], dict] = {}
    ordered = lambda: {row: done[row] for row in rows if row in done}  # noqa: E731  (the sweep's order)
    lock = threading.Lock()

    def one(row: tuple[str, int, int], devices: str = "") -> dict:
        mech, T, cp = row
        r = measure(args, mech, T, cp, out, devices)
        with lock:  # results.json after every row: a sweep cut short keeps the rows it finished
            done[row] = r
            save(ordered(), args.tokens, out / "results.json")
        line = (f"tps {r['tps']:10,.0f}  mfu {_mfu(r)}%  mem {r['mem']:6.1f}GiB  busy % {busy(r, args.tokens // cp)}"
                if _ok(r) else f"failed ({r['failed']})")
        print(f"{_label(mech, cp):14s} T={T:<7d} B={args.tokens // T:<4d} {line}"
              + (f" [GPU {devices}]" if devices else ""), flush=True)
        return r

    for cp in args.cp:  # the degrees one after another; inside one, rows side by side on --gpus
        todo = [row for row in rows if row[2] == cp]
        if args.gpus >= 2 * cp:
            side_by_side(one, todo, args.gpus, per_job=cp)
        else:
            for row in todo:
                one(row)
    results = ordered()
    plot_path = Path(args.plot) if args.plot else out / "tps_vs_seq_len.png"
    plot(results, args.tokens, plot_path)
    ac = "each config's" if args.ac == "config" else args.ac
    print(f"\n{args.tokens:,} tokens per step (per GPU figures), causal mask, no float8, {args.steps} steps (median "
          f"after {args.warmup}), activation checkpointing: {ac}; logs in {out}, plot {plot_path}")
    print(table(results, args.tokens))
    return results


if __name__ == "__main__":
    main()
