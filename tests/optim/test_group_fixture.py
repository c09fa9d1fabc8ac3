"""Every parameter of every registered mechanism at the debug size lands in the recorded optimizer group.

``group_fixture.json`` holds, for each mechanism (and the option variants that add or drop parameters), the
param group of every parameter (layer indices collapsed to ``*``; every layer must agree), each group's torch
optimizer, lr, weight decay and extra warmup, the order of the optimizers and of their groups, Muon's per-head
blocks and each torch optimizer's defaults, under ``muon``, ``adamw`` and ``adam`` with the default routing keys and
with lr_mult_patterns / lr_warmup_patterns / muon_per_head set. The model is built as the trainer builds it (meta
device, ``to_empty``, ``init_weights``). Regenerate (only for an intended change of the groups) with
``python -m tests.optim.test_group_fixture``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from attnlab import attention  # noqa: F401  (registers every mechanism)
from attnlab.attention.registry import REGISTRY
from attnlab.models.args import get_flavor
from attnlab.models.model import Transformer
from attnlab.optim.build import build_optimizers
from attnlab.optim.config import Optimizer

FIXTURE = Path(__file__).with_name("group_fixture.json")

ROUTING = {
    "default": {},
    "patterned": dict(lr_mult_patterns=[r"\.r_norm\.=1", r"\.q_norm\.=0.5", r"^norm\.=2"],
                      lr_warmup_patterns=[r"\.wr\.", r"feed_forward\.w2\."], lr_warmup_steps=5, muon_per_head=True),
}
OPTIMIZERS = {
    "muon": dict(name="muon", lr=0.02, weight_decay=0.1),
    "adamw": dict(name="AdamW", lr=3e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, embed_weight_decay=False),
    "adam": dict(name="adam", lr=1e-3, weight_decay=0.01),
}
# Option variants that change which parameters a mechanism has; every registered mechanism also runs with defaults.
VARIANTS = {
    "softmax+untied": ("softmax", {}, False),
    "parallax+rho_gate": ("parallax", {"rho_gate": True}, True),
    "fox+pro": ("fox", {"pro": True}, True),
    "path+forget_gate": ("path", {"use_forget_gate": True}, True),
    "path+full_rank_w": ("path", {"use_low_rank_w": False, "use_w_shortconv": False}, True),
    "gla+short_conv": ("gla", {"use_short_conv": True}, True),
    "gated_linear+logsigmoid": ("gated_linear", {"gate": "logsigmoid"}, True),
    "gated_linear+retnet": ("gated_linear", {"gate": "retnet", "output_gate": False}, True),
    "linear+conv_gate": ("linear", {"use_short_conv": True, "output_gate": True}, True),
    "deltanet+output_gate": ("deltanet", {"use_output_gate": True}, True),
    "gdn+no_conv": ("gdn", {"use_short_conv": False}, True),
    "kda+no_output_gate": ("kda", {"use_output_gate": False}, True),
    "kda+lower_bound": ("kda", {"gate_lower_bound": -5.0}, True),
    "hla+fixed_gate": ("hla", {"decay": "fixed", "output_gate": True}, True),
    "lla+token_lambda": ("lla", {"lambda_mode": "token"}, True),
    "mesa+token_lambda": ("mesa", {"lambda_mode": "token"}, True),
}


def _variants() -> dict[str, tuple[str, dict, bool]]:
    return {**{name: (name, {}, True) for name in sorted(REGISTRY)}, **VARIANTS}


def _model(mechanism: str, opts: dict, tied: bool) -> torch.nn.Module:
    args = dataclasses.replace(get_flavor("debug"), attention=mechanism, enable_weight_tying=tied,
                               attention_options={mechanism: REGISTRY[mechanism].options(**opts)})
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model


def _collapse(name: str) -> str:
    return re.sub(r"^layers\.\d+\.", "layers.*.", name)


def _merge(out: dict, key: str, value, what: str) -> None:
    assert out.setdefault(key, value) == value, f"{what} {key}: {out[key]} and {value} differ"


ATTN = "layers.*.attention."


def record(model: torch.nn.Module, routing: str, optimizer: str) -> dict:
    """What :func:`optim.build.build_optimizers` makes of ``model``: the group of every parameter (names with layer
    indices collapsed), each group's settings, Muon's blocks, the optimizers' order and defaults."""
    opt = build_optimizers([model], Optimizer(**ROUTING[routing], **OPTIMIZERS[optimizer]))
    names = {id(p): _collapse(n) for n, p in model.named_parameters()}
    params, groups, blocks, order, defaults = {}, {}, {}, [], {}
    for o in opt.optimizers:
        kind = type(o).__name__
        order.append(f"{kind}:{','.join(g['name'] for g in o.param_groups)}")
        _merge(defaults, kind, {k: v for k, v in o.defaults.items() if k not in ("lr", "weight_decay")}, "defaults")
        for g in o.param_groups:
            _merge(groups, g["name"], [kind, g["lr"], g["weight_decay"], g.get("lr_warmup_steps", 0)], "group")
            for p in g["params"]:
                _merge(params, names[id(p)], g["name"], "parameter")
        for p, b in getattr(o, "blocks", {}).items():
            _merge(blocks, names[id(p)].removeprefix(ATTN), [b.dim, list(b.sizes)], "blocks")
    assert set(params) == set(names.values()), "every parameter lands in a group"
    return dict(params=params, groups=groups, blocks=blocks, order="|".join(order), defaults=defaults)


def _by_group(params: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, group in sorted(params.items()):
        out.setdefault(group, []).append(name)
    return out


def compute() -> dict:
    """The fixture's content. ``attention``: the attention module's parameters (names relative to it) per variant;
    ``model``: the rest of the model (the same for every mechanism), tied and untied."""
    out = {"routing": ROUTING, "optimizers": OPTIMIZERS, "attention": {}, "model": {}, "blocks": {}, "groups": {},
           "order": {}, "defaults": {}}
    for variant, (mechanism, opts, tied) in _variants().items():
        model = _model(mechanism, opts, tied)
        for routing in ROUTING:
            for optimizer in OPTIMIZERS:
                r, key = record(model, routing, optimizer), f"{routing}/{optimizer}"
                attn = {n.removeprefix(ATTN): g for n, g in r["params"].items() if n.startswith(ATTN)}
                rest = {n: g for n, g in r["params"].items() if not n.startswith(ATTN)}
                _merge(out["attention"].setdefault(routing, {}), variant, _by_group(attn), "attention of")
                _merge(out["model"].setdefault(routing, {}), "tied" if tied else "untied", _by_group(rest), "model")
                if r["blocks"]:
                    _merge(out["blocks"].setdefault(key, {}), variant, r["blocks"], "blocks of")
                for group, settings in r["groups"].items():
                    _merge(out["groups"].setdefault(key, {}), group, settings, "group")
                out["order"].setdefault(key, {}).setdefault(r["order"], []).append(variant)
                for kind, d in r["defaults"].items():
                    _merge(out["defaults"].setdefault(optimizer, {}), kind, d, "defaults")
    return json.loads(json.dumps(out))  # tuples as lists, as read back from the file


@pytest.fixture(scope="module")
def current() -> dict:
    return compute()


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads(FIXTURE.read_text())


def test_fixture_covers_every_registered_mechanism(expected):
    for routing in ROUTING:
        assert set(REGISTRY) <= set(expected["attention"][routing]), "regenerate the fixture for a new mechanism"


@pytest.mark.parametrize("section", ["attention", "model", "blocks", "groups", "order", "defaults"])
def test_groups_match_fixture(current, expected, section):
    assert current[section] == expected[section]


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
