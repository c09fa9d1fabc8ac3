"""Schedules: lr and weight-decay multipliers at every step of small runs (tables written by hand)."""

import math

import pytest

from attnlab.optim.config import LRScheduler
from attnlab.optim.schedules import build_schedule, lr_group_warmup

C45 = 0.5 * (1 + math.cos(math.pi / 4))  # cosine shape at t = 1/4

# (config, training steps, lr multiplier per step 0..N-1, wd multiplier per step)
TABLES = {
    # WSD, 2 warmup steps, decay from 60 % (step 6 of 10), linear to 0 after the last step.
    "wsd_linear": (
        LRScheduler(schedule="wsd", warmup_steps=2, decay_start=0.6, decay_type="linear"), 10,
        [0.5, 1.0,   # warmup (step+1)/2
         1.0, 1.0, 1.0, 1.0,  # stable
         1.0, 0.75, 0.5, 0.25],  # decay t = (step-6)/4
        [1.0] * 10,
    ),
    # Paper WSD: 0 % warmup, decay from 80 %, via torchtitan's decay_ratio key; eq. 42 with γ = 2.
    "paper_wsd_wda2": (
        LRScheduler(schedule="wsd", warmup_steps=0, decay_ratio=0.2, wd_anneal_gamma=2.0), 10,
        [1.0] * 8 + [1.0, 0.5],
        [1.0] * 8 + [1.0, 0.25],  # (1 - t)^2 at t = 0, 1/2
    ),
    "wsd_sqrt_wda1_min0.1": (
        LRScheduler(schedule="wsd", warmup_steps=0, decay_start=0.6, decay_type="sqrt", min_lr_factor=0.1,
                    wd_anneal_gamma=1.0), 10,
        [1.0] * 7 + [0.1 + 0.9 * 0.5, 0.1 + 0.9 * (1 - math.sqrt(0.5)), 0.1 + 0.9 * (1 - math.sqrt(0.75))],
        [1.0] * 7 + [0.75, 0.5, 0.25],
    ),
    "wsd_cosine_shape": (
        LRScheduler(schedule="wsd", warmup_steps=0, decay_start=0.6, decay_type="cosine"), 10,
        [1.0] * 7 + [C45, 0.5, 1 - C45],
        [1.0] * 10,
    ),
    # Cosine with 20 % warmup (warmup_fraction wins over warmup_steps), min lr 0.1, γ = 0.5 over the cosine.
    "cosine_frac_wda0.5": (
        LRScheduler(schedule="cosine", warmup_steps=999, warmup_fraction=0.2, min_lr_factor=0.1,
                    wd_anneal_gamma=0.5), 10,
        [0.5, 1.0,
         1.0, 0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi / 8))), 0.1 + 0.9 * C45,
         0.1 + 0.9 * (0.5 * (1 + math.cos(3 * math.pi / 8))), 0.55,
         0.1 + 0.9 * (0.5 * (1 + math.cos(5 * math.pi / 8))), 0.1 + 0.9 * (1 - C45),
         0.1 + 0.9 * (0.5 * (1 + math.cos(7 * math.pi / 8)))],
        [1.0, 1.0] + [math.sqrt(1 - k / 8) for k in range(8)],
    ),
    "constant_warmup3": (
        LRScheduler(schedule="constant", warmup_steps=3), 6,
        [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0],
        [1.0] * 6,
    ),
    # total_steps decouples the curve from training.steps.
    "wsd_total_steps": (
        LRScheduler(schedule="wsd", warmup_steps=0, decay_start=0.5, total_steps=4), 100,
        [1.0, 1.0, 1.0, 0.5],
        [1.0] * 4,
    ),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_schedule_table(name):
    cfg, steps, lr, wd = TABLES[name]
    s = build_schedule(cfg, steps)
    assert [round(s.lr(i), 12) for i in range(len(lr))] == [round(v, 12) for v in lr]
    assert [round(s.wd(i), 12) for i in range(len(wd))] == [round(v, 12) for v in wd]


def test_group_warmup():
    assert [lr_group_warmup(i, 4) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_group_warmup(0, 0) == 1.0


@pytest.mark.parametrize(
    "kwargs,key",
    [
        (dict(schedule="step"), "lr_scheduler.schedule"),
        (dict(decay_type="exp"), "lr_scheduler.decay_type"),
        (dict(decay_start=0.8, decay_ratio=0.5), "lr_scheduler.decay_start"),
        (dict(warmup_fraction=1.5), "lr_scheduler.warmup_fraction"),
        (dict(wd_anneal_gamma=-1.0), "lr_scheduler.wd_anneal_gamma"),
    ],
)
def test_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        build_schedule(LRScheduler(**kwargs), 10)
