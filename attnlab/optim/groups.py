"""Give every parameter a role, the optimizer-independent kind of tensor it is; the optimizer (:mod:`optim.registry`)
maps roles to its param groups.

Roles (:data:`optim.config.ROLES`): "matrix" (2-D hidden weights), "embed" (token embeddings), "head" (an untied LM
head), "norm" (norm gains) and "vector" (everything that is not a hidden matrix: biases, gates and decay parameters,
depthwise conv kernels, thin low-rank factors, scalars).

Precedence, first match wins:
1. declared by a module: attribute ``param_roles = {"<name relative to the module>": "<role>"}``, where a key names
   a parameter or a submodule (all its parameters; the longest key wins). Declared by name, a role survives FSDP2
   re-wrapping the parameters;
2. a parameter of a normalisation layer (:data:`NORM_LAYERS`: its gain and bias) → "norm", whatever its name;
3. ``embed_patterns``, ``head_patterns``, ``norm_patterns``, ``vector_patterns`` (``re.search`` on the name,
   with ``_orig_mod.`` / ``_checkpoint_wrapped_module.`` wrappers stripped);
4. not 2-D → "vector"; 2-D with a side < ``muon_min_dim`` → "vector";
5. otherwise "matrix".

A parameter's param group is named after its role. Independently of the role, ``lr_mult_patterns`` ("REGEX=MULT",
first match wins) give a parameter its own lr = optimizer.lr × MULT, in its own param group "<role>[REGEX]" (see
:func:`parse_lr_mults`), and ``lr_warmup_patterns`` an extra warmup, in "<role>_warmup".

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

from attnlab.optim.config import ROLES
from attnlab.optim.muon import Blocks

_WRAPPERS = re.compile(r"(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")


def clean_name(name: str) -> str:
    """Parameter name without torch.compile / activation-checkpoint wrapper segments."""
    return _WRAPPERS.sub("", name)


@dataclass
class Route:
    name: str
    param: nn.Parameter
    role: str
    reason: str
    blocks: Blocks | None = None
    warmup: bool = False
    lr_mult: tuple[str, float] | None = None  # (pattern, multiplier of optimizer.lr) from lr_mult_patterns

    @property
    def group(self) -> str:
        """Param-group name: the role, "[pattern]" for an lr_mult_patterns match, "_warmup" for the extra warmup."""
        return self.role + (f"[{self.lr_mult[0]}]" if self.lr_mult else "") + ("_warmup" if self.warmup else "")


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


def _module_dicts(model: nn.Module, attr: str) -> dict[str, tuple[object, str]]:
    """Every module's dict attribute ``attr`` (keyed by names relative to the module) merged under full names
    (wrappers stripped): {name: (value, where it is declared)}."""
    out = {}
    for mname, mod in model.named_modules():
        prefix = clean_name(mname + ".") if mname else ""
        for rel, value in (getattr(mod, attr, None) or {}).items():
            out[prefix + rel] = (value, f"{type(mod).__name__}.{attr}[{rel!r}]")
    return out


def _declared_key(name: str, declared: dict) -> str | None:
    """The longest declared key that is ``name`` or a dotted prefix of it (None if none is)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in declared:
            return key
    return None


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


NORM_LAYERS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
"""Modules whose parameters have the role "norm" by their type (rule 2 of the module docstring)."""


def route_parameters(model: nn.Module, cfg) -> list[Route]:
    """One :class:`Route` per trainable parameter of ``model`` (``cfg``: ``optim.config.Optimizer``)."""
    declared = _module_dicts(model, "param_roles")
    for role, where in declared.values():
        if role not in ROLES:
            raise ValueError(f"{where}={role!r}; choose from {list(ROLES)}")
    hint_blocks = {k: v for k, (v, _) in _module_dicts(model, "muon_blocks").items()}
    hint_heads = {k: v for k, (v, _) in _module_dicts(model, "muon_heads").items()}
    pats = [(r, [re.compile(p) for p in getattr(cfg, f"{r}_patterns")]) for r in ("embed", "head", "norm", "vector")]
    per_head = [re.compile(p) for p in cfg.muon_per_head_patterns]
    warm = [re.compile(p) for p in cfg.lr_warmup_patterns]
    mults = parse_lr_mults(cfg.lr_mult_patterns)
    norm_layers = {name for name, m in model.named_modules() if isinstance(m, NORM_LAYERS)}
    routes, used = [], set()
    for raw, p in model.named_parameters():
        name = clean_name(raw)
        key = _declared_key(name, declared)
        used.add(key)
        if not p.requires_grad:
            continue
        if key is not None:
            role, reason = declared[key][0], "declared"
        elif raw.rpartition(".")[0] in norm_layers:
            role, reason = "norm", "normalisation layer"
        else:
            role, reason = _route_by_rules(name, p, pats, cfg.muon_min_dim)
        blocks = None
        if role == "matrix":
            if p.ndim != 2:
                raise ValueError(f"{name} has shape {tuple(p.shape)}; only 2-D parameters can have the role 'matrix'")
            if cfg.muon_per_head and (name in hint_heads or any(r.search(name) for r in per_head)):
                hd = hint_heads.get(name) or _head_dim_of(model, raw)
                if hd:
                    if p.shape[0] % hd:
                        raise ValueError(f"{name}: {p.shape[0]} rows are not a multiple of head size {hd}")
                    blocks = Blocks(0, (hd,) * (p.shape[0] // hd))
            if blocks is None and name in hint_blocks:
                blocks = _blocks(hint_blocks[name], p.shape, name)
        lr_mult = next(((r.pattern, m) for r, m in mults if r.search(name)), None)
        routes.append(Route(name, p, role, reason, blocks, any(r.search(name) for r in warm), lr_mult))
    unused = sorted({declared[k][1] for k in set(declared) - used})
    if unused:
        raise ValueError(f"{', '.join(unused)}: names no parameter of its module")
    _check_routes(model, routes)
    return routes


def _route_by_rules(name: str, p: torch.Tensor, pats, min_dim: int) -> tuple[str, str]:
    for role, regexes in pats:
        for r in regexes:
            if r.search(name):
                return role, f"/{r.pattern}/"
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
    assert trainable == set(seen), "every trainable parameter must have exactly one role"


def format_routing_table(routes: list[Route], lr: dict[str, float], wd: dict[str, float], opt: dict[str, str]) -> str:
    """Compact table: layer indices collapsed to ``*``; one row per (name pattern, shape, group)."""
    rows: OrderedDict = OrderedDict()
    for r in routes:
        key = (re.sub(r"(?<=\.)\d+(?=\.)", "*", r.name), tuple(r.param.shape), r.group, r.reason, r.blocks)
        rows[key] = rows.get(key, 0) + 1
    head = ("parameter", "n", "shape", "group", "optimizer", "lr", "wd", "blocks", "why")
    lines = [head]
    for (name, shape, gk, reason, blocks), n in rows.items():
        b = "" if blocks is None else f"{len(blocks.sizes)}x dim{blocks.dim}"
        lines.append((name, str(n), "x".join(map(str, shape)), gk, opt[gk], f"{lr[gk]:.3g}", f"{wd[gk]:.3g}", b, reason))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
