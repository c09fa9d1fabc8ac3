"""Route every parameter to one optimizer group by name patterns, shape rules and module hints.

Groups: "matrix" (2-D hidden weights: Muon, or AdamW with weight decay), "embed", "head", "norm" and
"vector" (biases, gates, depthwise conv kernels, A_log, dt_bias, scalars: Adam-style, no weight decay).

Precedence, first match wins:
1. hints: ``param._optim = "<group>"`` (lost when FSDP2 re-wraps parameters, so prefer the module form),
   or a module attribute ``optim_hints = {"<param name relative to the module>": "<group>"}``;
   "muon" means "matrix", "adam" means "vector";
2. ``embed_patterns``, ``head_patterns``, ``norm_patterns``, ``vector_patterns`` (``re.search`` on the name,
   with ``_orig_mod.`` / ``_checkpoint_wrapped_module.`` wrappers stripped);
3. not 2-D → "vector"; 2-D with a side < ``muon_min_dim`` → "vector";
4. otherwise "matrix".

Independently of the group, ``lr_mult_patterns`` ("REGEX=MULT", first match wins) give a parameter its own
lr = optimizer.lr × MULT, in its own param group "<group>[REGEX]" (see :func:`parse_lr_mults`).

Muon splits of a "matrix" parameter into independently orthogonalised blocks:
- module attribute ``muon_blocks = {"<rel name>": [rows...]}`` or ``{"<rel name>": (dim, [sizes...])}``
  for fused projections (e.g. q|k|v|gate), always applied;
- with ``muon_per_head``: module attribute ``muon_heads = {"<rel name>": rows_per_head}``, else for names
  matching ``muon_per_head_patterns`` the ``head_dim`` attribute of the nearest enclosing module.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from optim.config import GROUPS
from optim.muon import Blocks

_WRAPPERS = re.compile(r"(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")
_ALIASES = {"muon": "matrix", "adam": "vector", "adamw": "vector"}


def clean_name(name: str) -> str:
    """Parameter name without torch.compile / activation-checkpoint wrapper segments."""
    return _WRAPPERS.sub("", name)


@dataclass
class Route:
    name: str
    param: nn.Parameter
    group: str
    reason: str
    blocks: Blocks | None = None
    warmup: bool = False
    lr_mult: tuple[str, float] | None = None  # (pattern, multiplier of optimizer.lr) from lr_mult_patterns

    @property
    def group_key(self) -> str:
        """Param-group name: the group, "[pattern]" for an lr_mult_patterns match, "_warmup" for the extra warmup."""
        return self.group + (f"[{self.lr_mult[0]}]" if self.lr_mult else "") + ("_warmup" if self.warmup else "")


def parse_lr_mults(specs: list[str]) -> list[tuple[re.Pattern, float]]:
    """``optimizer.lr_mult_patterns`` entries "REGEX=MULT" (split at the last "=") -> [(compiled regex, MULT)];
    MULT must be a finite number >= 0."""
    out = []
    for i, spec in enumerate(specs):
        pat, sep, mult = str(spec).rpartition("=")
        try:
            m = float(mult)
            if not sep or not pat or not (math.isfinite(m) and m >= 0):
                raise ValueError
            out.append((re.compile(pat), m))
        except (ValueError, re.error):
            raise ValueError(f"optimizer.lr_mult_patterns[{i}]={spec!r}; expected 'REGEX=MULT' with a valid regex "
                             "and a finite MULT >= 0, e.g. '\\.r_norm\\.=1'") from None
    return out


def _hint_group(value, where: str) -> str:
    g = _ALIASES.get(value, value)
    if g not in GROUPS:
        raise ValueError(f"optimizer hint {where}={value!r}; choose from {list(GROUPS) + list(_ALIASES)}")
    return g


def _module_hints(model: nn.Module) -> tuple[dict, dict, dict]:
    groups, blocks, heads = {}, {}, {}
    for mname, mod in model.named_modules():
        prefix = clean_name(mname + ".") if mname else ""
        for attr, out in (("optim_hints", groups), ("muon_blocks", blocks), ("muon_heads", heads)):
            for rel, v in (getattr(mod, attr, None) or {}).items():
                out[prefix + rel] = v
    return groups, blocks, heads


def _blocks(spec, shape: torch.Size, name: str) -> Blocks:
    dim, sizes = (spec[0], spec[1]) if isinstance(spec, tuple) else (0, spec)
    sizes = tuple(int(s) for s in sizes)
    if sum(sizes) != shape[dim]:
        raise ValueError(f"muon_blocks for {name}: sizes {sizes} sum to {sum(sizes)}, dim {dim} has {shape[dim]}")
    return Blocks(dim, sizes)


def _head_dim_of(model: nn.Module, raw_name: str) -> int | None:
    parts = raw_name.split(".")[:-1]
    while parts:
        parts.pop()
        mod = model.get_submodule(".".join(parts)) if parts else model
        hd = getattr(mod, "head_dim", None)
        if isinstance(hd, int):
            return hd
    return None


def route_parameters(model: nn.Module, cfg) -> list[Route]:
    """One :class:`Route` per trainable parameter of ``model`` (``cfg``: ``optim.config.Optimizer``)."""
    hint_groups, hint_blocks, hint_heads = _module_hints(model)
    pats = [(g, [re.compile(p) for p in getattr(cfg, f"{g}_patterns")]) for g in ("embed", "head", "norm", "vector")]
    per_head = [re.compile(p) for p in cfg.muon_per_head_patterns]
    warm = [re.compile(p) for p in cfg.lr_warmup_patterns]
    mults = parse_lr_mults(cfg.lr_mult_patterns)
    routes = []
    for raw, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = clean_name(raw)
        if getattr(p, "_optim", None) is not None:
            group, reason = _hint_group(p._optim, f"{name}._optim"), "hint"
        elif name in hint_groups:
            group, reason = _hint_group(hint_groups[name], f"optim_hints[{name!r}]"), "hint"
        else:
            group, reason = _route_by_rules(name, p, pats, cfg.muon_min_dim)
        blocks = None
        if group == "matrix":
            if p.ndim != 2:
                raise ValueError(f"{name} has shape {tuple(p.shape)}; only 2-D parameters can go to 'matrix'")
            if cfg.muon_per_head and (name in hint_heads or any(r.search(name) for r in per_head)):
                hd = hint_heads.get(name) or _head_dim_of(model, raw)
                if hd:
                    if p.shape[0] % hd:
                        raise ValueError(f"{name}: {p.shape[0]} rows are not a multiple of head size {hd}")
                    blocks = Blocks(0, (hd,) * (p.shape[0] // hd))
            if blocks is None and name in hint_blocks:
                blocks = _blocks(hint_blocks[name], p.shape, name)
        lr_mult = next(((r.pattern, m) for r, m in mults if r.search(name)), None)
        routes.append(Route(name, p, group, reason, blocks, any(r.search(name) for r in warm), lr_mult))
    _check_routes(model, routes)
    return routes


def _route_by_rules(name: str, p: torch.Tensor, pats, min_dim: int) -> tuple[str, str]:
    for group, regexes in pats:
        for r in regexes:
            if r.search(name):
                return group, f"/{r.pattern}/"
    if p.ndim != 2:
        return "vector", f"{p.ndim}-D"
    if min(p.shape) < min_dim:
        return "vector", f"side {min(p.shape)} < muon_min_dim"
    return "matrix", "2-D hidden"


def _check_routes(model: nn.Module, routes: list[Route]) -> None:
    seen = {}
    for r in routes:
        assert id(r.param) not in seen, f"{r.name} routed twice (also as {seen[id(r.param)]})"
        seen[id(r.param)] = r.name
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == set(seen), "every trainable parameter must land in exactly one group"


def format_routing_table(routes: list[Route], lr: dict[str, float], wd: dict[str, float], opt: dict[str, str]) -> str:
    """Compact table: layer indices collapsed to ``*``; one row per (name pattern, shape, group)."""
    rows: OrderedDict = OrderedDict()
    for r in routes:
        key = (re.sub(r"(?<=\.)\d+(?=\.)", "*", r.name), tuple(r.param.shape), r.group_key, r.reason, r.blocks)
        rows[key] = rows.get(key, 0) + 1
    head = ("parameter", "n", "shape", "group", "optimizer", "lr", "wd", "blocks", "why")
    lines = [head]
    for (name, shape, gk, reason, blocks), n in rows.items():
        b = "" if blocks is None else f"{len(blocks.sizes)}x dim{blocks.dim}"
        lines.append((name, str(n), "x".join(map(str, shape)), gk, opt[gk], f"{lr[gk]:.3g}", f"{wd[gk]:.3g}", b, reason))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
