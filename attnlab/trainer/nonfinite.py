"""The non-finite guard (``training.nonfinite_skips``, docs/failures.md): a run stops on a non-finite loss, gradient
or weight before anything non-finite is written, so the newest checkpoint is always finite and ``keep_latest_k``
rotation never removes the last good one.

Every micro-batch's loss is checked on the device (``isfinite``, no host sync) into the first step that went bad;
that flag is read only at log steps (in the one read of the logged metrics, which also checks the logged global
loss and gradient norm: ``trainer.step.log_step``), before every checkpoint save, which additionally checks every
weight and optimizer-state tensor, and at the end of training. A step between two log steps never syncs.

What ``nonfinite_skips = 0`` guarantees: a non-finite step's update is applied (no host decision is made before
the optimizer step), so the weights and optimizer state in memory may turn non-finite; the run then raises
:class:`NonFiniteError` at the next log step, save or the end of training, whichever comes first (at most
``metrics.log_freq`` steps later), naming the first bad step; no checkpoint is written after it, so the newest
checkpoint is finite. A NaN gradient turns the weights NaN and the next loss NaN, so the loss check sees it one
step later (the log-step and pre-save checks see it directly). With ``nonfinite_skips = N > 0`` the decision is
needed before each optimizer step: loss and gradients are checked and all-reduced every step (one host sync per
step), a bad step is never applied (no update of weights or optimizer state; the schedule and data move on) and
the N+1-th stops the run.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from torchtitan.tools.logging import logger

from attnlab.optim.dtensor import local_shard
from attnlab.checkpoint.layout import step_folders

NO_BAD_STEP = 2**62
"""The device-side "first bad step" while no non-finite value was seen."""


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weight; nothing was saved after it."""


