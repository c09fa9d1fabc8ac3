"""Optimizer registry: ``[optimizer] name = "<name>"`` picks an optimizer registered here.

Every trainable parameter has a role (:data:`optim.config.ROLES`, given by :mod:`optim.groups`). A registered
optimizer is a function of the ``[optimizer]`` section returning its :class:`Stepper` list: each stepper is one
torch optimizer per model part, the roles it steps and each role's lr and weight decay, and every role belongs to
exactly one stepper. A role's parameters form the param group named after the role (plus "[REGEX]" / "_warmup" for
``lr_mult_patterns`` / ``lr_warmup_patterns`` matches, :mod:`optim.build`).

Adding an optimizer is one function decorated with :func:`register_optimizer`, next to its torch optimizer
(``optim/<name>.py``), plus that module in the import line of ``attnlab/optim/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from attnlab.optim.config import ROLES

if TYPE_CHECKING:
    from attnlab.optim.groups import Route


@dataclass(frozen=True)
class RoleSettings:
    """lr and weight decay of one role's param group."""

    lr: float
    weight_decay: float


@dataclass(frozen=True)
class Stepper:
    """One torch optimizer of a registered optimizer.

    ``make(param_groups, routes)`` builds it from its param groups (dicts with ``params``, ``name``, ``lr``,
    ``weight_decay``, ``lr_warmup_steps``) and the :class:`optim.groups.Route` of each of their parameters (per
    parameter structure such as Muon's blocks).
    """

    roles: dict[str, RoleSettings]
    make: Callable[[list[dict], list[Route]], torch.optim.Optimizer]


StepperFn = Callable[[Any], list[Stepper]]
"""A registered optimizer: the ``[optimizer]`` section -> its steppers."""

REGISTRY: dict[str, StepperFn] = {}


def register_optimizer(name: str):
    """Function decorator registering ``fn(cfg) -> list[Stepper]`` as ``optimizer.name = name`` (lower case; the
    key is matched in any case)."""

    def wrap(fn: StepperFn) -> StepperFn:
        if name != name.lower() or name in REGISTRY:
            raise ValueError(f"optimizer {name!r} must be lower case and registered once")
        REGISTRY[name] = fn
        return fn

    return wrap


def get_optimizer(name: str, key: str = "optimizer.name") -> StepperFn:
    """The registered optimizer ``name`` (any case); ValueError naming ``key`` and the registered names if none."""
    if name.lower() not in REGISTRY:
        raise ValueError(f"{key}={name!r} is not registered; choose from {sorted(REGISTRY)}")
    return REGISTRY[name.lower()]


def steppers(cfg) -> list[Stepper]:
    """The steppers of ``optimizer.name`` for the ``[optimizer]`` section ``cfg``; every role is in exactly one."""
    out = get_optimizer(cfg.name)(cfg)
    roles = [r for s in out for r in s.roles]
    if sorted(roles) != sorted(ROLES):
        raise TypeError(f"optimizer {cfg.name!r} steps the roles {roles}; each of {list(ROLES)} must be in exactly one")
    return out
