"""Training throughput against sequence length at a fixed number of tokens per step, on one device.

    python -m scripts.bench_context --data DIR --tokenizer DIR [--mechanisms softmax,parallax,gdn,...]
        [--seq-lens 4096,16384,32768,65536] [--tokens 65536] [--ac full] [--plot tps_vs_seq_len.png]
    python -m scripts.bench_context ... --cp 4 --seq-lens 32768,65536,131072 --tokens 131072   # 4 GPUs, CP = 4

Every (mechanism, T) row launches ``train.py`` with the mechanism's 0.6B paper config
(``configs/paper/qwen3_0.6b_<mechanism>.toml``; with ``--config FILE``, FILE and ``--model.attention <mechanism>``
for every row), ``training.seq_len`` T and local batch ``--tokens`` / T, so every T trains on the same tokens per
step. The mask is plain causal, every row one sequence of T tokens: under the document mask a corpus of short
documents would make a long T measure short documents. No float8 (the configs' bf16), ``--steps`` steps. The numbers
are read from the run's metrics.jsonl as ``scripts.bench_train`` reads them: tok/s is the median over the steps after
``--warmup``; MFU counts the attention FLOPs a causal mask leaves (T(T+1)/2 query-key pairs per sequence for
softmax; ``models.args.ModelArgs.training_flops``); GiB is the peak reserved memory; busy % is the traced steps'
GPU-busy time over the median step (``--profile``, bench_train's trace summary, printed per row). ``--ac`` sets
activation checkpointing on every row: ``config`` keeps each config's (selective per op in the paper configs),
``full`` recomputes every block in the backward, which the longest T may need to fit.

With ``--cp N`` every row runs on N GPUs with each sequence split over them (``parallelism.context_parallel_degree``
N, docs/context_parallel.md; compile off, which context parallelism refuses): the same tokens per step, tok/s and
MFU per GPU.

Prints a line per row as it finishes, then the table (with tok/s over softmax's at the same T when softmax is among
the mechanisms), and writes ``<out>/results.json`` and the plot of tok/s against T per mechanism (``--plot``,
default ``<out>/tps_vs_seq_len.png``).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path

from scripts.bench_train import (ADAMW, REPO, busy, check_trace_steps, common, first_profiled, paper_config,
                                 profiled, profiling, run, summarize)

MECHANISMS = "softmax,parallax,parallax_p64,gdn,kda,hla,lla,cala"
AC_MODES = ("config", "none", "selective", "full")


def config_for(args, mechanism: str) -> tuple[Path, list[str]]:
    """(config file, extra train.py flags) of ``mechanism``'s rows."""
    if args.config:
        return Path(args.config), ["--model.attention", mechanism]
    return paper_config(Path(args.repo), f"qwen3_0.6b_{mechanism}"), []


