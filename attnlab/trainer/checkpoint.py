"""What the trainer checks and writes around every checkpoint load and save (docs/failures.md), running inside
torchtitan's ``CheckpointManager`` (:func:`trainer.titan.hook_checkpointer`).

Load: every pickle in the step folder read with an allow-list first (:func:`checkpoint.dcp.check_pickles`); an
existing ``checkpoint.load_step``; a step folder that holds the step its name says; the checkpoint's keys
and architecture record (``attnlab.json``) against the model built (``checkpoint.partial_load`` loads the common
keys on purpose); the data loader told how many ranks wrote the checkpoint (resharding); finite weights and
optimizer state once loaded; the resumed schedule against the checkpoint's (``schedule.json``), each group's lr
set by this run's schedule.
Save: finite losses, weights and optimizer state before anything is written; a full disk named as such (the
incomplete folder removed); ``attnlab.json`` and ``schedule.json`` beside the shards; rotation
(``checkpoint.keep_latest_k``) over exact ``step-N`` folders holding a DCP checkpoint only
(:func:`checkpoint.layout.step_folders`), after the last step's save too.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.tools.logging import logger

from attnlab.models.args import ModelArgs
from attnlab.checkpoint.dcp import NON_MODEL_PREFIXES, SIDECAR, args_to_dict, check_pickles, record_changes
from attnlab.checkpoint.layout import is_dcp_folder, step_folders, step_of
from attnlab.trainer.titan import hook_checkpointer, purge, saves_at, step_path

_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}

def checkpoint_bytes(model_parts) -> int:
    """Estimated size of one full checkpoint: the parameters (global sizes) plus two optimizer moments."""
    return 3 * sum(p.numel() * p.element_size() for m in model_parts for p in m.parameters())


def planned_load(ck, folder: str, step: int = -1) -> tuple[str | None, bool]:
    """(DCP folder torchtitan's ``CheckpointManager.load`` will read, model only?) for the ``[checkpoint]`` section
    ``ck``, the run's checkpoint folder ``folder`` and ``step`` (-1: the newest), mirroring its rules: the newest
    (or ``step``) exact ``step-N`` DCP folder while ``folder`` exists, else ``checkpoint.initial_load_path``
    (model only unless ``initial_load_model_only`` is off). (None, False) for Hugging Face loads and when nothing
    will be loaded."""
    if not ck.enable:
        return None, False
    if not os.path.exists(folder):
        if ck.initial_load_path and not ck.initial_load_in_hf and os.path.isdir(ck.initial_load_path):
            return ck.initial_load_path, ck.initial_load_model_only
        return None, False
    step = max(step_folders(folder, dcp_only=True), default=-1) if step == -1 else step
    path = os.path.join(folder, f"step-{step}")
    if step < 0 or not is_dcp_folder(path):
        return None, False
    return path, step == 0


def architecture_mismatch(path: str, meta, model_keys, args: ModelArgs, model_only: bool) -> str | None:
    """Why the DCP checkpoint ``path`` (its restricted-read metadata ``meta``, :func:`checkpoint.dcp.check_pickles`)
    does not fit the model of ``args`` with state-dict keys ``model_keys``, or None when it fits: keys on either side
    only (DCP loads only the keys asked for, so extra checkpoint keys, a Parallax run resumed as softmax, would be
    dropped silently), and, unless ``model_only``, the fields of the step's ``attnlab.json`` that differ
    (:func:`checkpoint.dcp.record_changes`; a resume with another mask or mechanism option would otherwise
    continue silently as a different model). Model-only initial loads may start from weights with another mask or
    options on purpose (an imported HF model trained with packed documents)."""
    ckpt = {k for k in meta.state_dict_metadata if not k.startswith(NON_MODEL_PREFIXES)}
    model = set(model_keys)
    missing, unexpected = sorted(model - ckpt), sorted(ckpt - model)
    changed = {} if model_only else record_changes(path, args)
    if not (missing or unexpected or changed):
        return None
    parts = [f"missing from the checkpoint {missing[:6]}{' …' if len(missing) > 6 else ''} ({len(missing)}), "
             f"not in the model {unexpected[:6]}{' …' if len(unexpected) > 6 else ''} ({len(unexpected)})"
             ] if missing or unexpected else []
    parts += [f"architecture fields changed (checkpoint's, this run's): {changed}"] if changed else []
    return f"checkpoint {path!r} does not match the model built from this config: {'; '.join(parts)}"


PARTIAL_LOAD_HINT = ("It was written by a different architecture (model.attention, layer_pattern, "
                     "[attention.<mechanism>] options, flavor); resume with the same model config, or set "
                     "checkpoint.partial_load = true to load the common keys on purpose.")


def with_rng_state(state: dict) -> dict:
    """The trainer's checkpoint state plus the CPU (and CUDA) random generators' states, so a resumed run draws
    the numbers the uninterrupted one would have."""
    state["rng_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    """Set the random generators from a state :func:`with_rng_state` wrote (older checkpoints have none)."""
    if "rng_cpu" in state:
        torch.set_rng_state(state["rng_cpu"])
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng_cuda"])


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _last_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


class CheckpointGuard:
    """The checks and files of the module docstring around ``trainer.checkpointer``'s loads and saves.

    ``nonfinite``: the run's :class:`trainer.nonfinite.NonFiniteGuard`, asked before every save and after every
    load. ``after_load``: called once the checkpoint load (or the decision that there is none) passed every check.
    ``saved_step``: the newest step this run saved or loaded; :meth:`save_now` saves the current step unless it is
    that one."""

    def __init__(self, trainer, nonfinite, after_load: Callable[[], None]):
        self.trainer, self.nonfinite, self.after_load = trainer, nonfinite, after_load
        self.checkpointer = trainer.checkpointer
        self.saved_step = 0
        self._partial_load = False
        hook_checkpointer(self.checkpointer, self)

    def save_now(self, step: int) -> bool:
        """A full (resumable) checkpoint of ``step`` unless this run already saved or loaded it ("last_step" saves
        would be model-only by default); False when this run writes no checkpoints."""
        if not self.checkpointer.enable or self.checkpointer.load_only:
            return False
        if self.saved_step < step:
            self.checkpointer.interval = step
            self.checkpointer.save(step)
        return True

    # ------------------------------------------------------------------ in place of CheckpointManager's methods

    def newest_step(self, folder: str = "") -> int:
        return max(step_folders(folder or self.checkpointer.folder, dcp_only=True), default=-1)

    def rotate(self) -> None:
        """torchtitan's rotation (on rank 0, by its purge thread), over exact step-N folders holding a DCP checkpoint
        only (:func:`checkpoint.layout.step_folders`): a Hugging Face export or a user's copy is never deleted."""
        k = self.checkpointer.keep_latest_k
        if k > 0 and _rank0():
            for step in sorted(step_folders(self.checkpointer.folder, dcp_only=True))[:-k]:
                purge(self.checkpointer, step_path(self.checkpointer, step))

    def load(self, titan_load, step: int = -1) -> bool:
        checkpointer = self.checkpointer
        # torchtitan ignores load_step only while the folder is absent and an initial_load_path is loaded
        if checkpointer.enable and step != -1 and (os.path.isdir(checkpointer.folder)
                                                   or not checkpointer.initial_load_path) \
                and not os.path.isdir(step_path(checkpointer, step)):
            steps = sorted(step_folders(checkpointer.folder, dcp_only=True))
            raise FileNotFoundError(f"checkpoint.load_step={step}: {step_path(checkpointer, step)} does not exist; the "
                                    f"checkpoints in {checkpointer.folder!r} are of steps {steps}. "
                                    "Pick one of them, or -1 for the latest.")
        path, model_only = self._load_path(step)
        if path is not None:
            meta = check_pickles(path)  # before anything in the folder is unpickled (train.preflight did it too)
            if not model_only:
                self._check_stored_step(path)
            self._check_architecture(path, meta, model_only)
            if not model_only:
                self._prepare_dataloader_reshard(path, meta)
        try:
            loaded = titan_load(step=step)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise RuntimeError(
                f"checkpoint {path or checkpointer.folder!r} cannot be loaded into this run: {type(e).__name__}: "
                f"{_last_line(e)}. It is corrupt or was written by a different model/optimizer config; point "
                "checkpoint.folder/job.dump_folder elsewhere or remove it.") from e
        if loaded:
            self.saved_step = self.trainer.step
            self.nonfinite.check_loaded(path or checkpointer.folder, self.trainer.step)
            if path is not None and not model_only:
                self._check_schedule(path)
                # the optimizer's state restores each group's lr after the schedule set it: set it again, so the
                # first resumed step runs at this run's schedule (what the jump warning and the log say)
                self.trainer.lr_schedulers.load_state_dict(self.trainer.lr_schedulers.state_dict())
        self.after_load()
        return loaded

    def dcp_load(self, titan_dcp_load, state_dict, checkpoint_id, from_hf, from_quantized):
        if not self._partial_load or from_hf:
            return titan_dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, checkpoint_id=checkpoint_id, planner=DefaultLoadPlanner(allow_partial_load=True))
        if "model" in self.checkpointer.states:
            self.checkpointer.states["model"].load_state_dict(state_dict)

    def save(self, titan_save, curr_step: int, last_step: bool = False) -> None:
        if not saves_at(self.checkpointer, curr_step, last_step):
            return titan_save(curr_step, last_step)
        self.nonfinite.check_before_save(curr_step)
        path = step_path(self.checkpointer, curr_step)
        try:
            titan_save(curr_step, last_step)
        except (Exception, CheckpointException) as e:
            raise self._save_error(e, path) from e
        self.saved_step = curr_step
        if last_step:
            self.rotate()  # torchtitan skips rotation after the last step's save
        if _rank0():
            self._write_sidecars(path)

    # ------------------------------------------------------------------------------------------------ load checks

    def _load_path(self, step: int) -> tuple[str | None, bool]:
        """:func:`planned_load` of this run's checkpointer."""
        ck = self.trainer.job_config.checkpoint
        return planned_load(ck, self.checkpointer.folder, step) if self.checkpointer.enable else (None, False)

    def _check_stored_step(self, path: str) -> None:
        """A ``step-N`` folder must hold step N (``train_state.step`` inside it): one copied in from another run
        under a newer name would be resumed at its own step, retrain, and overwrite this run's newer steps."""
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

    def _check_architecture(self, path: str, meta, model_only: bool) -> None:
        """:func:`architecture_mismatch` against the model built (``train.preflight`` refused it before the trainer
        started); with ``checkpoint.partial_load`` the difference is logged and the load keeps what is there."""
        what = architecture_mismatch(path, meta, self.checkpointer.states["model"].state_dict(),
                                     self.trainer.model_args, model_only)
        if what is None:
            return
        if not self.trainer.job_config.checkpoint.partial_load:
            raise ValueError(f"{what}. {PARTIAL_LOAD_HINT}")
        logger.warning(f"{what}; checkpoint.partial_load = true: loading the common keys, missing ones keep their "
                       "initialisation")
        self._partial_load = True

    def _prepare_dataloader_reshard(self, path: str, meta) -> None:
        """Tell the data loader how many data-parallel ranks wrote the checkpoint about to be loaded (read from
        the DCP metadata ``meta``), so that a different world size reshards its position (see data.loader)."""
        dl = getattr(self.trainer, "dataloader", None)
        if dl is None or not hasattr(dl, "resume_world_size"):
            return
        keys = meta.state_dict_metadata
        ranks = [k for k in keys if k.startswith("dataloader.dp_rank_")]
        dl.resume_world_size, dl.checkpoint_path = (len(ranks) or None), path
        if ranks:
            dl.check_reshardable(len(ranks))  # before DCP, so the message is not buried in a load error

    def _group_lrs(self) -> list[float]:
        """The schedule's lr of every parameter group for the next step (from the scheduler's own lambdas, not
        the optimizer's param groups, which a checkpoint load may overwrite with the saved values)."""
        return [base * fn(s.last_epoch) for s in self.trainer.lr_schedulers.schedulers
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
                f"Resuming at step {self.trainer.step} with a different learning-rate schedule: the checkpoint's run "
                f"(training.steps = {old['training_steps']}) continued with lr {old['lr'][0]:.3e}, this run "
                f"(training.steps = {self.trainer.job_config.training.steps}) uses {new[0]:.3e} from here. The "
                "schedule is recomputed from the current config; keep training.steps and the [lr_scheduler] section "
                "as they were to continue it, or accept the lr jump.")

    # ------------------------------------------------------------------------------------------------------ saves

    def _write_sidecars(self, path: str) -> None:
        """Next to each DCP step folder's shards: ``attnlab.json`` (the architecture, as ``checkpoint.dcp`` writes it,
        so offline tools and the converter rebuild the exact model, mask type included) and
        ``schedule.json`` (training.steps and the next step's lr per group, for the resume check)."""
        if not os.path.isdir(path):
            return
        with open(os.path.join(path, SIDECAR), "w") as f:
            json.dump(args_to_dict(self.trainer.model_args), f, indent=2)
        with open(os.path.join(path, "schedule.json"), "w") as f:
            json.dump({"training_steps": self.trainer.job_config.training.steps, "lr": self._group_lrs()}, f)

    def _save_error(self, e: BaseException, path: str) -> Exception:
        """A save failure; a full disk (or quota / file-size limit) is named as such."""
        text, cause, disk = str(e), e, False
        while cause is not None:
            disk |= isinstance(cause, OSError) and cause.errno in _DISK_ERRNOS
            cause = cause.__cause__ or cause.__context__
        disk |= any(s in text for s in ("No space left", "Disk quota", "File too large", "unexpected pos"))
        if not disk:
            return RuntimeError(f"saving {path} failed: {type(e).__name__}: {_last_line(e)}")
        free = shutil.disk_usage(self.checkpointer.folder).free / 2**30
        if _rank0() and not is_dcp_folder(path):
            shutil.rmtree(path, ignore_errors=True)  # DCP writes .metadata last: without it, never loadable
        return OSError(errno.ENOSPC, f"the disk is full (or a quota / file-size limit was hit) while saving {path}: "
                                     f"{free:.2f} GiB free, one checkpoint needs about "
                                     f"{checkpoint_bytes(self.trainer.model_parts) / 2**30:.2f} GiB. The incomplete "
                                     "folder was removed; earlier checkpoints are intact. Free space and resume.")
