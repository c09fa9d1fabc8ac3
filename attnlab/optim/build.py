"""TrainSpec builders: ``build_optimizers`` and ``build_lr_schedulers`` (torchtitan 0.2.2 call shapes).

``build_optimizers`` gives every parameter its role (:mod:`optim.groups`) and builds, per model part, the torch
optimizers of ``optimizer.name`` (:mod:`optim.registry`: Muon for "matrix" and AdamW for the rest under "muon", one
AdamW or Adam for every role under "adamw" / "adam"), one param group per role plus the groups of
``lr_mult_patterns`` and ``lr_warmup_patterns`` matches.

Departures from torchtitan 0.2.2:
- :class:`MultiOptimizersContainer` holds several optimizers per model part and saves/loads each against its
  own part (0.2.2 zips parts with optimizers, assuming one per part);
- :class:`ScheduleContainer` saves only the step (``last_epoch``) and recomputes every group's lr and weight
  decay from it on load (0.2.2 loads the first scheduler's state, with its ``base_lrs``, into all of them);
  it also applies weight-decay annealing and per-group lr warmup.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from attnlab.optim.groups import Route, format_routing_table, route_parameters
from attnlab.optim.registry import RoleSettings, steppers
from attnlab.optim.schedules import Schedule, build_schedule, lr_group_warmup


def _param_groups(routes: list[Route], roles: dict[str, RoleSettings], cfg) -> list[dict]:
    """One param group per group name of ``routes``, in order of first appearance: the role's lr (or optimizer.lr ×
    MULT for an lr_mult_patterns match) and weight decay, and the extra warmup of lr_warmup_patterns."""
    groups: dict[str, dict] = {}
    for r in routes:
        s = roles[r.role]
        g = groups.setdefault(
            r.group,
            dict(params=[], name=r.group, lr=cfg.lr * r.lr_mult[1] if r.lr_mult else s.lr,
                 weight_decay=s.weight_decay, lr_warmup_steps=cfg.lr_warmup_steps if r.warmup else 0),
        )
        g["params"].append(r.param)
    return list(groups.values())


class MultiOptimizersContainer(OptimizersContainer):
    """Several optimizers per model part (e.g. Muon + AdamW); checkpoints each against its own part."""

    def __init__(self, model_parts: list[nn.Module], cfg) -> None:
        plan = steppers(cfg)
        self.model_parts, self.optimizers, self._owner_part = model_parts, [], []
        self.routes: list[Route] = []
        for model in model_parts:
            routes = route_parameters(model, cfg)
            self.routes += routes
            for stepper in plan:
                mine = [r for r in routes if r.role in stepper.roles]
                if mine:
                    self.optimizers.append(stepper.make(_param_groups(mine, stepper.roles, cfg), mine))
                    self._owner_part.append(model)
        self._post_init([r.param for r in self.routes], {"lr": cfg.lr})

    def state_dict(self) -> dict[str, Any]:
        func = functools.partial(get_optimizer_state_dict, options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {k: v for sd in map(func, self._owner_part, self.optimizers) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        func = functools.partial(
            set_optimizer_state_dict, optim_state_dict=state_dict,
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )
        list(map(func, self._owner_part, self.optimizers))

    def lr_wd(self) -> dict[str, float]:
        """Current ``{"lr/<group>": lr, "wd/<group>": weight_decay}`` (first part's value per group name)."""
        out: dict[str, float] = {}
        for opt in self.optimizers:
            for g in opt.param_groups:
                out.setdefault(f"lr/{g['name']}", float(g["lr"]))
                out.setdefault(f"wd/{g['name']}", float(g["weight_decay"]))
        return out

    def routing_table(self) -> str:
        lr, wd, kind = {}, {}, {}
        for opt in self.optimizers:
            for g in opt.param_groups:
                lr[g["name"]], wd[g["name"]] = float(g["lr"]), float(g["weight_decay"])
                kind[g["name"]] = type(opt).__name__
        return format_routing_table(self.routes, lr, wd, kind)


def build_optimizers(model_parts: list[nn.Module], optimizer_config, parallel_dims=None, ft_manager=None):
    """TrainSpec ``build_optimizers_fn``: gives parameters their roles, builds ``optimizer.name``'s optimizers, logs
    the routing table."""
    if getattr(optimizer_config, "early_step_in_backward", False):
        raise ValueError("optimizer.early_step_in_backward=true is not supported with optimizer groups; set it to false")
    if ft_manager is not None and getattr(ft_manager, "enabled", False):
        raise ValueError("torchft is not supported by optim.build_optimizers")
    container = MultiOptimizersContainer(model_parts, optimizer_config)
    logger.info(f"Optimizer {optimizer_config.name}: parameter routing\n{container.routing_table()}")
    return container


class ScheduleContainer(LRSchedulersContainer):
    """One LambdaLR per optimizer (a lambda per group) plus weight-decay annealing; state = the step only."""

    def __init__(self, optimizers, schedule: Schedule) -> None:
        assert len(optimizers) > 0, "Must have at least one optimizer to create LRScheduler"
        self.schedule, self.optimizers, self.schedulers = schedule, list(optimizers), []
        for opt in self.optimizers:
            for g in opt.param_groups:
                g.setdefault("initial_weight_decay", g["weight_decay"])
            lambdas = [functools.partial(_group_lr, schedule.lr, g.get("lr_warmup_steps", 0)) for g in opt.param_groups]
            self.schedulers.append(LambdaLR(opt, lambdas))
        self._apply_wd()

    @property
    def last_epoch(self) -> int:
        return self.schedulers[0].last_epoch

    def step(self) -> None:
        super().step()
        self._apply_wd()

    def _apply_wd(self) -> None:
        f = self.schedule.wd(self.last_epoch)
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["weight_decay"] = g["initial_weight_decay"] * f

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        step = int(state_dict["last_epoch"])
        for s in self.schedulers:
            s.last_epoch = step
            for g, base, fn in zip(s.optimizer.param_groups, s.base_lrs, s.lr_lambdas):
                g["lr"] = base * fn(step)
            s._last_lr = [g["lr"] for g in s.optimizer.param_groups]
        self._apply_wd()

    def lr_wd(self) -> dict[str, float]:
        """Current ``{"lr/<group>": lr, "wd/<group>": weight_decay}`` for logging."""
        out: dict[str, float] = {}
        for opt in self.optimizers:
            for g in opt.param_groups:
                name = g.get("name", "default")
                out.setdefault(f"lr/{name}", float(g["lr"]))
                out.setdefault(f"wd/{name}", float(g["weight_decay"]))
        return out


def _group_lr(lr_fn, warmup_steps: int, step: int) -> float:
    return lr_fn(step) * lr_group_warmup(step, warmup_steps)


def build_lr_schedulers(optimizers, lr_scheduler_config, training_steps: int) -> ScheduleContainer:
    """TrainSpec ``build_lr_schedulers_fn``."""
    schedule = build_schedule(lr_scheduler_config, training_steps)
    logger.info(f"LR schedule: {schedule.describe()} steps, wd_anneal_gamma={lr_scheduler_config.wd_anneal_gamma}")
    return ScheduleContainer(optimizers, schedule)