def command(args, mechanism: str, seq_len: int, dump: Path) -> list[str]:
    """train.py's command line for one row: ``--tokens`` / seq_len sequences of seq_len tokens per step."""
    config, extra = config_for(args, mechanism)
    row = argparse.Namespace(**{**vars(args), "batch": args.tokens // seq_len, "seq": seq_len})
    launch = [sys.executable] if args.cp == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.cp}", "--master_port=0",
        "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]
    cmd = [*launch, str(Path(args.repo) / "train.py"), "--job.config_file", str(config),
           *common(row, dump, fp8=False), *extra, "--model.attn_mask_type", "causal", "--model.converters", ""]
    if args.cp > 1:
        cmd += ["--parallelism.context_parallel_degree", str(args.cp), "--compile.no-enable"]
    if args.ac != "config":
        cmd += ["--activation_checkpoint.mode", args.ac]
    if args.optimizer == "adamw":
        cmd += ADAMW
    return cmd + shlex.split(args.train_args) + profiling(args)


def measure(args, mechanism: str, seq_len: int, out: Path) -> dict:
    """Run one row; its tok/s, MFU, memory, loss (and busy/wall ms when traced), or {} when it failed."""
    from trainer.metrics import read_records

    dump = out / f"{mechanism}_T{seq_len}"
    run(command(args, mechanism, seq_len, dump), out / f"{dump.name}.log", Path(args.repo))
    path = dump / "metrics.jsonl"
    records = read_records(path) if path.exists() else []
    if args.profile:  # the profiler's warm-up and traced steps run slower
        records = [r for r in records if r["step"] < first_profiled(args)]
    return summarize(records, args.warmup) | profiled(args, dump)


def _mfu(r: dict) -> str:
    return f"{r['mfu']:6.1f}" if math.isfinite(r["mfu"]) else f"{'n/a':>6s}"


def table(args, results: dict, mechanisms: list[str], seq_lens: list[int]) -> str:
    """One line per (mechanism, T): batch, tok/s, tok/s over softmax's at that T, MFU, GiB, step ms, busy % (per GPU
    under ``--cp``: each GPU runs tokens / cp of every step)."""
    tokens = args.tokens // args.cp
    lines = [f"{'mechanism':14s} {'T':>7s} {'batch':>5s} {'tok/s':>10s} {'/softmax':>8s} {'MFU%':>6s} {'GiB':>6s} "
             f"{'step ms':>9s} {'busy %':>6s}"]
    for mech in mechanisms:
        for T in seq_lens:
            r, base = results.get((mech, T)), results.get(("softmax", T))
            head = f"{mech:14s} {T:7d} {args.tokens // T:5d}"
            if not r:
                lines.append(f"{head} {'failed':>10s}")
                continue
            ratio = f"{r['tps'] / base['tps']:8.3f}" if base else f"{'n/a':>8s}"
            lines.append(f"{head} {r['tps']:10,.0f} {ratio} {_mfu(r)} {r['mem']:6.1f} "
                         f"{1e3 * tokens / r['tps']:9.1f} {busy(r, tokens):>6s}")
    return "\n".join(lines)


def plot(results: dict, mechanisms: list[str], seq_lens: list[int], tokens: int, path: Path) -> None:
    """tok/s against T (log2 axis), one line per mechanism; failed rows are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mech in mechanisms:
        points = [(T, results[(mech, T)]["tps"]) for T in seq_lens if results.get((mech, T))]
        if points:
            ax.plot(*zip(*points), marker="o", label=mech)
    ax.set_xscale("log", base=2)
    ax.set_xticks(seq_lens, [f"{T // 1024}k" if T % 1024 == 0 else str(T) for T in seq_lens])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("training tokens/s")
    ax.set_title(f"{tokens:,} tokens per step, causal mask")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="training data (train.py's training.dataset_path)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder (model.hf_assets_path)")
    ap.add_argument("--mechanisms", default=MECHANISMS,
                    help="comma list: paper configs qwen3_0.6b_<name> (with --config: registered attention names)")
    ap.add_argument("--seq-lens", default="4096,16384,32768,65536", help="comma list of sequence lengths T")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per step at every T (local batch = tokens / T)")
    ap.add_argument("--config", default="", help="one training TOML for every row, with --model.attention <name>")
    ap.add_argument("--ac", choices=AC_MODES, default="config",
                    help="activation checkpointing on every row (config: each config's own)")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel degree: each row on this many GPUs")
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
    try:
        args.seq_lens = [int(t) for t in args.seq_lens.split(",")]
    except ValueError:
        ap.error(f"--seq-lens {args.seq_lens!r}: not a comma list of integers")
    for T in args.seq_lens:
        if T < 1 or args.tokens % T:
            ap.error(f"--tokens {args.tokens} is not a positive multiple of T = {T} (--seq-lens)")
        if args.cp < 1 or T % (2 * args.cp):
            ap.error(f"--cp {args.cp}: T = {T} (--seq-lens) must be a multiple of 2 x --cp")
    args.mechanisms = args.mechanisms.split(",")
    if args.config:
        if not Path(args.config).is_file():
            ap.error(f"--config {args.config}: no such file")
        import attention  # noqa: F401  (registers every mechanism)
        from attention.registry import REGISTRY

        unknown = [m for m in args.mechanisms if m not in REGISTRY]
        if unknown:
            ap.error(f"--mechanisms: {unknown} are not registered attention names (with --config); "
                     f"choose from {sorted(REGISTRY)}")
    else:
        unknown = [m for m in args.mechanisms if not config_for(args, m)[0].is_file()]
        if unknown:
            have = sorted(p.stem.removeprefix("qwen3_0.6b_") for p in (Path(args.repo) / "configs" / "paper").glob(
                "qwen3_0.6b_*.toml"))
            ap.error(f"--mechanisms: no paper config qwen3_0.6b_<name>.toml for {unknown}; choose from {have}")
    check_trace_steps(ap, args)
    if not args.profile and args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}; raise --steps")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_context_"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, int], dict] = {}
    for mech in args.mechanisms:
        for T in args.seq_lens:
            r = results[(mech, T)] = measure(args, mech, T, out)
            line = (f"tps {r['tps']:10,.0f}  mfu {_mfu(r)}%  mem {r['mem']:6.1f}GiB  "
                    f"busy % {busy(r, args.tokens // args.cp)}"
                    if r else "failed")
            print(f"{mech:14s} T={T:<7d} B={args.tokens // T:<4d} {line}", flush=True)
    (out / "results.json").write_text(json.dumps({f"{m}/{T}": r for (m, T), r in results.items()}, indent=1))
    plot_path = Path(args.plot) if args.plot else out / "tps_vs_seq_len.png"
    plot(results, args.mechanisms, args.seq_lens, args.tokens, plot_path)
    ac = "each config's" if args.ac == "config" else args.ac
    print(f"\n{args.tokens:,} tokens per step{f' over CP = {args.cp} GPUs (per GPU figures)' if args.cp > 1 else ''}, "
          f"causal mask, no float8, {args.steps} steps (median after "
          f"{args.warmup}), activation checkpointing: {ac}; logs in {out}, plot {plot_path}")
    print(table(args, results, args.mechanisms, args.seq_lens))
    return results


if __name__ == "__main__":
    main()
