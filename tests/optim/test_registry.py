"""The optimizer registry: names, the one-line error for an unknown name, every role stepped once, a new optimizer
added by registration alone."""

import pytest
import torch
from torch import nn

import attnlab.optim.registry as registry
from attnlab.config import DEFAULT_CONFIG, parse_config
from attnlab.optim.build import build_optimizers
from attnlab.optim.config import ROLES, Optimizer
from attnlab.optim.registry import REGISTRY, RoleSettings, Stepper, register_optimizer, steppers

UNKNOWN = "optimizer.name='sgd' is not registered; choose from ['adam', 'adamw', 'muon']"


class Tiny(nn.Module):
    """One parameter of each role."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(40, 24)
        self.wq = nn.Linear(24, 32, bias=False)
        self.gate = nn.Linear(24, 4)
        self.norm = nn.RMSNorm(24)
        self.output = nn.Linear(24, 40, bias=False)


def test_registered_names_and_any_case():
    assert sorted(REGISTRY) == ["adam", "adamw", "muon"]
    for name in ("AdamW", "MUON", "Adam"):
        opt = build_optimizers([Tiny()], Optimizer(name=name))
        assert sum(len(g["params"]) for o in opt.optimizers for g in o.param_groups) == 6


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_role_stepped_once(name):
    roles = [r for s in steppers(Optimizer(name=name)) for r in s.roles]
    assert sorted(roles) == sorted(ROLES)


def test_unknown_name_is_one_line_naming_the_key():
    with pytest.raises(ValueError) as e:
        build_optimizers([Tiny()], Optimizer(name="sgd"))
    assert str(e.value) == UNKNOWN
    with pytest.raises(ValueError) as e:  # the trainer's preflight: before anything is built
        parse_config(["--job.config_file", DEFAULT_CONFIG, "--optimizer.name", "sgd"])
    assert str(e.value) == UNKNOWN


def _sgd(cfg, roles=ROLES) -> list[Stepper]:
    def make(param_groups, routes):
        return torch.optim.SGD(param_groups, lr=cfg.lr, momentum=0.9)

    return [Stepper({r: RoleSettings(cfg.lr * (0.5 if r == "norm" else 1.0), 0.0) for r in roles}, make)]


def test_new_optimizer_by_registration(monkeypatch):
    monkeypatch.setattr(registry, "REGISTRY", dict(REGISTRY))
    register_optimizer("sgd")(_sgd)
    opt = build_optimizers([Tiny()], Optimizer(name="SGD", lr=0.1))
    assert [type(o).__name__ for o in opt.optimizers] == ["SGD"]
    groups = {g["name"]: g["lr"] for g in opt.optimizers[0].param_groups}
    assert groups == {"embed": 0.1, "matrix": 0.1, "vector": 0.1, "norm": 0.05, "head": 0.1}
    with pytest.raises(ValueError, match="registered once"):
        register_optimizer("sgd")(_sgd)


def test_a_role_without_stepper_is_an_error(monkeypatch):
    monkeypatch.setattr(registry, "REGISTRY", dict(REGISTRY))
    register_optimizer("partial")(lambda cfg: _sgd(cfg, roles=("matrix", "embed")))
    with pytest.raises(TypeError, match="'partial' steps the roles"):
        build_optimizers([Tiny()], Optimizer(name="partial"))
