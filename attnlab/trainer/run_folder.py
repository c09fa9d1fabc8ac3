"""What a run may read and write in its run folder, checked before the trainer starts (``train.preflight``; nothing is
written, every message names the key or file). The rules (docs/failures.md):

- ``job.dump_folder`` and the checkpoint folder are folders (or absent), not files;
- ``checkpoint.initial_load_path``, while it is used (the checkpoint folder absent), names a checkpoint: a run
  folder is answered with its newest step, a missing path named as such;
- the checkpoint about to be loaded is safe to unpickle (:func:`checkpoint.dcp.check_pickles`) and fits the model
  built (:func:`trainer.checkpoint.architecture_mismatch`);
- a run continues only from its newest step: ``checkpoint.load_step`` of an older step, in a run that writes
  checkpoints, is refused (training on would overwrite the later steps); a run is branched from a step with
  ``checkpoint.initial_load_path`` and a new ``job.dump_folder``;
- the run replaces only files a run wrote: a fresh start (nothing of this run to resume) replaces ``config.toml``,
  ``config.resolved.toml`` and ``tokenizer/`` files only while they are as an earlier run in the folder wrote them
  (the same command again after a run stopped before its first checkpoint), and moves that run's ``metrics.jsonl``
  aside instead of appending to it (:func:`set_aside_metrics`); a resume replaces ``config.toml`` and
  ``config.resolved.toml`` only while they are as the run last wrote them (:func:`checkpoint.layout.run_record`; a
  folder of an older attnlab has no record and is the run's); a ``metrics.jsonl`` no run wrote is never touched;
- no ``step-N`` folder the run may save to holds anything but the run's own DCP checkpoints (a Hugging Face export
  there would be written into, then rotated away).
"""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

from attnlab.checkpoint.dcp import check_pickles
from attnlab.checkpoint.layout import (CONFIG_FILE, METRICS_FILE, RESOLVED_CONFIG_FILE, TOKENIZER_DIR, TOKENIZER_FILES,
                                       file_digest, has_safetensors, is_checkpoint_folder, is_dcp_folder, resolve,
                                       run_record, step_folders, step_of)
from attnlab.trainer.checkpoint import PARTIAL_LOAD_HINT, architecture_mismatch, planned_load


def check_run_folder(job_config, args, model_keys, tokenizer_dir: str) -> None:
    """Every rule of the module docstring for the run of ``job_config``, whose model has architecture ``args`` and
    state-dict keys ``model_keys`` and whose tokenizer is in ``tokenizer_dir``; a ValueError naming the key or
    file otherwise. Reads only."""
    dump, ck = job_config.job.dump_folder, job_config.checkpoint
    folder = os.path.join(dump, ck.folder)
    check_is_folder(dump, "job.dump_folder")
    if ck.enable:
        check_is_folder(folder, "checkpoint.folder")
        check_initial_load_path(ck, folder)
        check_load_step(ck, folder)
    path, model_only = planned_load(ck, folder, ck.load_step)
    if path is not None:
        meta = check_pickles(path)
        what = architecture_mismatch(path, meta, model_keys, args, model_only)
        if what is not None and not ck.partial_load:
            raise ValueError(f"{what}. {PARTIAL_LOAD_HINT}")
    resuming = path is not None and os.path.isdir(folder)
    check_run_files(job_config, resuming, tokenizer_dir)
    if ck.enable and not ck.load_only:
        start = (step_of(path) or 0) if path is not None and not model_only else 0
        check_save_targets(folder, start, job_config.training.steps)


