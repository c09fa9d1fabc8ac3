"""The run folder's rules (docs/failures.md): one live run per dump folder and per checkpoint folder (lock files), a
writable checkpoint folder and enough free disk checked at start, a run's checkpoints continued only with the
tokenizer they were trained with, and the run described in its folder (``config.toml``, ``tokenizer/``) once its
checkpoint is loaded."""

from __future__ import annotations

import filecmp
import os
import shutil
import socket

from torchtitan.tools.logging import logger

from attnlab.data.loader import tokenizer_path
from attnlab.checkpoint.layout import (CONFIG_FILE, METRICS_FILE, TOKENIZER_DIR, TOKENIZER_FILES, record_run_files,
                                       step_folders, write_run_files)
from attnlab.trainer.checkpoint import checkpoint_bytes


class RunLock:
    """``<dump_folder>/.attnlab.lock`` holding "host pid": one live run per dump folder (``key`` names the config
    key of ``folder`` in the message; ``path``, when given, is the lock file instead).

    Taken by global rank 0 only (other ranks of the same job never touch it), before anything is built, and
    released when the trainer closes. A lock whose process is gone (same host, pid not alive) is stale and is taken
    over with a warning; a lock from another host cannot be probed and is treated as live. With node-local dump
    folders only rank 0's host holds a lock."""

    NAME = ".attnlab.lock"

    def __init__(self, folder: str, key: str = "job.dump_folder", path: str | None = None):
        self.path = path or os.path.join(folder, self.NAME)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        me = f"{socket.gethostname()} {os.getpid()}"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                host, pid = self._holder()
                if host == socket.gethostname() and pid is not None and not _pid_alive(pid):
                    logger.warning(f"Taking over the stale lock {self.path} of process {pid} (no longer running)")
                    os.unlink(self.path)
                    continue
                raise RuntimeError(f"{key} {folder!r} is in use by another run (process {pid} on host {host}, lock "
                                   f"file {self.path}); choose another {key}, or stop that run (delete the lock "
                                   "file only if that process is gone)") from None
            with os.fdopen(fd, "w") as f:
                f.write(me)
            return
        raise RuntimeError(f"could not take the lock {self.path}")

    def _holder(self) -> tuple[str, int | None]:
        try:
            with open(self.path) as f:
                host, _, pid = f.read().strip().partition(" ")
            return host, int(pid)
        except (OSError, ValueError):
            return "?", None

    def release(self) -> None:
        if self._holder() == (socket.gethostname(), os.getpid()):
            os.unlink(self.path)


