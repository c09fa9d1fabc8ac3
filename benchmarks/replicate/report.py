"""The replication's table (a row per run, and per arm the mean and spread over seeds against the matching softmax
arm) and the plot of every analysed run's diagnostics by layer."""

from __future__ import annotations

import json
import os
import re
import statistics


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
    """table.txt: a line per run (perplexity, diagnostics, seconds, status), the per-arm table when an arm has several
    seeds, and a footer of ``log``'s setup (tokens per step, compile, device, total time, calibration)."""
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
