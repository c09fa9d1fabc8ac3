"""Plot train and validation perplexity of several runs on one figure.

    python -m attnlab.tools.plot_ppl RUN_DIR [RUN_DIR ...] -o ppl.png [--labels a,b] [--smooth 0.9] [--x tokens]
                               [--skip 50] [--bands] [--val-only]

Each RUN_DIR is a run's ``job.dump_folder`` holding ``metrics.jsonl`` (written by the trainer). Runs are
labelled by folder name unless ``--labels`` is given; training curves are drawn solid, validation points dashed
with markers, in the same colour per run.

Smoothing (``--smooth β``) is an exponential moving average of the *loss* over steps (β per step, whatever the
log frequency), debiased as in Adam (``m_t = β m_{t-1} + (1-β) loss_t``, plotted ``exp(m_t / (1 - β^t))``), drawn
over the logged curve in the same colour, faint: averaging perplexities would let a few high-loss steps dominate
(ppl is convex in the loss), and the undebiased average starts at 0. ``--x tokens``
plots against tokens seen: step × the tokens per step, from the records' ``n_tokens_seen`` (torchtitan's count,
summed over ranks) when they have it, else the run's ``config.toml`` (``training.global_batch_size`` ×
``training.seq_len``) or ``--tokens-per-step``. ``--skip N`` leaves out steps ≤ N (the first steps' perplexity dwarfs the rest).

``--bands``: runs whose labels differ only in a ``_s<seed>`` suffix (``benchmarks.replicate``'s ``<arm>_s<seed>``) are
one arm, drawn as the mean of their losses (at the steps every seed logged) with a band from the lowest to the
highest seed, and validation points with min–max error bars. ``--val-only`` draws the validation curves alone. More
than 8 curves get 20 colours and a legend beside the axes.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys


def load(run_dir: str) -> tuple[dict[int, dict], dict[int, float]]:
    """({step: training record}, {step: validation loss}) of a run; after a resume the later record of a step
    wins."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"{run_dir}: no metrics.jsonl (is it a run's job.dump_folder?)")
    from attnlab.trainer.metrics import read_records

    train, val = {}, {}
    try:
        records = read_records(path)
    except ValueError as e:  # a broken line: the file and the line, not a bare JSONDecodeError
        sys.exit(f"plot_ppl: error: {e}")
    for r in records:
        if "loss" in r:
            train[r["step"]] = r
        if "val_loss" in r:
            val[r["step"]] = r["val_loss"]
    if not train and not val:
        sys.exit(f"{path}: no loss records")
    return train, val


def debiased_ema(values: list[float], beta: float, steps: list[int] | None = None) -> list[float]:
    """Exponential moving average over *steps* with Adam's bias correction. ``values[k]`` was logged at
    ``steps[k]`` (default 1, 2, 3, ...); between two logged points ``Δ`` steps apart the average decays by
    ``β^Δ``, so β means the same per step whatever ``metrics.log_freq`` is (β = 0.9 spans ~10 steps, not ~10
    logged points). Dividing by the running weight ``1 - β^(steps since the first)`` keeps a constant series
    constant and makes the first output the first value; with one point per step this is Adam's ``m_t/(1-β^t)``."""
    if not 0 <= beta < 1:
        raise ValueError(f"smoothing factor {beta} must be in [0, 1)")
    steps = list(range(1, len(values) + 1)) if steps is None else steps
    out, m, weight, prev = [], 0.0, 0.0, steps[0] - 1 if steps else 0
    for s, v in zip(steps, values):
        d = beta ** (s - prev)
        m, weight, prev = d * m + (1 - d) * v, d * weight + (1 - d), s
        out.append(m / weight)
    return out


def tokens_per_step(run_dir: str, override: int = 0) -> int:
    """Tokens of one optimizer step: ``override``, else ``global_batch_size × seq_len`` of the run's config.toml."""
    if override:
        return override
    import tomli as tomllib  # a dependency on every Python (tomllib is 3.11+)

    path = os.path.join(run_dir, "config.toml")
    if not os.path.isfile(path):
        sys.exit(f"{run_dir}: no config.toml to read the tokens per step from; pass --tokens-per-step")
    with open(path, "rb") as f:
        training = tomllib.load(f).get("training", {})
    batch, seq = training.get("global_batch_size", -1), training.get("seq_len", 0)
    if batch is None or batch <= 0 or not seq:
        sys.exit(f"{path}: training.global_batch_size is {batch} (set by the data-parallel size at run time); "
                 "pass --tokens-per-step")
    return batch * seq


SEED = re.compile(r"_s\d+$")  # a run folder's seed suffix (benchmarks.replicate names runs <arm>_s<seed>)


def _x_scale(run: str, train: dict[int, dict], args) -> float:
    """Units of the horizontal axis per step: 1 (steps), or the run's tokens per step: from torchtitan's cumulative
    ``n_tokens_seen`` (global over ranks) when the records have it, else its config.toml / --tokens-per-step."""
    if args.x == "step":
        return 1
    seen = [(s, r["n_tokens_seen"]) for s, r in sorted(train.items()) if r.get("n_tokens_seen")]
    return seen[-1][1] / seen[-1][0] if seen else tokens_per_step(run, args.tokens_per_step)


def draw(ax, label: str, runs: list[str], color: str, args) -> None:
    """One arm: its training curve (solid) and validation points (dashed, markers). With several runs (seeds)
    the curves are the mean of the runs' losses at the steps they all logged, under a band from the lowest to the
    highest run (validation: error bars), all in loss space before ``exp``."""
    loaded = [load(run) for run in runs]
    per_step = _x_scale(runs[0], loaded[0][0], args)
    exp = lambda v: math.exp(min(v, 50.0))  # noqa: E731
    steps = sorted(set.intersection(*(set(t) for t, _ in loaded))) if not args.val_only else []
    steps = [s for s in steps if s > args.skip]
    if steps:
        raw = [[t[s]["loss"] for s in steps] for t, _ in loaded]
        curves = [debiased_ema(r, args.smooth, steps) for r in raw]
        x = [s * per_step for s in steps]
        if args.smooth:  # the logged values (mean over runs), faint, under the smoothed curve
            ax.plot(x, [exp(statistics.fmean(c)) for c in zip(*raw)], color=color, alpha=0.25, linewidth=0.8,
                    label="_raw")
        ax.plot(x, [exp(statistics.fmean(c)) for c in zip(*curves)], color=color,
                label=f"{label} train" + (f" (mean of {len(runs)})" if len(runs) > 1 else ""))
        if len(runs) > 1:
            ax.fill_between(x, [exp(min(c)) for c in zip(*curves)], [exp(max(c)) for c in zip(*curves)],
                            color=color, alpha=0.2, linewidth=0)
    steps = sorted(set.intersection(*(set(v) for _, v in loaded)))
    steps = [s for s in steps if s > args.skip]
    if steps:
        vals = [[v[s] for _, v in loaded] for s in steps]
        x, y = [s * per_step for s in steps], [exp(statistics.fmean(v)) for v in vals]
        if len(runs) > 1:
            ax.errorbar(x, y, yerr=[[m - exp(min(v)) for m, v in zip(y, vals)], [exp(max(v)) - m for m, v in zip(y, vals)]],
                        fmt="none", ecolor=color, capsize=3, label="_band")
        ax.plot(x, y, "o--", color=color, label=f"{label} val")


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import ToolParser, existing_dir, non_negative_int, out_file, unit_float

    ap = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=existing_dir, help="run folders (job.dump_folder) holding metrics.jsonl")
    ap.add_argument("-o", "--output", type=out_file, default="ppl.png", help="PNG to write")
    ap.add_argument("--labels", default="", help="comma-separated labels, one per run")
    ap.add_argument("--smooth", type=unit_float, default=0.0,
                    help="debiased EMA factor β in [0, 1) for the training loss (0 = none)")
    ap.add_argument("--x", choices=("step", "tokens"), default="step", help="horizontal axis")
    ap.add_argument("--skip", type=non_negative_int, default=0, help="leave out steps <= N")
    ap.add_argument("--val-only", action="store_true", help="only the validation curves")
    ap.add_argument("--bands", action="store_true",
                    help="runs whose names differ only in a _s<seed> suffix are one arm: mean curve and min-max band")
    ap.add_argument("--tokens-per-step", type=non_negative_int, default=0,
                    help="tokens per step for --x tokens (default: from each run's config.toml)")
    return ap


def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.normpath(r)) for r in args.runs]
    if len(labels) != len(args.runs):
        sys.exit(f"--labels has {len(labels)} entries for {len(args.runs)} runs")
    if not 0 <= args.smooth < 1:
        sys.exit(f"--smooth {args.smooth}: must be in [0, 1)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[str]] = {}  # label -> run folders (several: the seeds of one arm, with --bands)
    for run, label in zip(args.runs, labels):
        groups.setdefault(SEED.sub("", label) if args.bands else label, []).append(run)
    many = len(groups) > 8  # a legend beside the axes, and 20 colours instead of 10
    fig, ax = plt.subplots(figsize=(11 if many else 8, 5))
    for i, (label, runs) in enumerate(groups.items()):
        draw(ax, label, runs, plt.get_cmap("tab20")(i % 20) if many else f"C{i}", args)
    ax.set_xlabel("tokens" if args.x == "tokens" else "step")
    if args.x == "step":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("perplexity" + (f" (train: debiased EMA of the loss, β={args.smooth:g})" if args.smooth else ""))
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    if many:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    else:
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