def checkpoint_lock_path(folder: str) -> str:
    """The lock file of checkpoint folder ``folder``: ``.<name>.attnlab.lock`` beside it (its real path, so every
    spelling of one folder shares one lock). Not inside it: torchtitan loads ``checkpoint.initial_load_path`` only
    while the checkpoint folder does not exist."""
    real = os.path.realpath(folder)
    return os.path.join(os.path.dirname(real), f".{os.path.basename(real)}{RunLock.NAME}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _existing_dir(folder: str) -> str:
    """``folder``, or while it does not exist its nearest existing parent (where a file stands in the way: that
    path, so the write probe fails on it)."""
    probe_dir = folder
    while not os.path.isdir(probe_dir):
        parent = os.path.dirname(probe_dir.rstrip(os.sep)) or "."
        if parent == probe_dir or (os.path.exists(probe_dir) and not os.path.isdir(probe_dir)):
            break
        probe_dir = parent
    return probe_dir


def check_writable(folder: str, key: str) -> None:
    """Fail at start when ``folder`` (or, while it does not exist yet, its nearest existing parent) cannot be
    written, instead of at the first save after hours of training. Nothing is created inside a missing
    ``folder``: torchtitan reads ``checkpoint.initial_load_path`` only while the checkpoint folder is absent."""
    probe_dir = _existing_dir(folder)
    probe = os.path.join(probe_dir, f".attnlab-write-probe-{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{key}: cannot write checkpoints to {folder!r} ({probe_dir!r}: {e.strerror or e}); "
                         "make it writable or point it elsewhere") from e


def check_free_space(folder: str, need: int, keep: int) -> None:
    """Log free disk space at ``folder`` against the estimated size ``need`` of one checkpoint; fail when not
    even one fits, warn when ``keep`` of them (``checkpoint.keep_latest_k``, 0 = all) plus one being written
    might not."""
    free = shutil.disk_usage(_existing_dir(folder)).free
    gib = 2**30
    logger.info(f"Checkpoints in {folder}: about {need / gib:.3f} GiB each, {free / gib:.2f} GiB free")
    if free < need:
        raise ValueError(f"checkpoint.folder {folder!r}: {free / gib:.2f} GiB free, one checkpoint needs about "
                         f"{need / gib:.2f} GiB; free space or point checkpoint.folder/job.dump_folder elsewhere")
    if keep and free < need * (keep + 1):
        logger.warning(f"checkpoint.folder {folder!r}: {free / gib:.2f} GiB free may not hold "
                       f"checkpoint.keep_latest_k={keep} checkpoints of about {need / gib:.2f} GiB plus one in flight")


def check_run_tokenizer(dump_folder: str, ck_folder: str, tok: str) -> None:
    """A run folder whose checkpoints were trained with ``<dump_folder>/tokenizer`` continues with that tokenizer:
    another one of the same vocabulary size would resume silently with other token ids (the loss jumps)."""
    stored = os.path.join(dump_folder, TOKENIZER_DIR, "tokenizer.json")
    new = os.path.join(tok, "tokenizer.json")
    if not (step_folders(ck_folder, dcp_only=True) and os.path.isfile(stored) and os.path.isfile(new)):
        return
    if not filecmp.cmp(stored, new, shallow=False):
        raise ValueError(f"model.hf_assets_path={tok!r}: its tokenizer.json differs from {stored}, the tokenizer the "
                         f"checkpoints in {ck_folder!r} were trained with; resume with --model.hf_assets_path "
                         f"{os.path.dirname(stored)}, or train the new tokenizer in another job.dump_folder")


class RunGuard:
    """The rules of the module docstring for the run of ``job_config``. Constructed before anything is built (rank
    0 takes the locks; every rank checks); :meth:`check_disk` once the model is; :meth:`describe_run` after the
    checkpoint load; :meth:`release` when the trainer closes (or fails to start)."""

    def __init__(self, job_config):
        self.job_config = job_config
        dump, ck = job_config.job.dump_folder, job_config.checkpoint
        self.rank0 = int(os.environ.get("RANK", "0")) == 0
        self.ck_folder = os.path.join(dump, ck.folder)
        self.writes_checkpoints = ck.enable and not ck.load_only
        self._locks = [RunLock(dump)] if self.rank0 else []
        try:
            if self.writes_checkpoints:
                check_writable(self.ck_folder, "checkpoint.folder")
                # two runs with different dump folders and one checkpoint folder would overwrite each other's steps
                if self.rank0 and os.path.realpath(self.ck_folder) != os.path.realpath(dump):
                    self._locks.append(RunLock(self.ck_folder, "checkpoint.folder",
                                               checkpoint_lock_path(self.ck_folder)))
            check_run_tokenizer(dump, self.ck_folder, tokenizer_path(job_config))
        except BaseException:
            self.release()
            raise

    def check_disk(self, model_parts) -> None:
        """Free disk for the checkpoints of the model built (:func:`check_free_space`)."""
        if self.writes_checkpoints:
            check_free_space(self.ck_folder, checkpoint_bytes(model_parts), self.job_config.checkpoint.keep_latest_k)

    def describe_run(self) -> None:
        """``<dump_folder>/config.toml`` and ``tokenizer/`` (:func:`checkpoint.layout.write_run_files`, rank 0), so
        tools rebuild this run without its flags. Called after the checkpoint load passed the architecture checks: a
        resume with a different architecture fails before the file is touched, so config.toml always describes
        the model the run folder's newest checkpoints hold (with ``checkpoint.partial_load`` on purpose: the new
        model). The ``tokenizer/`` of a run folder with checkpoints is never replaced (:func:`check_run_tokenizer`
        made sure it is the one in use); a ``config.toml`` that is this run's ``job.config_file`` is kept. The files
        written are added to the run's record (:func:`checkpoint.layout.record_run_files`)."""
        if not self.rank0:
            return
        cfg = self.job_config
        dump = cfg.job.dump_folder
        keep_tokenizer = os.path.isfile(os.path.join(dump, TOKENIZER_DIR, "tokenizer.json")) and bool(step_folders(
            self.ck_folder, dcp_only=True))
        written = write_run_files(dump, cfg, None if keep_tokenizer else tokenizer_path(cfg))
        # what this run owns from now on: train.preflight lets a resume replace only these, as written here
        record_run_files(dump, [written, os.path.join(dump, METRICS_FILE)]
                         + [os.path.join(dump, TOKENIZER_DIR, name) for name in TOKENIZER_FILES])
        if written.name != CONFIG_FILE:
            logger.info(f"{os.path.join(dump, CONFIG_FILE)} is this run's job.config_file and is kept as written; the "
                        f"resolved configuration (command-line overrides included) is in {written}")

    def release(self) -> None:
        for lock in reversed(self._locks):
            lock.release()
        self._locks = []