def check_is_folder(path: str, key: str) -> None:
    """``path`` is a folder, or absent with no file in the way of creating it."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not p.is_dir():
        where = "" if str(p) == str(path) else f" ({str(p)!r} is in its path)"
        raise ValueError(f"{key}={path!r}: a file{where}, not a folder; choose a folder (it is created when missing)")


def check_initial_load_path(ck, folder: str) -> None:
    """``checkpoint.initial_load_path``, while torchtitan uses it (the checkpoint folder ``folder`` absent), names a
    DCP step folder (or, with ``initial_load_in_hf``, a folder of safetensors)."""
    src = ck.initial_load_path
    if not src or os.path.exists(folder):
        return
    key = f"checkpoint.initial_load_path={src!r}"
    if not os.path.isdir(src):
        raise ValueError(f"{key}: no such folder; pass a checkpoint's step folder (RUN/checkpoint/step-N)")
    if ck.initial_load_in_hf:
        if not has_safetensors(src):
            raise ValueError(f"{key}: no safetensors weights there (checkpoint.initial_load_in_hf reads a Hugging "
                             "Face folder)")
        return
    if is_dcp_folder(src):
        return
    try:
        newest = resolve(src).path
    except FileNotFoundError:
        newest = None
    if newest is not None and is_dcp_folder(newest):
        raise ValueError(f"{key}: a run folder, not a checkpoint; pass one of its step folders, e.g. its newest: "
                         f"--checkpoint.initial_load_path {newest}")
    what = "a Hugging Face folder; add --checkpoint.initial_load_in_hf" if is_checkpoint_folder(src) else \
        "not a DCP checkpoint (no .metadata)"
    raise ValueError(f"{key}: {what}")


def check_load_step(ck, folder: str) -> None:
    """``checkpoint.load_step`` names a step of ``folder``; in a run that writes checkpoints, its newest one."""
    if ck.load_step < 0 or not os.path.isdir(folder):
        return
    steps = sorted(step_folders(folder, dcp_only=True))
    path = os.path.join(folder, f"step-{ck.load_step}")
    if ck.load_step not in steps:
        raise ValueError(f"checkpoint.load_step={ck.load_step}: {path} does not exist; the checkpoints in {folder!r} "
                         f"are of steps {steps}. Pick one of them, or -1 for the latest.")
    later = [n for n in steps if n > ck.load_step]
    if later and not ck.load_only:
        raise ValueError(
            f"checkpoint.load_step={ck.load_step}: {folder!r} has later steps {later}, which training on from step "
            f"{ck.load_step} would overwrite; a run continues only from its newest step. To branch it from step "
            f"{ck.load_step}, start a new run: --checkpoint.initial_load_path {path} "
            "--checkpoint.no-initial_load_model_only --job.dump_folder NEW_FOLDER (or add --checkpoint.load_only to "
            "train without saving)")


def _metrics_steps(path: Path) -> str | None:
    """"steps A to B" of the records in the metrics file ``path``, "records" when unreadable; None when it has none."""
    from attnlab.trainer.metrics import read_records

    if not path.is_file() or path.stat().st_size == 0:
        return None
    try:
        steps = [r["step"] for r in read_records(path) if isinstance(r.get("step"), int)]
    except (OSError, ValueError):
        return "records"
    return f"steps {min(steps)} to {max(steps)}" if steps else None


def check_run_files(job_config, resuming: bool, tokenizer_dir: str) -> None:
    """The dump folder holds no file the run would replace or append to without having written it (module
    docstring); ``resuming``: the run continues from a checkpoint of its own checkpoint folder."""
    dump = Path(job_config.job.dump_folder)
    if not dump.is_dir():
        return
    record, given = run_record(dump), job_config.job.config_file
    # a fresh start may replace what an earlier run in this folder wrote and nobody changed since (the same command
    # again after a run stopped before its first checkpoint); a folder of an older attnlab has no record
    ours = lambda p: record is not None and record.get(str(p.relative_to(dump)), "") == file_digest(p)  # noqa: E731
    found = []
    for name in (CONFIG_FILE, RESOLVED_CONFIG_FILE):
        p = dump / name
        if not p.is_file() or (name == CONFIG_FILE and given and os.path.isfile(given) and os.path.samefile(given, p)):
            continue  # a config.toml that is this run's job.config_file is kept as written
        if not resuming and not ours(p):
            found.append(f"{p} (not written by a run in this folder, or changed since)")
        elif resuming and record is not None and record.get(name) != file_digest(p):
            found.append(f"{p} ({'changed since this run wrote it' if name in record else 'not written by this run'})")
    metrics = dump / METRICS_FILE
    steps = _metrics_steps(metrics)
    if steps and not resuming and (record is None or METRICS_FILE not in record):
        found.append(f"{metrics} (an earlier run: {steps})")
    elif steps and resuming and record is not None and METRICS_FILE not in record:
        found.append(f"{metrics} (not written by this run: {steps})")
    if not resuming:
        for name in TOKENIZER_FILES:
            mine, src = dump / TOKENIZER_DIR / name, Path(tokenizer_dir) / name
            if mine.is_file() and not ours(mine) and not (src.is_file() and filecmp.cmp(mine, src, shallow=False)):
                found.append(f"{mine} (not this run's tokenizer)")
    if not found:
        return
    why = ("this run resumes from its checkpoints and would replace them" if resuming else
           "this run starts fresh (no checkpoint of its own in checkpoint.folder to continue)")
    raise ValueError(f"job.dump_folder={str(dump)!r} holds files this run would replace or append "
                     f"to but did not write: {'; '.join(found)}; {why}. Move them away, or choose another "
                     "job.dump_folder.")


def check_save_targets(folder: str, start: int, steps: int) -> None:
    """No ``step-N`` folder with ``start < N <= steps`` (a step this run may save) holds weights other than a DCP
    checkpoint: DCP would write its shards into a Hugging Face export there, and rotation would then delete it."""
    for n, p in sorted(step_folders(folder).items()):
        if start < n <= steps and not is_dcp_folder(p):
            raise ValueError(f"checkpoint.folder: {p} holds safetensors weights (a Hugging Face export?), not a "
                             f"checkpoint of this run, and this run (steps {start + 1} to {steps}) may save step {n} "
                             "there; move it out of the checkpoint folder or give it a name other than step-N")


def set_aside_metrics(job_config) -> Path | None:
    """On a fresh start (no checkpoint of this run to continue), an earlier run's ``metrics.jsonl`` in the dump folder
    is renamed to ``metrics.prev-N.jsonl`` (N the first free number) so the new run's records start a file of their
    own; returns the new name, or None when there was nothing to move. :func:`check_run_files` already refused a
    metrics file no run in this folder wrote. Call on rank 0 before the metrics logger opens the file."""
    dump, ck = Path(job_config.job.dump_folder), job_config.checkpoint
    path, _ = planned_load(ck, str(dump / ck.folder), ck.load_step)
    metrics = dump / METRICS_FILE
    if (path is not None and (dump / ck.folder).is_dir()) or not _metrics_steps(metrics):
        return None
    n = 1
    while (dump / f"metrics.prev-{n}.jsonl").exists():
        n += 1
    target = dump / f"metrics.prev-{n}.jsonl"
    os.rename(metrics, target)
    return target
