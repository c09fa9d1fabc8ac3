"""TrainSpec builders: ``build_optimizers`` and ``build_lr_schedulers`` (torchtitan 0.2.2 call shapes).

``[optimizer] name = "muon"``: per model part one :class:`optim.muon.Muon` for the "matrix" group and one
AdamW (``torch.optim.AdamW`` stepping DTensor shards locally; betas adam_beta1/2, eps adam_eps, decoupled wd) for embed/head/norm/vector with the
paper's lr multipliers. ``name = "adamw"`` (or "adam"): one AdamW with the same groups, lr for all, weight decay
off for norm/vector (and embed/head unless ``embed_weight_decay``).

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

import torch
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

from optim.config import OPTIMIZER_NAMES
from optim.groups import Route, format_routing_table, route_parameters
from optim.muon import Muon, local_shard
from optim.schedules import Schedule, build_schedule, lr_group_warmup


class _ShardLocalStep:
    """Adam/AdamW that step FSDP2 (DTensor) parameters through their local shards.

    The update is elementwise, so it is the same arithmetic on the same shards, minus DTensor's dispatch of every
    fused/foreach call, which left stock AdamW on FSDP2 shards host-bound (host time several times its GPU time).
    Parameters and state stay DTensors, so state dicts and DCP checkpoints are unchanged.
    """

    def _init_group(self, group, *lists):
        has_complex = super()._init_group(group, *lists)
        for lst in lists:
            lst[:] = [local_shard(t) for t in lst]
        return has_complex


class Adam(_ShardLocalStep, torch.optim.Adam):
    pass


class AdamW(_ShardLocalStep, torch.optim.AdamW):
    pass


def _group_settings(cfg, name: str) -> dict[str, dict[str, Any]]:
    """lr / weight_decay / optimizer kind per group for optimizer ``name``."""
    wd, lr = cfg.weight_decay, cfg.lr
    embed_wd = wd if cfg.embed_weight_decay else 0.0
    if name == "muon":
        return {
            "matrix": dict(opt="muon", lr=lr, weight_decay=wd),
            "embed": dict(opt="adamw", lr=lr * cfg.adam_embed_lr_mult, weight_decay=embed_wd),
            "head": dict(opt="adamw", lr=lr * cfg.adam_head_lr_mult, weight_decay=embed_wd),
            "norm": dict(opt="adamw", lr=lr * cfg.adam_norm_lr_mult, weight_decay=0.0),
            "vector": dict(opt="adamw", lr=lr * cfg.adam_vector_lr_mult, weight_decay=0.0),
        }
    return {
        "matrix": dict(opt=name, lr=lr, weight_decay=wd),
        "embed": dict(opt=name, lr=lr, weight_decay=embed_wd),
        "head": dict(opt=name, lr=lr, weight_decay=embed_wd),
        "norm": dict(opt=name, lr=lr, weight_decay=0.0),
        "vector": dict(opt=name, lr=lr, weight_decay=0.0),
    }


def _param_groups(routes: list[Route], settings, cfg, kind: str) -> list[dict]:
    groups: dict[str, dict] = {}
    for r in routes:
        s = settings[r.group]
        if (s["opt"] == "muon") != (kind == "muon"):
            continue
        g = groups.setdefault(
            r.group_key,
            dict(params=[], name=r.group_key, lr=cfg.lr * r.lr_mult[1] if r.lr_mult else s["lr"],
                 weight_decay=s["weight_decay"],
                 lr_warmup_steps=cfg.lr_warmup_steps if r.warmup else 0),
        )
        g["params"].append(r.param)
    return list(groups.values())


def _adamw_kwargs(cfg, muon: bool, params: list[torch.Tensor]) -> dict:
    on_cuda = all(p.device.type == "cuda" for p in params)
    impl = cfg.implementation
    return dict(
        betas=(cfg.adam_beta1, cfg.adam_beta2) if muon else (cfg.beta1, cfg.beta2),
        eps=cfg.adam_eps if muon else cfg.eps,
        fused=impl == "fused" and on_cuda,
        foreach=impl == "foreach" or (impl == "fused" and not on_cuda),
    )


class MultiOptimizersContainer(OptimizersContainer):
    """Several optimizers per model part (Muon + AdamW); checkpoints each against its own part."""

    def __init__(self, model_parts: list[nn.Module], cfg) -> None:
        name = cfg.name.lower()
        if name not in OPTIMIZER_NAMES:
            raise ValueError(f"optimizer.name={cfg.name!r}; choose from {list(OPTIMIZER_NAMES)}")
        self.model_parts, self.optimizers, self._owner_part = model_parts, [], []
        self.settings = _group_settings(cfg, name)
        self.routes: list[Route] = []
        all_params = []
        for model in model_parts:
            routes = route_parameters(model, cfg)
            self.routes += routes
            all_params += [r.param for r in routes]
            for opt in self._build_part(routes, cfg, name):
                self.optimizers.append(opt)
                self._owner_part.append(model)
        self._post_init(all_params, {"lr": cfg.lr})

    def _build_part(self, routes: list[Route], cfg, name: str) -> list[torch.optim.Optimizer]:
        opts = []
        muon_groups = _param_groups(routes, self.settings, cfg, "muon")
        if muon_groups:
            blocks = {r.param: r.blocks for r in routes if r.blocks is not None}
            opts.append(Muon(
                muon_groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                nesterov=cfg.muon_nesterov, ns_coefficients=cfg.muon_ns_coefficients, ns_steps=cfg.muon_ns_steps,
                ns_dtype=cfg.muon_ns_dtype, eps=cfg.muon_eps, update_scale=cfg.muon_update_scale, blocks=blocks,
            ))
        adam_groups = _param_groups(routes, self.settings, cfg, "adam")
        if adam_groups:
            params = [p for g in adam_groups for p in g["params"]]
            cls = Adam if name == "adam" else AdamW
            opts.append(cls(adam_groups, lr=cfg.lr, **_adamw_kwargs(cfg, name == "muon", params)))
        return opts

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
    """TrainSpec ``build_optimizers_fn``: routes parameters, builds Muon/AdamW, logs the routing table."""
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
