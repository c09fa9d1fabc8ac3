"""Valid values of a configuration key, declared next to the key as a short rule in words.

A field of our dataclasses declares its rule in its metadata, which needs no import (the mechanism modules and
``attnlab/optim/config.py`` sit below this layer) and leaves tyro's ``--help`` and the field docstrings as they are::

    chunk_size: int = field(default=64, metadata={"valid": ">= 1"})
    '''Chunk length of the chunked path.'''

torchtitan's own fields, which we cannot edit, get theirs from one table (``checks.TITAN_RULES``). The rule is what
an error prints: ``attention.gla.chunk_size=0: must be >= 1``.

Grammar: alternatives joined by `` or ``, each a conjunction of atoms joined by `` and ``; text after ``; `` is an
explanation printed with the error. Atoms:

- ``> N``, ``>= N``, ``< N``, ``<= N``; a bare number ``N`` (equal to it); ``in [a, b)`` (any bracket pair)
- ``one of a, b, c`` (the value's text is one of them; the last alternative of a rule)
- ``empty``, ``non-empty`` (a string or list)
- ``existing path``, ``existing file``, ``existing folder``, ``not a file`` (a folder, or nothing there yet)
- ``multiple of KEY``, ``divides KEY``: against another key's value; 0 there (the flavor's) skips the atom, the
  model built at preflight checks the resolved sizes
- a named check of :data:`NAMED` (``a registered mechanism``, ``a regex``, ...)
- ``any: WHY``: every value of the annotated type is valid, for the reason given

A rule applies to each item of a list value (the error names ``key[i]``); None (an optional key left unset)
passes, as do NaN and ±inf nowhere: a number must be finite.
"""

from __future__ import annotations

import math
import operator
import os
import re
from typing import Callable

_CMP = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_NUM = r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|\.\d+)"
_INTERVAL = re.compile(rf"in ([\[(])\s*({_NUM}),\s*({_NUM})\s*([\])])$")


def _regex(value, key) -> bool:
    try:
        re.compile(value)
    except (re.error, TypeError):
        return False
    return True


def _mechanism(value, key) -> bool:
    from attnlab.attention.registry import get_mechanism

    get_mechanism(value, key)  # its error names the registered ones
    return True


def _optimizer(value, key) -> bool:
    from attnlab.optim.registry import get_optimizer

    get_optimizer(value, key)  # its error names the key and the registered ones
    return True


def _lr_mult(value, key) -> bool:
    from attnlab.optim.groups import parse_lr_mults

    try:
        parse_lr_mults([value])
    except ValueError:
        return False
    return True


def _ns_coefficients(value, key) -> bool:
    from attnlab.optim.muon import resolve_ns_coefficients

    try:
        resolve_ns_coefficients(value, 1)
    except (ValueError, TypeError, IndexError):
        return False
    return True


def _positive_int_text(value, key) -> bool:
    return isinstance(value, str) and value.isdigit() and int(value) > 0


NAMED: dict[str, Callable[[object, str], bool]] = {
    "a registered mechanism": _mechanism,
    "a registered optimizer": _optimizer,
    "a regex": _regex,
    "'REGEX=MULT' (a regex, a finite MULT >= 0)": _lr_mult,
    "quintic, polar_express or triples 'a,b,c;a,b,c'": _ns_coefficients,
    "a positive integer as text": _positive_int_text,
    "a power of 2": lambda v, key: isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0,
}
"""Checks with a name, for sets known only at run time (the registries) and formats a parser defines: (value,
key) -> valid; a registry's check raises its own ValueError, which names the key and the registered names."""


def _lookup(cfg, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part, None)
    return obj


