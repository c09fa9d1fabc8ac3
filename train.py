"""Train a Qwen3-style LLM with a swappable attention block, through torchtitan 0.2.2's trainer.

    python train.py                                   # the embedded default (CPU, no download)
    python train.py --list-attention                  # registered mechanisms
    torchrun --nproc_per_node=N train.py --job.config_file configs/X.toml [--section.key value ...]

Config precedence: command line > TOML > defaults (torchtitan's ``JobConfig`` merged with ``config.py``, which
parses and validates it). What this subclass adds to torchtitan's ``Trainer``: CPU support (device shim + gloo),
``training.stop_after_step`` (simulated preemption), ``<dump_folder>/config.toml`` and ``tokenizer/`` (the run
describes itself to the tools), perplexity, per-group lr/wd, progress and ETA in every log line and in
``<dump_folder>/metrics.jsonl``, RNG state in checkpoints, and the safety rules of ``docs/failures.md``: locks
on the run folder and the checkpoint folder, a writable checkpoint folder and enough free disk checked at start, a
stop on non-finite losses that never writes or rotates away a finite checkpoint, resume checks (architecture,
finite tensors, schedule, the step a step folder holds, the run's tokenizer), rotation and resume that consider
exact ``step-N`` folders only, a checkpoint and a clean exit on SIGTERM/SIGUSR1, and clear errors for unusable
checkpoints or a full disk.
"""

from __future__ import annotations

import errno
import filecmp
import json
import math
import os
import shutil
import signal
import socket
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer

