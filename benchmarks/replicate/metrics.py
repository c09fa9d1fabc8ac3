"""Reading a run folder and the summary of many: metrics.jsonl (progress, medians, whether it finished), the
resumable checkpoint, the analysis, and summary.json (written atomically, merged across processes); a suite's rows
rebuilt from its run folders alone."""

from __future__ import annotations

import glob
import json
import os
import statistics

from benchmarks.replicate.evaluate import columns as eval_columns


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
    """Last validation/training record, the median training tokens/s (log intervals after step 1), the peak
    reserved GPU memory (``mem_gib``, None on the CPU) and ``spike``: the largest rise of a logged training loss over
    the median of the five logged before it, past the first tenth of the steps (nats). A logged loss is one step's
    batch, and batches differ in difficulty by up to ~0.5 nats at the repl-68M scale; a spike shows above that.
    ``gnorm_spike``: the largest logged gradient norm after step 1 over their median; gradient clipping can hide a
    spike from the loss, not from the norm."""
    from attnlab.trainer.metrics import read_records

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    recs = read_records(path)
    val = [r for r in recs if "val_loss" in r]
    train = [r for r in recs if "loss" in r]
    tps = [r["tps"] for r in train if r["step"] > 1 and "tps" in r]
    mem = [r["memory_gib"] for r in train if "memory_gib" in r]
    late = [r["loss"] for r in train if r["step"] > train[-1]["step"] // 10 and r["loss"] is not None] if train else []
    norms = [r["grad_norm"] for r in train if r["step"] > 1 and r.get("grad_norm") is not None]
    norm_median = statistics.median(norms) if norms else 0.0
    return {"val_loss": val[-1]["val_loss"] if val else None, "val_ppl": val[-1]["val_ppl"] if val else None,
            "train_loss": train[-1]["loss"] if train else None, "step": train[-1]["step"] if train else None,
            "val_step": val[-1]["step"] if val else None,
            "tps": statistics.median(tps) if tps else None, "mem_gib": max(mem) if mem else None,
            "spike": max((max(0.0, b - statistics.median(late[max(0, i - 5):i])) for i, b in enumerate(late) if i),
                         default=None),
            "gnorm_spike": max(norms) / norm_median if norm_median > 0 else None}


def finished_at(metrics: dict, steps: int) -> bool:
    """Whether the run of ``metrics`` (:func:`read_metrics`) reached ``steps``: every run validates at its last step,
    while its last logged training step can be earlier (log steps are multiples of ``metrics.log_freq``)."""
    return metrics.get("val_step") == steps and metrics.get("val_loss") is not None


ANALYSIS_KEYS = ("cor", "cpa", "probe_norm", "rho_gain", "entropy", "sink_p", "srank_wr", "srank_wq")


def read_analysis(row: dict, dump: str) -> bool:
    """Add the summary of ``<dump>/analysis/analysis.json`` (:data:`ANALYSIS_KEYS`) to ``row``; False if there is
    none."""
    path = os.path.join(dump, "analysis", "analysis.json")
    if not os.path.isfile(path):
        return False
    s = json.load(open(path))["summary"]
    row.update({key: s.get(key) for key in ANALYSIS_KEYS})
    return True


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
        batch = int(flags[flags.index("--training.local_batch_size") + 1])  # the suite's; a data-parallel arm's
        gpus = batch // flag("--training.local_batch_size")  # runs repeat it with its share (run.run_suite)
        row = {"run": name, "arm": arm, "seed": int(seed), "steps": steps, "gpus": gpus,
               "tokens": steps * batch * flag("--training.seq_len"), "seconds": old.get(name, {}).get("seconds"), **m}
        row["ok"] = finished_at(m, steps)
        if not row["ok"]:
            row.update(paused=m.get("step") or 0, error=f"stopped near step {m.get('step') or 0}/{steps}; "
                       "the suite's command resumes it")
        read_analysis(row, dump)
        row.update(eval_columns(dump))
        rows.append(row)
    found = {r["run"]: r for r in rows}  # summary.json's runs whose folder is not here (another machine's) stay
    return [found.pop(name, r) for name, r in old.items()] + list(found.values())
