"""Plot train and validation perplexity of several runs on one figure.

    python -m scripts.plot_ppl RUN_DIR [RUN_DIR ...] -o ppl.png [--labels a,b] [--smooth 0.9]

Each RUN_DIR is a run's ``job.dump_folder`` holding ``metrics.jsonl`` (written by the trainer). Runs are
labelled by folder name unless ``--labels`` is given; training curves are drawn solid (optionally EMA-smoothed),
validation points dashed with markers, in the same colour per run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def load(run_dir: str) -> tuple[dict[int, float], dict[int, float]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"{run_dir}: no metrics.jsonl (is it a run's job.dump_folder?)")
    train, val = {}, {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "ppl" in r:
                train[r["step"]] = r["ppl"]  # after a resume the later record of a step wins
            if "val_ppl" in r:
                val[r["step"]] = r["val_ppl"]
    if not train and not val:
        sys.exit(f"{path}: no perplexity records")
    return train, val


def ema(values: list[float], alpha: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out.append(acc)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("-o", "--output", default="ppl.png")
    ap.add_argument("--labels", default="", help="comma-separated labels, one per run")
    ap.add_argument("--smooth", type=float, default=0.0, help="EMA factor for training curves (0 = none)")
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.normpath(r)) for r in args.runs]
    if len(labels) != len(args.runs):
        sys.exit(f"--labels has {len(labels)} entries for {len(args.runs)} runs")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (run, label) in enumerate(zip(args.runs, labels)):
        train, val = load(run)
        color = f"C{i}"
        if train:
            steps = sorted(train)
            ax.plot(steps, ema([train[s] for s in steps], args.smooth), color=color, label=f"{label} train")
        if val:
            steps = sorted(val)
            ax.plot(steps, [val[s] for s in steps], "o--", color=color, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