def _atom(atom: str, value, cfg, key: str) -> bool:
    if atom in NAMED:
        return NAMED[atom](value, key)
    if atom.startswith("one of "):
        return str(value) in [v.strip() for v in atom[len("one of "):].split(",")]
    if atom in ("empty", "non-empty"):
        return isinstance(value, (str, list, tuple)) and (len(value) == 0) == (atom == "empty")
    if atom.endswith(("path", "file", "folder")) and atom.startswith(("existing ", "not ")):
        if not isinstance(value, str) or not value:
            return False
        return {"existing path": os.path.exists, "existing file": os.path.isfile, "existing folder": os.path.isdir,
                "not a file": lambda p: not os.path.isfile(p)}[atom](value)
    if atom.startswith(("multiple of ", "divides ")):
        other = _lookup(cfg, atom.split(" ")[-1]) if cfg is not None else None
        if not isinstance(value, int) or not isinstance(other, int) or not other or not value:
            return isinstance(value, int)
        return other % value == 0 if atom.startswith("divides") else value % other == 0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if not math.isfinite(value):
        return False
    m = _INTERVAL.match(atom)
    if m:
        lo_open, lo, hi, hi_open = m.group(1) == "(", float(m.group(2)), float(m.group(3)), m.group(4) == ")"
        return (lo < value if lo_open else lo <= value) and (value < hi if hi_open else value <= hi)
    for op, fn in _CMP.items():
        if atom.startswith(op + " "):
            return fn(value, float(atom[len(op) + 1:]))
    if re.fullmatch(_NUM, atom):
        return value == float(atom)
    raise ValueError(f"unknown rule {atom!r}")


def parse_rule(rule: str) -> list[list[str]]:
    """``rule`` (without its explanation) as alternatives of conjunctions of atoms; ValueError on an atom this
    module cannot check, so a typo in a declaration fails every run, not only a bad value."""
    if rule.startswith("any:"):
        return []
    text = rule.split("; ")[0]
    if text in NAMED:
        return [[text]]
    head, sep, last = text.partition("one of ")
    alts = [a for a in head.split(" or ") if a] + ([sep + last] if sep else [])
    out = [[a.strip() for a in alt.split(" and ")] for alt in alts]
    for atoms in out:
        for atom in atoms:
            if not (atom in NAMED or atom.startswith(("one of ", "multiple of ", "divides ")) or atom in (
                    "empty", "non-empty", "existing path", "existing file", "existing folder", "not a file")
                    or _INTERVAL.match(atom) or re.fullmatch(_NUM, atom)
                    or any(atom.startswith(op + " ") and re.fullmatch(_NUM, atom[len(op) + 1:]) for op in _CMP)):
                raise ValueError(f"unknown rule {atom!r} in {rule!r}")
    return out


def check_value(key: str, value, rule: str, cfg=None) -> None:
    """Raise ValueError(``key=value: must be RULE``) unless ``value`` satisfies ``rule``; ``cfg`` (the job config)
    resolves the keys ``multiple of``/``divides`` name. A list is checked item by item."""
    alts = parse_rule(rule)
    if value is None:
        return
    if not alts:  # any value of the type, but a number must be finite
        items = value if isinstance(value, (list, tuple)) else [value]
        for v in items:
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{key}={value!r}: must be finite ({rule})")
        return
    if isinstance(value, (list, tuple)) and not any(a in ("empty", "non-empty") for atoms in alts for a in atoms):
        for i, item in enumerate(value):
            check_value(f"{key}[{i}]", item, rule, cfg)
        return
    if not any(all(_atom(a, value, cfg, key) for a in atoms) for atoms in alts):
        others = {a.split(" ")[-1] for atoms in alts for a in atoms if a.startswith(("multiple of ", "divides "))}
        ctx = "".join(f" ({k}={_lookup(cfg, k)!r})" for k in sorted(others)) if cfg is not None else ""
        raise ValueError(f"{key}={value!r}: must be {rule}{ctx}")


def rule_of(f) -> str | None:
    """The rule a dataclass field declares in its metadata (``{"valid": RULE}``), None without one."""
    return f.metadata.get("valid")
