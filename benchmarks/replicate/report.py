"""The replication's table (a row per run, and per arm the mean and spread over seeds against the matching softmax
arm) and the plot of every analysed run's diagnostics by layer."""

from __future__ import annotations

import json
import os
import re
import statistics

from benchmarks.replicate.plan import EVALUATED


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


OUTLIER_DELTA = 25.0
"""An arm more than this many % worse than softmax (validation perplexity, means over seeds) is an outlier."""
GNORM_SPIKE = 20.0
"""A logged gradient norm this many times the run's median (``metrics.read_metrics``'s ``gnorm_spike``) flags the
arm as unstable: clipping keeps such a step out of the loss curve (stable registry runs: 3-6× past step 1)."""
SPIKE_NATS = 1.0
"""A logged training loss this far above the median of the ones before it (``metrics.read_metrics``'s ``spike``)
flags an unstable run: twice the batch-to-batch spread of a stable repl-68M run (0.34-0.43 nats)."""
MEAN_KEYS = ("ood_ppl", "tps", "mem_gib", "passkey_1x", "passkey_2x", "passkey_logp", "mqar", "ref_err")


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def registry_rows(rows: list[dict]) -> list[dict]:
    """:func:`arm_rows` with the registry suites' columns averaged over seeds (:data:`MEAN_KEYS`, and ``pos_ppl`` per
    bucket), the largest ``spike``, the runs that did not finish, and ``flags``: why the arm needs a write-up
    (:data:`OUTLIER_DELTA`, :data:`SPIKE_NATS`, :data:`GNORM_SPIKE`, failed runs)."""
    arms = arm_rows(rows)
    by_arm: dict[str, list[dict]] = {}
    for r in rows:
        by_arm.setdefault(r.get("arm") or r["run"].rpartition("_s")[0], []).append(r)
    done = {a["arm"] for a in arms}
    arms += [{"arm": arm, "seeds": [], "mean": None, "min": None, "max": None, "delta": None}
             for arm in by_arm if arm not in done]
    for a in arms:
        runs = by_arm[a["arm"]]
        ok = [r for r in runs if r.get("ok")]
        a.update({k: _mean([r.get(k) for r in ok]) for k in MEAN_KEYS})
        buckets = {b for r in ok for b in r.get("pos_ppl") or {}}
        a["pos_ppl"] = {b: _mean([(r.get("pos_ppl") or {}).get(b) for r in ok]) for b in sorted(buckets, key=int)}
        a["spike"] = max((r["spike"] for r in ok if r.get("spike") is not None), default=None)
        a["gnorm_spike"] = max((r["gnorm_spike"] for r in ok if r.get("gnorm_spike") is not None), default=None)
        a["failed"] = [r["run"] for r in runs if not r.get("ok")]
        wide = max((r.get("gpus") or 1 for r in ok), default=1)
        a["flags"] = ([f"{a['delta']:+.0f}% vs softmax"] if a["delta"] is not None and a["delta"] > OUTLIER_DELTA
                      else []) + ([f"loss spike {a['spike']:.2f}"] if (a["spike"] or 0) > SPIKE_NATS else []) + \
                     ([f"gradient-norm spike {a['gnorm_spike']:.0f}x"] if (a["gnorm_spike"] or 0) > GNORM_SPIKE
                      else []) + \
                     ([f"{wide} GPUs data-parallel: tok/s per GPU, documents packed per rank"] if wide > 1 else []) + \
                     ([f"not finished: {','.join(a['failed'])}"] if a["failed"] else [])
    return arms


def format_registry(rows: list[dict], excluded: dict[str, str] | None = None) -> str:
    """The registry suites' table: a line per arm (:func:`registry_rows`), then the mechanisms not trained and why."""
    arms = registry_rows(rows)
    buckets = list(dict.fromkeys(b for a in arms for b in a["pos_ppl"]))

    def fmt(v, spec):
        width = int(spec.split(".")[0])
        return f"{'-':>{width}}" if v is None else format(v, spec)

    w = max([14, *(len(a["arm"]) + 1 for a in arms)])
    head = (f"{'arm':<{w}}{'seeds':>6}{'val ppl':>9}{'min':>8}{'max':>8}{'vs sm':>7}{'ood ppl':>9}{'tok/s':>9}"
            f"{'GiB':>6}" + "".join(f"{'pos' + b:>9}" for b in buckets)
            + f"{'pk1x':>6}{'pk2x':>6}{'pk_lp':>7}{'mqar':>6}{'ref err':>9}{'spike':>6}{'gn x':>6}  flags")
    lines = [head, "-" * len(head)]
    for a in arms:
        delta = "-" if a["delta"] is None else f"{a['delta']:+.1f}%"
        lines.append(f"{a['arm']:<{w}}{','.join(map(str, a['seeds'])) or '-':>6}{fmt(a['mean'], '9.2f')}"
                     f"{fmt(a['min'], '8.2f')}{fmt(a['max'], '8.2f')}{delta:>7}{fmt(a['ood_ppl'], '9.2f')}"
                     f"{fmt(a['tps'], '9.0f')}{fmt(a['mem_gib'], '6.1f')}"
                     + "".join(fmt(a["pos_ppl"].get(b), "9.2f") for b in buckets)
                     + f"{fmt(a['passkey_1x'], '6.2f')}{fmt(a['passkey_2x'], '6.2f')}{fmt(a['passkey_logp'], '7.2f')}"
                     f"{fmt(a['mqar'], '6.3f')}{fmt(a['ref_err'], '9.1e')}"
                     f"{fmt(a['spike'], '6.2f')}{fmt(a['gnorm_spike'], '6.0f')}  {'; '.join(a['flags'])}")
    lines += [f"not trained: {m}: {why}" for m, why in (excluded or {}).items()]
    return "\n".join(lines)


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
    if log and log.get("suite") in EVALUATED:  # the arms with every column
        lines += ["", format_registry(rows, log.get("excluded"))]
    elif any(len(a["seeds"]) > 1 for a in arms):  # seeds side by side: the mean and its spread per arm
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
