"""Learning-rate and weight-decay schedules as pure functions ``step -> multiplier``.

``step`` counts optimizer steps already taken (``LambdaLR.last_epoch``): the multiplier returned for
``step = n`` is the one used by optimizer step ``n + 1`` of ``total_steps``.

- :func:`lr_wsd`: warmup–stable–decay (Hu et al., 2024, MiniCPM, arXiv 2404.06395). Linear warmup,
  constant until ``decay_start_step``, then linear | cosine | sqrt decay to ``min_lr_factor``.
- :func:`lr_cosine`: linear warmup, then cosine from 1 to ``min_lr_factor`` over the remaining steps.
- :func:`wd_anneal`: weight-decay annealing λ(t) = λ·(1 − t)^γ over the decay stage (Parallax, Appendix G.2,
  eq. 42; γ = 0 is plain WSD).

Unlike torchtitan 0.2.2's WSD, the decay reaches ``min_lr_factor`` one step *after* the last step (no
wasted step at lr 0) and warmup starts at 1/warmup_steps (not 0) as in torchtitan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

DECAY_TYPES = ("linear", "cosine", "sqrt")
SCHEDULES = ("wsd", "cosine", "constant")


def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / warmup_steps


def decay_shape(t: float, decay_type: str) -> float:
    """Shape of the decay, 1 at t = 0 and 0 at t = 1."""
    if decay_type == "linear":
        return 1.0 - t
    if decay_type == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * t))
    if decay_type == "sqrt":
        return 1.0 - math.sqrt(t)
    raise ValueError(f"lr_scheduler.decay_type={decay_type!r}; choose from {list(DECAY_TYPES)}")


def decay_progress(step: int, decay_start_step: int, total_steps: int) -> float:
    """t ∈ [0, 1): fraction of the decay stage [decay_start_step, total_steps) already done (0 before it)."""
    if step < decay_start_step or total_steps <= decay_start_step:
        return 0.0
    return min(1.0, (step - decay_start_step) / (total_steps - decay_start_step))


def lr_wsd(
    step: int,
    total_steps: int,
    warmup_steps: int,
    decay_start_step: int,
    decay_type: str = "linear",
    min_lr_factor: float = 0.0,
) -> float:
    """Warmup–stable–decay multiplier."""
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    t = decay_progress(step, max(decay_start_step, warmup_steps), total_steps)
    return min_lr_factor + (1.0 - min_lr_factor) * decay_shape(t, decay_type)


def lr_cosine(step: int, total_steps: int, warmup_steps: int, min_lr_factor: float = 0.0) -> float:
    """Linear warmup, then cosine from 1 to ``min_lr_factor`` (reached after the last step)."""
    return lr_wsd(step, total_steps, warmup_steps, warmup_steps, "cosine", min_lr_factor)


def lr_constant(step: int, warmup_steps: int) -> float:
    return _warmup(step, warmup_steps) if step < warmup_steps else 1.0


def wd_anneal(step: int, decay_start_step: int, total_steps: int, gamma: float) -> float:
    """(1 − t)^γ with t the progress through the decay stage (eq. 42); 1 everywhere when γ = 0."""
    if gamma == 0.0:
        return 1.0
    return (1.0 - decay_progress(step, decay_start_step, total_steps)) ** gamma


def lr_group_warmup(step: int, warmup_steps: int) -> float:
    """Extra per-group warmup multiplier, e.g. for a zero-initialised W_R added to a converted checkpoint."""
    return 1.0 if warmup_steps <= 0 or step >= warmup_steps else _warmup(step, warmup_steps)


@dataclass(frozen=True)
class Schedule:
    """Resolved schedule: ``lr(step)`` and ``wd(step)`` multipliers plus the step counts they use."""

    name: str
    total_steps: int
    warmup_steps: int
    decay_start_step: int
    lr: Callable[[int], float]
    wd: Callable[[int], float]

    def describe(self) -> str:
        """One line: the schedule and its warmup, stable and decay steps (they add up to ``total_steps``)."""
        decay = self.total_steps - self.decay_start_step
        return (f"schedule={self.name} steps={self.total_steps}: {self.warmup_steps} warmup, "
                f"{self.decay_start_step - self.warmup_steps} stable, {decay} decay")


def build_schedule(cfg, training_steps: int) -> Schedule:
    """Turn an ``[lr_scheduler]`` config (``optim.config.LRScheduler``) into a :class:`Schedule`.

    Warmup: ``warmup_fraction`` (if set) wins over ``warmup_steps``. Decay start: ``decay_start`` (fraction)
    if set, else ``1 - decay_ratio`` (torchtitan's key) if set, else right after warmup.

    A schedule that cannot run as configured is an error naming the keys and values (they used to be clamped
    silently): a warmup longer than the run, or a WSD warmup that overlaps the decay its ``decay_start`` /
    ``decay_ratio`` asks for (torchtitan shortens that decay with a warning). A warmup as long as the run is
    valid: the lr reaches its peak at the last step.
    """
    total = cfg.total_steps if cfg.total_steps is not None else training_steps
    total_key = f"lr_scheduler.total_steps={total}" if cfg.total_steps is not None else f"training.steps={total}"
    if total <= 0:
        raise ValueError(f"training.steps / lr_scheduler.total_steps must be > 0, got {total}")
    name = cfg.schedule
    if name not in SCHEDULES:
        raise ValueError(f"lr_scheduler.schedule={name!r}; choose from {list(SCHEDULES)}")
    if cfg.decay_type not in DECAY_TYPES:
        raise ValueError(f"lr_scheduler.decay_type={cfg.decay_type!r}; choose from {list(DECAY_TYPES)}")
    if cfg.warmup_fraction is not None:
        if not 0.0 <= cfg.warmup_fraction <= 1.0:
            raise ValueError(f"lr_scheduler.warmup_fraction={cfg.warmup_fraction} must be in [0, 1]")
        warmup = round(cfg.warmup_fraction * total)
        warmup_key = f"lr_scheduler.warmup_fraction={cfg.warmup_fraction} ({warmup} steps)"
    else:
        warmup = int(cfg.warmup_steps)
        warmup_key = f"lr_scheduler.warmup_steps={warmup}"
    if warmup < 0:
        raise ValueError(f"{warmup_key} must be >= 0")
    if cfg.decay_start is not None and cfg.decay_ratio is not None and abs(cfg.decay_start + cfg.decay_ratio - 1) > 1e-9:
        raise ValueError(
            f"lr_scheduler.decay_start={cfg.decay_start} and lr_scheduler.decay_ratio={cfg.decay_ratio} disagree; set one"
        )
    if name == "wsd":
        if cfg.decay_start is not None:
            frac = cfg.decay_start
        elif cfg.decay_ratio is not None:
            frac = 1.0 - cfg.decay_ratio
        else:
            frac = None
        if frac is not None and not 0.0 <= frac <= 1.0:
            raise ValueError(f"lr_scheduler.decay_start={frac} must be in [0, 1]")
        decay_start = warmup if frac is None else round(frac * total)
        lr_fn = lambda s: lr_wsd(s, total, warmup, decay_start, cfg.decay_type, cfg.min_lr_factor)  # noqa: E731
    elif name == "cosine":
        decay_start = warmup
        lr_fn = lambda s: lr_cosine(s, total, warmup, cfg.min_lr_factor)  # noqa: E731
    else:
        decay_start = total
        lr_fn = lambda s: lr_constant(s, warmup)  # noqa: E731
    gamma = cfg.wd_anneal_gamma
    if gamma < 0:
        raise ValueError(f"lr_scheduler.wd_anneal_gamma={gamma} must be >= 0")
    if warmup > total:
        raise ValueError(f"{warmup_key} is longer than the run ({total_key}): the lr would never reach its peak. "
                         "Set a warmup of at most the run's steps")
    if warmup > decay_start:  # WSD with a decay fraction: the decay it asks for would be shortened
        key = (f"lr_scheduler.decay_start={cfg.decay_start}" if cfg.decay_start is not None
               else f"lr_scheduler.decay_ratio={cfg.decay_ratio}")
        raise ValueError(f"{warmup_key} + {key} ({total - decay_start} decay steps) exceed {total_key}: the warmup "
                         "would run into the decay. Shorten the warmup or the decay, or train longer")
    wd_fn = lambda s: wd_anneal(s, decay_start, total, gamma)  # noqa: E731
    return Schedule(name, total, warmup, decay_start, lr_fn, wd_fn)
