"""Attention registry: ``[model] attention = "<name>"`` picks a mechanism registered here.

Adding a mechanism is one module file in ``attnlab/attention/`` that decorates its ``nn.Module`` with
:func:`register_attention` (giving its options dataclass and a one-line description), plus one line in
``attnlab/attention/__init__.py`` importing that file. The module class lists the ``[attention] impl`` values it accepts
in ``impls`` (a subset of :data:`attention.ops.common.IMPLS`, "auto" included). The options dataclass becomes the TOML
section ``[attention.<name>]`` automatically (see ``config.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchtitan.tools.logging import logger

from attnlab.attention.base import AttentionArgs
from attnlab.attention.ops.common import IMPLS


@dataclass
class NoOptions:
    """This mechanism has no options."""


@dataclass(frozen=True)
class Mechanism:
    name: str
    cls: type[nn.Module]
    options: type
    description: str
    reference_only: str = ""  # why, with the measured speed, when a config trains too slowly to be used at scale


REGISTRY: dict[str, Mechanism] = {}


def register_attention(name: str, *, options: type = NoOptions, description: str = "", reference_only: str = ""):
    """Class decorator registering an attention module under ``name``. ``reference_only``: set (to the reason and
    measured speed) for a mechanism with no fast path, trained below 10 % of softmax's tokens/s; it is listed so
    by ``--list-attention`` and building it logs a warning."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in REGISTRY:
            raise ValueError(f"attention mechanism {name!r} is registered twice")
        if not dataclasses.is_dataclass(options):
            raise TypeError(f"options of attention {name!r} must be a dataclass, got {options!r}")
        impls = getattr(cls, "impls", ())
        if "auto" not in impls or not set(impls) <= set(IMPLS):
            raise TypeError(f"attention {name!r}: impls={impls!r} must contain 'auto' and be a subset of {list(IMPLS)}")
        desc = description or (cls.__doc__ or "").strip().splitlines()[0]
        REGISTRY[name] = Mechanism(name, cls, options, desc, reference_only)
        cls.mechanism = name
        return cls

    return wrap


def get_mechanism(name: str, key: str = "model.attention") -> Mechanism:
    if name not in REGISTRY:
        raise ValueError(f"{key}={name!r} is not registered; choose from {sorted(REGISTRY)}")
    return REGISTRY[name]


def build_attention(name: str, args: AttentionArgs, opts: Any = None) -> nn.Module:
    """Instantiate mechanism ``name``; ``opts`` defaults to the options dataclass's defaults."""
    mech = get_mechanism(name)
    if mech.reference_only and args.layer_id == 0:
        logger.warning(f"attention {name!r} is reference-only: {mech.reference_only}")
    return mech.cls(args, opts if opts is not None else mech.options())


def describe() -> str:
    """One line per registered mechanism (``python -m attnlab.train --list-attention``): name, the ``[attention] impl``
    values it accepts, description, and whether it is reference-only (no fast path)."""
    impls = {n: " | ".join(m.cls.impls) for n, m in REGISTRY.items()}
    w1, w2 = max(len(n) for n in REGISTRY), max(len(i) for i in impls.values())
    head = f"{'name':<{w1}}  {'impl':<{w2}}  mechanism"
    rows = [f"{n:<{w1}}  {impls[n]:<{w2}}  {m.description}" + (f"  [reference only: {m.reference_only}]"
                                                                 if m.reference_only else "")
            for n, m in sorted(REGISTRY.items())]
    return "\n".join([head] + rows)
