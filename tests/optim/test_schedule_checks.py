"""A schedule that cannot run as configured is an error naming the keys and values (it used to be clamped
silently), and the schedule that will run is logged once: warmup, stable and decay steps."""

import logging

import pytest
import torch

from attnlab.optim.build import build_lr_schedulers, build_optimizers
from attnlab.optim.config import LRScheduler, Optimizer
from attnlab.optim.schedules import build_schedule


@pytest.mark.parametrize("kwargs,steps,message", [
    (dict(warmup_steps=20, decay_ratio=0.2), 6,
     r"lr_scheduler.warmup_steps=20 is longer than the run \(training.steps=6\)"),
    (dict(schedule="cosine", warmup_steps=7), 6, r"lr_scheduler.warmup_steps=7 is longer than the run"),
    (dict(schedule="constant", warmup_steps=9, total_steps=8), 100,
     r"lr_scheduler.warmup_steps=9 is longer than the run \(lr_scheduler.total_steps=8\)"),
    (dict(warmup_steps=5, decay_ratio=0.5), 8,
     r"lr_scheduler.warmup_steps=5 \+ lr_scheduler.decay_ratio=0.5 \(4 decay steps\) exceed training.steps=8"),
    (dict(warmup_steps=3, decay_start=0.2), 10,
     r"lr_scheduler.warmup_steps=3 \+ lr_scheduler.decay_start=0.2 \(8 decay steps\) exceed training.steps=10"),
])
def test_impossible_schedules_name_their_keys(kwargs, steps, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(LRScheduler(**kwargs), steps)


@pytest.mark.parametrize("kwargs,steps,phases", [
    (dict(warmup_steps=20, decay_ratio=0.2), 400, "20 warmup, 300 stable, 80 decay"),  # attnlab/configs/debug_cpu.toml
    (dict(warmup_steps=1, decay_ratio=0.2), 1, "1 warmup, 0 stable, 0 decay"),  # a 1-step run (tiny_args)
    (dict(warmup_steps=2, decay_ratio=0.5), 4, "2 warmup, 0 stable, 2 decay"),  # warmup then decay, no plateau
    (dict(schedule="cosine", warmup_steps=0, warmup_fraction=0.25), 8, "2 warmup, 0 stable, 6 decay"),
    (dict(schedule="constant", warmup_steps=3), 6, "3 warmup, 3 stable, 0 decay"),
])
def test_the_schedule_that_runs_is_logged_once(kwargs, steps, phases, caplog):
    opt = build_optimizers([torch.nn.Linear(4, 4)], Optimizer(name="AdamW", lr=0.1))
    with caplog.at_level(logging.INFO):
        build_lr_schedulers(opt, LRScheduler(**kwargs), steps)
    lines = [r.getMessage() for r in caplog.records if "LR schedule" in r.getMessage()]
    name = kwargs.get("schedule", "wsd")
    assert lines == [f"LR schedule: schedule={name} steps={steps}: {phases} steps, wd_anneal_gamma=0.0"]