def nonfinite_names(named: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors (local shards) holding a NaN or an infinity (one host sync)."""
    named = {k: local_shard(t) for k, t in named.items() if torch.is_tensor(t) and t.is_floating_point() and t.numel()}
    if not named:
        return []
    flags = [torch.isfinite(t).all() for t in named.values()]
    ok = torch.stack([f.to(flags[0].device) for f in flags])
    return [k for k, good in zip(named, ok.cpu().tolist()) if not good]


def _all_ranks(t: torch.Tensor, op) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t


class NonFiniteGuard:
    """The guard of the module docstring for one run's ``model_parts`` and ``optimizers``; ``skips`` is
    ``training.nonfinite_skips``, ``checkpoint_folder`` (None without checkpointing) where the error messages look
    for the newest checkpoint."""

    def __init__(self, model_parts, optimizers, device: torch.device, skips: int, checkpoint_folder: str | None):
        self.model_parts, self.optimizers, self.device = model_parts, optimizers, device
        self.limit, self.checkpoint_folder = skips, checkpoint_folder
        self._first_bad = torch.tensor(NO_BAD_STEP, device=device)
        self._step_bad = torch.zeros((), dtype=torch.bool, device=device)
        self._skips, self._skipped_step = 0, -1

    def note_loss(self, loss: torch.Tensor) -> None:
        """Record a micro-batch's loss (on the device: no sync)."""
        self._step_bad = self._step_bad | ~torch.isfinite(loss.detach())

    def step_is_finite(self, step: int) -> bool:
        """Before the optimizer step of ``step``: False when the step is to be skipped (``nonfinite_skips > 0`` and
        a loss or gradient is non-finite on some rank); raises :class:`NonFiniteError` past the limit. Without
        skips the step's flag joins the first bad step on the device and the answer is True (no sync)."""
        bad, self._step_bad = self._step_bad, torch.zeros((), dtype=torch.bool, device=self.device)
        if self.limit == 0:
            # python scalars enter kernels as arguments: no host-to-device copy, no sync
            self._first_bad = torch.where(bad, self._first_bad.clamp(max=step), self._first_bad)
            return True
        grads = [local_shard(p.grad) for m in self.model_parts for p in m.parameters() if p.grad is not None]
        if grads:
            bad = bad | ~torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())
        if not _all_ranks(bad.to(torch.int32), dist.ReduceOp.MAX).item():
            return True
        self._skips += 1
        self._skipped_step = step
        if self._skips > self.limit:
            raise NonFiniteError(f"step {step}: non-finite loss or gradients, the {self._skips}-th such step "
                                 f"(training.nonfinite_skips = {self.limit}); training stopped. {self._hint()}")
        logger.warning(f"step {step}: non-finite loss or gradients; optimizer step skipped "
                       f"({self._skips}/{self.limit} allowed by training.nonfinite_skips)")
        return False

    def first_bad(self) -> torch.Tensor:
        """The first step with a non-finite loss on any rank ([] int64 on the device, :data:`NO_BAD_STEP` while
        none): an all-reduce queued on the device, nothing read back."""
        return _all_ranks(self._first_bad.clone(), dist.ReduceOp.MIN)

    def check(self, step: int, loss: float | None = None, grad_norm: float | None = None,
              first_bad: int | None = None) -> None:
        """Raise :class:`NonFiniteError` when any rank saw a non-finite loss since the start, or when the (global)
        ``loss`` / ``grad_norm`` given are non-finite. ``first_bad``: :meth:`first_bad` as read back by the caller
        with its other values (a log step's metrics); else it is read here (checkpoint saves, the end of
        training): one host sync."""
        first = int(self.first_bad().item()) if first_bad is None else first_bad
        values = {"loss": loss, "grad norm": grad_norm}
        bad_now = {k: v for k, v in values.items() if v is not None and not math.isfinite(v)}
        if self._skipped_step == step:
            bad_now = {}
        if first == NO_BAD_STEP and not bad_now:
            return
        first_txt = f"first at step {first}" if first != NO_BAD_STEP else f"at step {step}"
        now = ", ".join(f"{k} {v}" for k, v in bad_now.items())
        raise NonFiniteError(f"non-finite training loss or gradient norm ({first_txt}{'; ' + now if now else ''}); "
                             f"training stopped at step {step} without saving. {self._hint()}")

    def check_before_save(self, step: int) -> None:
        """:meth:`check`, then every weight and optimizer-state tensor: nothing non-finite is written."""
        self.check(step)
        bad = self._bad_tensors()
        if bad:
            raise NonFiniteError(f"step {step}: non-finite values in {self._names(bad)}; no checkpoint written. "
                                 f"{self._hint()}")

    def check_loaded(self, path: str, step: int) -> None:
        """Every weight and optimizer-state tensor just loaded from checkpoint ``path`` (of ``step``) is finite."""
        bad = self._bad_tensors()
        if bad:
            raise NonFiniteError(f"checkpoint {path!r} (step {step}) is corrupt: non-finite values in "
                                 f"{self._names(bad)}. Remove that step folder to resume from an earlier one, or "
                                 "pick one with checkpoint.load_step.")

    def _bad_tensors(self) -> list[str]:
        """Non-finite weights and optimizer-state tensors of this rank; [""] when only another rank has some."""
        named = {k: v for m in self.model_parts for k, v in m.state_dict().items()}
        names = {id(p): n for m in self.model_parts for n, p in m.named_parameters()}
        for i, opt in enumerate(getattr(self.optimizers, "optimizers", [])):
            for p, st in opt.state.items():
                named.update({f"optimizer{i}.{names.get(id(p), '?')}.{k}": v for k, v in st.items()
                              if torch.is_tensor(v) and v.dim() > 0})
        bad = nonfinite_names(named)
        flag = _all_ranks(torch.tensor(int(bool(bad)), device=self.device), dist.ReduceOp.MAX)
        return bad or ([""] if flag.item() else [])

    @staticmethod
    def _names(bad: list[str]) -> str:
        return "tensors of another rank" if bad == [""] else f"{bad[:5]}{' …' if len(bad) > 5 else ''}"

    def _hint(self) -> str:
        folder = self.checkpoint_folder
        steps = sorted(step_folders(folder, dcp_only=True)) if folder is not None else []
        where = (f"The newest checkpoint, {os.path.join(self.checkpoint_folder, f'step-{steps[-1]}')}, is finite and "
                 "kept" if steps else "No checkpoint was written")
        return (f"{where}; lower optimizer.lr or training.max_norm and resume, or allow skipped steps with "
                "training.nonfinite_skips")
