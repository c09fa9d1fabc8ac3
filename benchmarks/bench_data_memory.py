"""Peak memory (RSS) of a training run on one long document, against a normal run: same command, other data.

    python -m benchmarks.bench_data_memory [--mb 50] [--steps 1] [--repo DIR] [--rows default,docs,one]

Rows (each launches ``python -m attnlab.train`` on the debug model, CPU, embedded tokenizer, validation and
checkpoints off, ``--steps`` steps, and reads the process's peak RSS from ``wait4``):

- ``default``: the embedded corpus (about 4,000 documents, 5 MB), the normal run;
- ``docs``: ``--mb`` MB of text as documents of about 10 KB in one ``.jsonl``;
- ``one``: the same ``--mb`` MB of text as one document (one ``.txt`` file).

The text is the embedded corpus repeated. ``--repo DIR`` runs another checkout's ``attnlab`` (before/after rows of
one change), run in that folder. The data files are written once under ``--work`` (default ``/tmp/bench_data_memory``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def corpus_text(cache_dir: str, mb: int) -> str:
    from attnlab.data.embedded import build_embedded

    folder = build_embedded(cache_dir, 4096)
    docs = [json.loads(line)["text"] for line in open(folder / "train.jsonl", encoding="utf-8")]
    text, n = [], 0
    while n < mb * 1_000_000:
        for d in docs:
            text.append(d)
            n += len(d) + 2
    return "\n\n".join(text)[: mb * 1_000_000]


def data_files(work: Path, cache_dir: str, mb: int) -> dict[str, str]:
    one, docs = work / f"one-{mb}mb.txt", work / f"docs-{mb}mb.jsonl"
    if not (one.exists() and docs.exists()):
        text = corpus_text(cache_dir, mb)
        one.write_text(text, encoding="utf-8")
        with open(docs, "w", encoding="utf-8") as f:
            for i in range(0, len(text), 10_000):
                f.write(json.dumps({"text": text[i:i + 10_000]}, ensure_ascii=False) + "\n")
    return {"default": "", "docs": str(docs), "one": str(one)}


def peak_rss(cmd: list[str], env: dict, log: Path, cwd: str | None) -> tuple[float, float, int]:
    """(peak RSS in MB, wall seconds, exit status) of ``cmd``."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss / 1024, time.perf_counter() - t0, os.waitstatus_to_exitcode(status)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=50, help="size of the long document (and of the docs row), MB")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--rows", default="default,docs,one")
    ap.add_argument("--repo", default="", help="checkout whose attnlab runs (default: the installed one)")
    ap.add_argument("--work", default="/tmp/bench_data_memory")
    a = ap.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cache = str(work / "cache")
    files = data_files(work, cache, a.mb)
    env = {**os.environ, **({"PYTHONPATH": a.repo} if a.repo else {})}  # and its folder as the working directory,
    # which ``python -m`` puts first on the import path
    print("| row | data | peak RSS MB | wall s | exit |\n|---|---|---|---|---|")
    base = None
    for row in a.rows.split(","):
        with tempfile.TemporaryDirectory(dir=work) as dump:
            cmd = [sys.executable, "-m", "attnlab.train", "--job.config_file", "debug_cpu", "--job.dump_folder", dump,
                   "--training.steps", str(a.steps), "--lr_scheduler.warmup_steps", "1", "--validation.no-enable",
                   "--checkpoint.no-enable", "--metrics.no-enable-tensorboard", "--metrics.log_freq", "1",
                   "--data.cache_dir", cache,
                   *(["--training.dataset_path", files[row]] if files[row] else [])]
            rss, wall, code = peak_rss(cmd, env, work / f"{row}.log", a.repo or None)
        base = base or rss
        what = {"default": "embedded corpus", "docs": f"{a.mb} MB, 10 KB documents",
                "one": f"{a.mb} MB, one document"}[row]
        print(f"| {row} | {what} | {rss:.0f} ({rss / base:.2f}x) | {wall:.1f} | {code} |", flush=True)


if __name__ == "__main__":
    main()