import attention
import config as project_config
from config import DEFAULT_CONFIG, parse_config
from data.loader import tokenizer_path
from models import register_train_spec
from models.args import ModelArgs
from models.cpu import install_cpu_shim
from optim.muon import local_shard
from models.metrics import group_hparams
from models.run_folder import step_of

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Signals that end a run after the current step with a checkpoint (schedulers send SIGTERM before killing a job,
Slurm's ``--signal=USR1@<seconds>`` sends SIGUSR1 ahead of the time limit); the process then exits with status
128 + the signal number (143, 138), so a wrapper sees an interrupted run, not a finished one."""
NO_BAD_STEP = 2**62
"""Sentinel of the non-finite guard's device-side "first bad step" (no non-finite value seen)."""
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weight; nothing was saved after it."""


class RunLock:
    """``<dump_folder>/.attnlab.lock`` holding "host pid": one live run per dump folder (``key`` names the config
    key of ``folder`` in the message; ``path``, when given, is the lock file instead).

    Taken by global rank 0 only (other ranks of the same job never touch it), before anything is built, and
    released in ``Trainer.close``. A lock whose process is gone (same host, pid not alive) is stale and is taken
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


def lock_checkpoint_folder(folder: str, dump_folder: str) -> RunLock | None:
    """Lock checkpoint folder ``folder`` unless it is the dump folder itself (whose lock covers it): two runs with
    different dump folders and one checkpoint folder would otherwise overwrite each other's steps."""
    if os.path.realpath(folder) == os.path.realpath(dump_folder):
        return None
    return RunLock(folder, "checkpoint.folder", checkpoint_lock_path(folder))


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


def step_folders(folder: str) -> dict[int, str]:
    """{N: path} of the folders in ``folder`` named exactly ``step-N`` (:func:`models.run_folder.step_of`): only
    they are resumed from and rotated by ``keep_latest_k``."""
    if not os.path.isdir(folder):
        return {}
    paths = (os.path.join(folder, name) for name in os.listdir(folder))
    return {n: p for p in paths if (n := step_of(p)) is not None and os.path.isdir(p)}


def checkpoint_steps(folder: str) -> list[int]:
    """The steps of ``folder``'s complete checkpoints: exact ``step-N`` folders with DCP's ``.metadata`` (written
    last) or a Hugging Face index (``checkpoint.last_save_in_hf``), sorted."""
    return sorted(s for s, path in step_folders(folder).items()
                  if any(os.path.isfile(os.path.join(path, f)) for f in (".metadata", "model.safetensors.index.json")))


def check_run_tokenizer(dump_folder: str, ck_folder: str, tok: str) -> None:
    """A run folder whose checkpoints were trained with ``<dump_folder>/tokenizer`` continues with that tokenizer:
    another one of the same vocabulary size would resume silently with other token ids (the loss jumps)."""
    from models.run_folder import TOKENIZER_DIR

    stored = os.path.join(dump_folder, TOKENIZER_DIR, "tokenizer.json")
    new = os.path.join(tok, "tokenizer.json")
    if not (checkpoint_steps(ck_folder) and os.path.isfile(stored) and os.path.isfile(new)):
        return
    if not filecmp.cmp(stored, new, shallow=False):
        raise ValueError(f"model.hf_assets_path={tok!r}: its tokenizer.json differs from {stored}, the tokenizer the "
                         f"checkpoints in {ck_folder!r} were trained with; resume with --model.hf_assets_path "
                         f"{os.path.dirname(stored)}, or train the new tokenizer in another job.dump_folder")


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


def nonfinite_names(named: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors (local shards) holding a NaN or an infinity (one host sync)."""
    named = {k: local_shard(t) for k, t in named.items() if torch.is_tensor(t) and t.is_floating_point() and t.numel()}
    if not named:
        return []
    flags = [torch.isfinite(t).all() for t in named.values()]
    ok = torch.stack([f.to(flags[0].device) for f in flags])
    return [k for k, good in zip(named, ok.cpu().tolist()) if not good]


RUNTIME_FIELDS = ("max_seq_len", "attn_impl")
"""Architecture-record fields (dotted paths into ``models.hf.args_to_dict``) a resume may change: they choose
kernels and table sizes, not the weights' meaning."""

INIT_ONLY_FIELDS = ModelArgs.INIT_ONLY + tuple(f"attention_options.{name}.{option}"
                                               for name, mech in attention.REGISTRY.items()
                                               for option in getattr(mech.options, "INIT_ONLY", ()))
"""Architecture-record fields a resume may change because they only set initial weights: ``ModelArgs.INIT_ONLY``
(the depth-scaled init std) and each registered mechanism's options dataclass's ``INIT_ONLY`` (Parallax: W_R, ρ's
RMSNorm gain, the ρ gate's bias; FoX: the forget gate's bias).
A resume loads those weights from the checkpoint, so their initialisation is never used, and a run started under
one default of these options resumes under another."""


def architecture_changes(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """{dotted field: (old, new)} where the architecture records ``old`` (the checkpoint's ``attnlab.json``) and
    ``new`` (the model built) differ, nested dicts compared key by key. Only keys present in both count: a
    checkpoint recorded before an option existed resumes with that option's default. :data:`RUNTIME_FIELDS` and
    :data:`INIT_ONLY_FIELDS` never count."""
    out = {}
    for k, v in old.items():
        path = prefix + k
        if path in RUNTIME_FIELDS or path in INIT_ONLY_FIELDS or k not in new:
            continue
        if isinstance(v, dict) and isinstance(new[k], dict):
            out.update(architecture_changes(v, new[k], path + "."))
        elif v != new[k]:
            out[path] = (v, new[k])
    return out


class AttnTrainer(Trainer):
    """torchtitan's Trainer plus RNG state, the run lock, resume checks, checkpoint save guards and the
    non-finite guard.

    Non-finite guard (``training.nonfinite_skips``): every micro-batch's loss is checked on the device
    (``isfinite``, no host sync) into the first step that went bad; that tensor is read only where torchtitan
    already synchronises (log steps, which also check the logged global loss and gradient norm) and before every
    checkpoint save, which additionally checks every weight. A non-finite step therefore stops the run at the
    next log step or save at the latest, before anything non-finite is written, so the newest checkpoint is
    always finite and ``keep_latest_k`` rotation never removes the last good one. A NaN gradient turns the
    weights NaN and the next loss NaN, so the loss check sees it one step later (the log-step and pre-save
    checks see it directly). With ``nonfinite_skips = N > 0`` the decision is needed before each optimizer step:
    loss and gradients are checked and all-reduced every step (one host sync per step), a bad step is skipped
    (no update; the schedule and data move on) and the N+1-th stops the run.
    """

    def __init__(self, job_config):
        """``job_config`` has passed :func:`preflight` (``main`` runs it before anything starts)."""
        install_cpu_shim()
        register_train_spec()
        rank0 = int(os.environ.get("RANK", "0")) == 0
        self._lock = RunLock(job_config.job.dump_folder) if rank0 else None
        self._ck_lock = None
        self._signal_received = self.stop_signal = 0
        self._old_handlers = {s: signal.signal(s, self._on_stop_signal) for s in STOP_SIGNALS}
        try:
            ck = job_config.checkpoint
            ck_folder = os.path.join(job_config.job.dump_folder, ck.folder)
            if ck.enable and not ck.load_only:
                check_writable(ck_folder, "checkpoint.folder")
                if rank0:
                    self._ck_lock = lock_checkpoint_folder(ck_folder, job_config.job.dump_folder)
            check_run_tokenizer(job_config.job.dump_folder, ck_folder, tokenizer_path(job_config))
            super().__init__(job_config)
            self._bad_step = torch.tensor(NO_BAD_STEP, device=self.device)
            self._step_bad = torch.zeros((), dtype=torch.bool, device=self.device)
            self._skips, self._skipped_step = 0, -1
            self._partial_load = False
            self._saved_step = 0  # the newest step this run saved or loaded
            # the stop-signal flag is agreed over gloo: a CPU all-reduce, no device sync per step
            world = dist.get_world_size() if dist.is_initialized() else 1
            self._flag_group = dist.new_group(backend="gloo") if world > 1 else None
            self._wrap_optimizer_step()
            self._wrap_metrics_log()
            self._wrap_checkpointer()
            if ck.enable and not ck.load_only:
                check_free_space(self.checkpointer.folder, self._checkpoint_bytes(), ck.keep_latest_k)
        except BaseException:
            self._release_lock()
            raise

    def _release_lock(self) -> None:
        for name in ("_ck_lock", "_lock"):
            if getattr(self, name, None) is not None:
                getattr(self, name).release()
                setattr(self, name, None)
        for sig, handler in getattr(self, "_old_handlers", {}).items():
            signal.signal(sig, handler)
        self._old_handlers = {}

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._release_lock()

    # ------------------------------------------------------------------------------------------- preemption

    def _on_stop_signal(self, signum: int, frame) -> None:
        """Note the signal; the loop stops after the current step (:meth:`should_continue_training`). Repeats are
        noted too: under Slurm a worker gets SIGTERM from slurmstepd and again from its torchrun agent."""
        self._signal_received = signum

    def _agreed_stop_signal(self) -> int:
        """The stop signal any rank received (0: none), the same on every rank, so all stop after one step."""
        if self._flag_group is None:
            return self._signal_received
        flag = torch.tensor(self._signal_received, dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._flag_group)
        return int(flag)

    def _save_current_step(self) -> bool:
        """A full (resumable) checkpoint of this step unless this run already saved or loaded it ("last_step"
        saves would be model-only by default); False when this run writes no checkpoints."""
        cp = self.checkpointer
        if not cp.enable or cp.load_only:
            return False
        if self._saved_step < self.step:
            cp.interval = self.step
            cp.save(self.step)
        return True

    # ------------------------------------------------------------------------------------- non-finite guard

    def _world_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=op)
        return t

    def forward_backward_step(self, *args, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(*args, **kwargs)
        self._step_bad = self._step_bad | ~torch.isfinite(loss.detach())  # on the device: no sync
        return loss

    def _wrap_optimizer_step(self) -> None:
        step_fn = self.optimizers.step

        def guarded_step(*args, **kwargs):
            # the lr/wd this step uses, for the log line (the scheduler moves on before torchtitan logs)
            self.metrics_processor.hparams = group_hparams(self.optimizers)
            bad, self._step_bad = self._step_bad, torch.zeros((), dtype=torch.bool, device=self.device)
            if self.job_config.training.nonfinite_skips == 0:
                # python scalars enter kernels as arguments: no host-to-device copy, no sync
                self._bad_step = torch.where(bad, self._bad_step.clamp(max=self.step), self._bad_step)
                return step_fn(*args, **kwargs)
            grads = [local_shard(p.grad) for m in self.model_parts for p in m.parameters() if p.grad is not None]
            if grads:
                bad = bad | ~torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())
            if not self._world_reduce(bad.to(torch.int32), dist.ReduceOp.MAX).item():
                return step_fn(*args, **kwargs)
            self._skips += 1
            self._skipped_step = self.step
            limit = self.job_config.training.nonfinite_skips
            if self._skips > limit:
                raise NonFiniteError(f"step {self.step}: non-finite loss or gradients, the {self._skips}-th such step "
                                     f"(training.nonfinite_skips = {limit}); training stopped. "
                                     f"{self._last_checkpoint_hint()}")
            logger.warning(f"step {self.step}: non-finite loss or gradients; optimizer step skipped "
                           f"({self._skips}/{limit} allowed by training.nonfinite_skips)")
            return None

        self.optimizers.step = guarded_step

    def _last_checkpoint_hint(self) -> str:
        step = self.checkpointer._find_load_step() if self.checkpointer.enable else -1
        where = (f"The newest checkpoint, {os.path.join(self.checkpointer.folder, f'step-{step}')}, is finite and "
                 "kept" if step >= 0 else "No checkpoint was written")
        return (f"{where}; lower optimizer.lr or training.max_norm and resume, or allow skipped steps with "
                "training.nonfinite_skips")

    def check_finite(self, step: int, loss: float | None = None, grad_norm: float | None = None) -> None:
        """Raise :class:`NonFiniteError` when any rank saw a non-finite loss since the start, or when the
        (global) ``loss`` / ``grad_norm`` given are non-finite. Synchronises the device flag (log steps,
        checkpoint saves and the end of training only)."""
        first = int(self._world_reduce(self._bad_step.clone(), dist.ReduceOp.MIN).item())
        values = {"loss": loss, "grad norm": grad_norm}
        bad_now = {k: v for k, v in values.items() if v is not None and not math.isfinite(v)}
        if self._skipped_step == step:
            bad_now = {}
        if first == NO_BAD_STEP and not bad_now:
            return
        first_txt = f"first at step {first}" if first != NO_BAD_STEP else f"at step {step}"
        now = ", ".join(f"{k} {v}" for k, v in bad_now.items())
        raise NonFiniteError(f"non-finite training loss or gradient norm ({first_txt}{'; ' + now if now else ''}); "
                             f"training stopped at step {step} without saving. {self._last_checkpoint_hint()}")

    def _wrap_metrics_log(self) -> None:
        log = self.metrics_processor.log

        def checked_log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
            self.check_finite(step, global_avg_loss, grad_norm)

        self.metrics_processor.log = checked_log

    def _nonfinite_state(self) -> list[str]:
        """Non-finite weights and optimizer-state tensors of this rank; [""] when only another rank has some."""
        named = {k: v for m in self.model_parts for k, v in m.state_dict().items()}
        names = {id(p): n for m in self.model_parts for n, p in m.named_parameters()}
        for i, opt in enumerate(getattr(self.optimizers, "optimizers", [])):
            for p, st in opt.state.items():
                named.update({f"optimizer{i}.{names.get(id(p), '?')}.{k}": v for k, v in st.items()
                              if torch.is_tensor(v) and v.dim() > 0})
        bad = nonfinite_names(named)
        flag = self._world_reduce(torch.tensor(int(bool(bad)), device=self.device), dist.ReduceOp.MAX)
        return bad or ([""] if flag.item() else [])

    @staticmethod
    def _names(bad: list[str]) -> str:
        return "tensors of another rank" if bad == [""] else f"{bad[:5]}{' …' if len(bad) > 5 else ''}"

    # ------------------------------------------------------------------------------------------ checkpoints

    def _checkpoint_bytes(self) -> int:
        """Estimated size of one full checkpoint: the parameters (global sizes) plus two optimizer moments."""
        n = sum(p.numel() * p.element_size() for m in self.model_parts for p in m.parameters())
        return 3 * n

    def _wrap_checkpointer(self) -> None:
        cp = self.checkpointer
        load, save, dcp_load = cp.load, cp.save, cp.dcp_load

        def find_load_step(folder: str = "") -> int:
            return max(checkpoint_steps(folder or cp.folder), default=-1)

        def purge_stale_checkpoints() -> None:
            # torchtitan's rotation (on rank 0, by its purge thread), over exact step-N folders only
            if cp.keep_latest_k > 0 and (not dist.is_initialized() or dist.get_rank() == 0):
                for step in sorted(step_folders(cp.folder))[:-cp.keep_latest_k]:
                    cp.purge_queue.put(cp._create_checkpoint_id(step))

        def checked_load(step: int = -1) -> bool:
            # torchtitan ignores load_step only while the folder is absent and an initial_load_path is loaded
            if cp.enable and step != -1 and (os.path.isdir(cp.folder) or not cp.initial_load_path) \
                    and not os.path.isdir(cp._create_checkpoint_id(step)):
                raise FileNotFoundError(f"checkpoint.load_step={step}: {cp._create_checkpoint_id(step)} does not "
                                        f"exist; the checkpoints in {cp.folder!r} are of steps "
                                        f"{checkpoint_steps(cp.folder)}. Pick one of them, or -1 for the latest.")
            path, model_only = self._load_path(step)
            if path is not None:
                if not model_only:
                    self._check_stored_step(path)
                self._check_architecture(path, model_only)
                if not model_only:
                    self._prepare_dataloader_reshard(path)
            try:
                loaded = load(step=step)
            except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
                lines = [ln for ln in str(e).splitlines() if ln.strip()]
                raise RuntimeError(
                    f"checkpoint {path or cp.folder!r} cannot be loaded into this run: {type(e).__name__}: "
                    f"{lines[-1] if lines else ''}. It is corrupt or was written by a different model/optimizer "
                    "config; point checkpoint.folder/job.dump_folder elsewhere or remove it.") from e
            if loaded:
                self._saved_step = self.step
                bad = self._nonfinite_state()
                if bad:
                    raise NonFiniteError(f"checkpoint {path or cp.folder!r} (step {self.step}) is corrupt: non-finite "
                                         f"values in {self._names(bad)}. Remove that step folder to resume from an "
                                         "earlier one, or pick one with checkpoint.load_step.")
                if path is not None and not model_only:
                    self._check_schedule(path)
                    # the optimizer's state restores each group's lr after the schedule set it: set it again, so the
                    # first resumed step runs at this run's schedule (what the jump warning and the log say)
                    self.lr_schedulers.load_state_dict(self.lr_schedulers.state_dict())
            if not dist.is_initialized() or dist.get_rank() == 0:
                self._write_run_files()
            self.metrics_processor.start(self.step)
            return loaded

        def partial_dcp_load(state_dict, checkpoint_id, from_hf, from_quantized):
            if not (self._partial_load and not from_hf):
                return dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import DefaultLoadPlanner

            dcp.load(state_dict, checkpoint_id=checkpoint_id, planner=DefaultLoadPlanner(allow_partial_load=True))
            if "model" in cp.states:
                cp.states["model"].load_state_dict(state_dict)

        def checked_save(curr_step: int, last_step: bool = False) -> None:
            if not cp._should_save(curr_step, last_step):
                return save(curr_step, last_step)
            self.check_finite(curr_step)
            bad = self._nonfinite_state()
            if bad:
                raise NonFiniteError(f"step {curr_step}: non-finite values in {self._names(bad)}; no checkpoint "
                                     f"written. {self._last_checkpoint_hint()}")
            path = cp._create_checkpoint_id(curr_step)
            try:
                save(curr_step, last_step)
            except (Exception, CheckpointException) as e:
                raise self._save_error(e, path) from e
            self._saved_step = curr_step
            if cp.keep_latest_k > 0 and last_step:
                cp._purge_stale_checkpoints()  # torchtitan skips rotation after the last step's save
            if not dist.is_initialized() or dist.get_rank() == 0:
                self._write_sidecars(path)

        cp.load, cp.save, cp.dcp_load = checked_load, checked_save, partial_dcp_load
        if cp.enable:
            cp._find_load_step, cp._purge_stale_checkpoints = find_load_step, purge_stale_checkpoints

    def _check_stored_step(self, path: str) -> None:
        """A ``step-N`` folder must hold step N (``train_state.step`` inside it): one copied in from another run
        under a newer name would be resumed at its own step, retrain, and overwrite this run's newer steps."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner

        name = step_of(path)
        if name is None:  # checkpoint.initial_load_path: any name
            return
        stored = {"train_state.step": -1}
        try:
            with warnings.catch_warnings():  # this rank alone reads one pickled integer; DCP warns of no_dist
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(stored, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True),
                         no_dist=True)
        except (Exception, CheckpointException):  # unreadable: the load itself reports it
            return
        step = stored["train_state.step"]
        if step not in (-1, name):
            raise ValueError(f"checkpoint {path!r} holds step {step}, not step {name}: it was copied in or renamed "
                             f"from another run. Move it out of {os.path.dirname(path)!r} (or name it step-{step} "
                             "if it belongs to this run) and start again; nothing was loaded or changed.")

    def _write_run_files(self) -> None:
        """``<dump_folder>/config.toml`` and ``tokenizer/`` (``models.run_folder.write_run_files``), so tools
        rebuild this run without its flags. Written after the checkpoint load passed the architecture checks: a
        resume with a different architecture fails before the file is touched, so config.toml always describes
        the model the run folder's newest checkpoints hold (with ``checkpoint.partial_load`` on purpose: the new
        model). The ``tokenizer/`` of a run folder with checkpoints is never replaced (:func:`check_run_tokenizer`
        made sure it is the one in use); a ``config.toml`` that is this run's ``job.config_file`` is kept."""
        from models.run_folder import CONFIG_FILE, TOKENIZER_DIR, write_run_files

        cfg = self.job_config
        dump = cfg.job.dump_folder
        keep_tokenizer = os.path.isfile(os.path.join(dump, TOKENIZER_DIR, "tokenizer.json")) and checkpoint_steps(
            os.path.join(dump, cfg.checkpoint.folder))
        written = write_run_files(dump, cfg, None if keep_tokenizer else tokenizer_path(cfg))
        if written.name != CONFIG_FILE:
            logger.info(f"{os.path.join(dump, CONFIG_FILE)} is this run's job.config_file and is kept as written; the "
                        f"resolved configuration (command-line overrides included) is in {written}")

    def _save_error(self, e: BaseException, path: str) -> Exception:
        """A save failure; a full disk (or quota / file-size limit) is named as such."""
        text, cause, disk = str(e), e, False
        while cause is not None:
            disk |= isinstance(cause, OSError) and cause.errno in _DISK_ERRNOS
            cause = cause.__cause__ or cause.__context__
        disk |= any(s in text for s in ("No space left", "Disk quota", "File too large", "unexpected pos"))
        free = shutil.disk_usage(self.checkpointer.folder).free / 2**30
        if disk:
            rank0 = not dist.is_initialized() or dist.get_rank() == 0
            if rank0 and not os.path.isfile(os.path.join(path, ".metadata")):
                shutil.rmtree(path, ignore_errors=True)  # DCP writes .metadata last: without it, never loadable
            return OSError(errno.ENOSPC, f"the disk is full (or a quota / file-size limit was hit) while saving "
                                         f"{path}: {free:.2f} GiB free, one checkpoint needs about "
                                         f"{self._checkpoint_bytes() / 2**30:.2f} GiB. The incomplete folder was "
                                         "removed; earlier checkpoints are intact. Free space and resume.")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return RuntimeError(f"saving {path} failed: {type(e).__name__}: {lines[-1] if lines else ''}")

    def _write_sidecars(self, path: str) -> None:
        """Next to each DCP step folder's shards: ``attnlab.json`` (the architecture, as ``models.hf`` writes it,
        so offline tools and the converter rebuild the exact model, mask type included) and
        ``schedule.json`` (training.steps and the next step's lr per group, for the resume check)."""
        from models.hf import SIDECAR, args_to_dict

        if not os.path.isdir(path):
            return
        with open(os.path.join(path, SIDECAR), "w") as f:
            json.dump(args_to_dict(self.model_args), f, indent=2)
        with open(os.path.join(path, "schedule.json"), "w") as f:
            json.dump({"training_steps": self.job_config.training.steps, "lr": self._group_lrs()}, f)

    def _group_lrs(self) -> list[float]:
        """The schedule's lr of every parameter group for the next step (from the scheduler's own lambdas, not
        the optimizer's param groups, which a checkpoint load may overwrite with the saved values)."""
        return [base * fn(s.last_epoch) for s in self.lr_schedulers.schedulers
                for base, fn in zip(s.base_lrs, getattr(s, "lr_lambdas", [lambda _: 1.0] * len(s.base_lrs)))]

    def _check_schedule(self, path: str) -> None:
        """Warn when the resumed run's schedule gives a different lr at this step than the run that wrote the
        checkpoint (typically ``training.steps`` raised after a finished run: the decayed lr jumps back)."""
        rec = os.path.join(path, "schedule.json")
        if not os.path.isfile(rec):
            return
        with open(rec) as f:
            old = json.load(f)
        new = self._group_lrs()
        if len(old["lr"]) != len(new):
            return
        worst = max(abs(a - b) / max(abs(a), abs(b), 1e-30) for a, b in zip(old["lr"], new))
        if worst > 1e-6:
            logger.warning(
                f"Resuming at step {self.step} with a different learning-rate schedule: the checkpoint's run "
                f"(training.steps = {old['training_steps']}) continued with lr {old['lr'][0]:.3e}, this run "
                f"(training.steps = {self.job_config.training.steps}) uses {new[0]:.3e} from here. The schedule is "
                "recomputed from the current config; keep training.steps and the [lr_scheduler] section as they "
                "were to continue it, or accept the lr jump.")

    def _load_path(self, step: int) -> tuple[str | None, bool]:
        """(DCP folder about to be loaded, model only?) mirroring torchtitan's ``CheckpointManager.load``;
        None for HF loads or when nothing will be loaded."""
        cp = self.checkpointer
        if not cp.enable:
            return None, False
        if not os.path.exists(cp.folder):
            if cp.initial_load_path and not cp.initial_load_in_hf and os.path.isdir(cp.initial_load_path):
                return cp.initial_load_path, cp.initial_load_model_only
            return None, False
        step = cp._find_load_step() if step == -1 else step
        path = cp._create_checkpoint_id(step)
        if step < 0 or not os.path.isfile(os.path.join(path, ".metadata")):
            return None, False
        return path, step == 0

    def _check_architecture(self, path: str, model_only: bool) -> None:
        """The checkpoint's model keys must be the built model's: DCP loads only the keys asked for, so extra
        checkpoint keys (a Parallax run resumed as softmax) would be dropped silently. With
        ``checkpoint.partial_load`` the difference is logged and the load keeps what is there."""
        from torch.distributed.checkpoint import FileSystemReader

        try:
            keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
        except Exception:  # unreadable metadata: the load itself reports it
            return
        others = tuple(f"{k}." for k in self.checkpointer.states if k != "model")
        ckpt = {k for k in keys if not k.startswith(others)}
        model = set(self.checkpointer.states["model"].state_dict())
        missing, unexpected = sorted(model - ckpt), sorted(ckpt - model)
        changed = {} if model_only else self._changed_architecture(path)
        if not (missing or unexpected or changed):
            return
        parts = [f"missing from the checkpoint {missing[:6]}{' …' if len(missing) > 6 else ''} ({len(missing)}), "
                 f"not in the model {unexpected[:6]}{' …' if len(unexpected) > 6 else ''} ({len(unexpected)})"
                 ] if missing or unexpected else []
        parts += [f"architecture fields changed (checkpoint's, this run's): {changed}"] if changed else []
        what = f"checkpoint {path!r} does not match the model built from this config: {'; '.join(parts)}"
        if not self.job_config.checkpoint.partial_load:
            raise ValueError(f"{what}. It was written by a different architecture (model.attention, layer_pattern, "
                             "[attention.<mechanism>] options, flavor); resume with the same model config, or set "
                             "checkpoint.partial_load = true to load the common keys on purpose.")
        logger.warning(f"{what}; checkpoint.partial_load = true: loading the common keys, missing ones keep their "
                       "initialisation")
        self._partial_load = True

    def _changed_architecture(self, path: str) -> dict[str, tuple]:
        """{field: (checkpoint's, this run's)} of the architecture record ``attnlab.json`` next to the
        checkpoint that differ from the model built (:func:`architecture_changes`); on a resume, same keys with
        other values (``attn_mask_type``, mechanism options such as ``window_size``) would otherwise continue
        silently as a different model. Not checked for model-only initial loads: a new run may start from weights
        with another mask or options on purpose (an imported HF model trained with packed documents)."""
        from models.hf import SIDECAR, args_to_dict

        rec = os.path.join(path, SIDECAR)
        if not os.path.isfile(rec):
            return {}
        with open(rec) as f:
            old = json.load(f)
        new = json.loads(json.dumps(args_to_dict(self.model_args)))  # tuples as JSON lists, like the record
        return architecture_changes(old, new)

    def _prepare_dataloader_reshard(self, path: str) -> None:
        """Tell the data loader how many data-parallel ranks wrote the checkpoint about to be loaded (read from
        the DCP metadata), so that a different world size reshards its position (see data.loader)."""
        dl = getattr(self, "dataloader", None)
        if dl is None or not hasattr(dl, "resume_world_size"):
            return
        from torch.distributed.checkpoint import FileSystemReader

        try:
            keys = FileSystemReader(path).read_metadata().state_dict_metadata
        except Exception:  # unreadable metadata: the load itself reports it
            return
        ranks = [k for k in keys if k.startswith("dataloader.dp_rank_")]
        dl.resume_world_size, dl.checkpoint_path = (len(ranks) or None), path
        if ranks:
            dl.check_reshardable(len(ranks))  # before DCP, so the message is not buried in a load error

    # ------------------------------------------------------------------------------------------------ loop

    def should_continue_training(self) -> bool:
        stop = self.job_config.training.stop_after_step
        if not super().should_continue_training() or 0 < stop <= self.step:
            return False
        self.stop_signal = self._agreed_stop_signal()
        return not self.stop_signal

    def train(self):
        super().train()
        self.check_finite(self.step)  # a run without a log step or save since the last check ends loudly too
        if not (0 < self.job_config.training.stop_after_step == self.step or self.stop_signal):
            return
        saved = self._save_current_step()
        if self.stop_signal:
            what = (f"saved step {self.step}" if saved and self.step else
                    "no step trained, nothing saved" if saved else f"checkpointing is off, step {self.step} not saved")
            logger.warning(f"received {signal.Signals(self.stop_signal).name}: {what}, exiting")

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["rng_cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "rng_cpu" in state_dict:
            torch.set_rng_state(state_dict["rng_cpu"])
        if "rng_cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["rng_cuda"])


def _single_process_env() -> None:
    """``python train.py`` without torchrun: a world of one process."""
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def preflight(job_config) -> None:
    """The checks a configuration passes before torchtitan starts (which initialises the process group and writes
    ``comm_traces/``), each a ValueError naming the key: the keys' types and ranges (``config.validate_config``), the
    lr schedule, and the model built once on the meta device (no memory, no files): a mechanism's options, its
    ``[attention] impl`` and the sizes."""
    from models.checkpoint_io import model_args_from_config
    from models.model import Transformer
    from optim.schedules import build_schedule

    project_config.validate_config(job_config)
    build_schedule(job_config.lr_scheduler, job_config.training.steps)
    with torch.device("meta"):
        Transformer(model_args_from_config(job_config))
    if job_config.attention.impl == "fla":  # the other paths run anywhere, or pick one that does ("auto")
        from attention.ops.common import fla_importable

        ok, why = fla_importable() if torch.cuda.is_available() else (False, "no CUDA device")
        if not ok:
            raise ValueError(f"attention.impl='fla': fla-core cannot run here ({why}); use 'auto', which picks the "
                             "fastest path that runs on this machine")


def run(cfg) -> AttnTrainer:
    """Build and train the parsed configuration ``cfg``, which has passed :func:`preflight`; returns the (closed)
    trainer."""
    trainer = AttnTrainer(cfg)
    try:
        if cfg.checkpoint.create_seed_checkpoint:  # torchtitan's way to share one init across parallelisms
            if int(os.environ["WORLD_SIZE"]) != 1 or not cfg.checkpoint.enable:
                raise ValueError("checkpoint.create_seed_checkpoint needs one process and checkpoint.enable = true")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    finally:
        trainer.close()
    return trainer


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--list-attention" in argv:
        print(attention.describe())
        return
    if not any(a.split("=")[0] in ("--job.config_file", "--job.config-file") for a in argv):
        argv = ["--job.config_file", DEFAULT_CONFIG, *argv]
    _single_process_env()
    init_logger()
    try:
        cfg = parse_config(argv)
        preflight(cfg)
    except ValueError as e:  # bad configuration: one line naming the key, nothing built or written
        sys.exit(f"train.py: error: {e}")
    trainer = run(cfg)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if trainer.stop_signal:
        sys.exit(128 + trainer.stop_signal)  # the shell's status of a process ended by that signal (STOP_SIGNALS)


if __name__ == "__main__":
    main()
