"""Parameter roles: expected-role tables for the Qwen3 names and every registered mechanism, declared roles, blocks."""

import re

import pytest
import torch
from torch import nn

from attnlab import attention  # noqa: F401  (registers every mechanism)
from attnlab.attention.base import AttentionArgs
from attnlab.attention.registry import REGISTRY
from attnlab.optim.build import build_optimizers
from attnlab.optim.config import Optimizer
from attnlab.optim.groups import route_parameters
from attnlab.optim.muon import Blocks

ARGS = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), nn.Linear(dim, hidden, bias=False)


class Block(nn.Module):
    def __init__(self, attn: nn.Module, dim: int):
        super().__init__()
        self.attention, self.feed_forward = attn, FeedForward(dim, 3 * dim)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)


class TinyQwen(nn.Module):
    """The model's parameter names (tok_embeddings, layers.<i>.{attention,feed_forward,*_norm}, norm, output)."""

    def __init__(self, attns: list[nn.Module], dim: int = 64, vocab: int = 100, tied: bool = True):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(a, dim) for i, a in enumerate(attns)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight


def _mech(name: str, **opts) -> nn.Module:
    m = REGISTRY[name]
    return m.cls(AttentionArgs(**ARGS, impl="auto"), m.options(**opts))


def _roles(model, **cfg) -> dict[str, str]:
    return {r.name: r.role for r in route_parameters(model, Optimizer(**cfg))}


QWEN_PARALLAX_GATED = {
    "tok_embeddings.weight": "embed",
    **{f"layers.0.attention.{w}.weight": "matrix" for w in ("wq", "wk", "wv", "wo", "wr")},
    **{f"layers.0.attention.{n}.weight": "norm" for n in ("q_norm", "k_norm", "r_norm")},
    "layers.0.attention.r_gate.weight": "vector",  # [H, dim]: one gate vector per head
    "layers.0.attention.r_gate.bias": "vector",
    **{f"layers.0.feed_forward.{w}.weight": "matrix" for w in ("w1", "w2", "w3")},
    "layers.0.attention_norm.weight": "norm",
    "layers.0.ffn_norm.weight": "norm",
    "norm.weight": "norm",
}


def test_qwen_parallax_table_tied():
    assert _roles(TinyQwen([_mech("parallax", rho_gate=True)])) == QWEN_PARALLAX_GATED


def test_qwen_untied_head():
    g = _roles(TinyQwen([_mech("softmax")], tied=False))
    assert g["output.weight"] == "head" and g["tok_embeddings.weight"] == "embed"


# Expected role of each parameter of each mechanism (names relative to the attention module). Mechanisms
# registered later get the property checks of test_every_registered_mechanism only.
MECHANISM_TABLES = {
    "softmax": {"wq.weight": "matrix", "wk.weight": "matrix", "wv.weight": "matrix", "wo.weight": "matrix",
                "q_norm.weight": "norm", "k_norm.weight": "norm"},
    "linear": {"q_proj.weight": "matrix", "k_proj.weight": "matrix", "v_proj.weight": "matrix",
               "o_proj.weight": "matrix", "o_norm.weight": "norm"},
    "gla": {"q_proj.weight": "matrix", "k_proj.weight": "matrix", "v_proj.weight": "matrix",
            "o_proj.weight": "matrix", "out_gate.weight": "matrix", "o_norm.weight": "norm",
            "gk_proj.0.weight": "vector", "gk_proj.1.weight": "vector", "gk_proj.1.bias": "vector"},
    "gated_linear": {"A_log": "vector", "dt_bias": "vector", "q_proj.weight": "matrix", "k_proj.weight": "matrix",
                     "v_proj.weight": "matrix", "o_proj.weight": "matrix", "out_gate.weight": "matrix",
                     "convs.q.weight": "vector", "convs.k.weight": "vector", "convs.v.weight": "vector",
                     "o_norm.weight": "norm", "a_proj.weight": "vector"},
}


@pytest.mark.parametrize("name", sorted(MECHANISM_TABLES))
def test_mechanism_table(name):
    if name not in REGISTRY:
        pytest.skip(f"{name} is not registered")
    got = {k.removeprefix("layers.0.attention."): v for k, v in _roles(TinyQwen([_mech(name)])).items()
           if k.startswith("layers.0.attention.")}
    assert got == MECHANISM_TABLES[name]


TRAPS = re.compile(r"conv|A_log|dt_bias|bias$|norm")


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_mechanism(name):
    """Muon gets only 2-D matrices with both sides >= 16 and never a conv / A_log / dt_bias / bias / norm."""
    model = TinyQwen([_mech(name)])
    opt = build_optimizers([model], Optimizer(name="muon"))
    muon = {id(p) for o in opt.optimizers if type(o).__name__ == "Muon" for g in o.param_groups for p in g["params"]}
    for r in opt.routes:
        if id(r.param) in muon:
            assert r.param.ndim == 2 and min(r.param.shape) >= 16, r.name
            assert not TRAPS.search(r.name), r.name
    n_opt = sum(len(g["params"]) for o in opt.optimizers for g in o.param_groups)
    assert n_opt == len(list(model.parameters())) == len(opt.routes)


class Fused(nn.Module):
    """A mechanism author's view: fused q|k|v, a gate (a submodule) and a 2-D mixing matrix declared by role."""

    def __init__(self):
        super().__init__()
        self.head_dim = 8
        self.qkv = nn.Linear(32, 32 + 16 + 16, bias=False)
        self.beta = nn.Linear(32, 32)
        self.mix = nn.Parameter(torch.zeros(32, 32))
        self.param_roles = {"beta": "vector", "mix": "norm"}
        self.muon_blocks = {"qkv.weight": [32, 16, 16]}
        self.muon_heads = {"qkv.weight": 8}


def test_declared_roles_and_blocks():
    model = nn.ModuleDict({"f": Fused()})
    routes = {r.name: r for r in route_parameters(model, Optimizer())}
    assert routes["f.beta.weight"].role == "vector" and routes["f.beta.weight"].reason == "declared"
    assert routes["f.beta.bias"].role == "vector" and routes["f.beta.bias"].reason == "declared"
    assert routes["f.mix"].role == "norm"
    assert routes["f.qkv.weight"].role == "matrix"
    assert routes["f.qkv.weight"].blocks == Blocks(0, (32, 16, 16))
    per_head = {r.name: r for r in route_parameters(model, Optimizer(muon_per_head=True))}
    assert per_head["f.qkv.weight"].blocks == Blocks(0, (8,) * 8)


def test_longest_declaration_wins_and_per_head_default():
    model = TinyQwen([_mech("parallax")])
    model.layers["0"].param_roles = {"feed_forward": "vector"}
    model.layers["0"].feed_forward.param_roles = {"w2.weight": "matrix"}
    routes = {r.name: r for r in route_parameters(model, Optimizer(muon_per_head=True))}
    assert routes["layers.0.feed_forward.w1.weight"].role == "vector"
    assert routes["layers.0.feed_forward.w2.weight"].role == "matrix"
    model.layers["0"].param_roles = {}
    routes = {r.name: r for r in route_parameters(model, Optimizer(muon_per_head=True))}
    for w, heads in (("wq", 4), ("wk", 2), ("wv", 2), ("wr", 4)):  # head_dim 16 from the attention module
        assert routes[f"layers.0.attention.{w}.weight"].blocks == Blocks(0, (16,) * heads)
    assert routes["layers.0.attention.wo.weight"].blocks is None
    assert routes["layers.0.feed_forward.w1.weight"].blocks is None


def test_warmup_groups_and_table():
    model = TinyQwen([_mech("parallax")])
    opt = build_optimizers([model], Optimizer(name="muon", lr=5e-3, lr_warmup_patterns=[r"\.wr\."], lr_warmup_steps=5))
    names = [g["name"] for o in opt.optimizers for g in o.param_groups]
    assert names == ["matrix", "matrix_warmup", "embed", "norm"]
    warm = [g for o in opt.optimizers for g in o.param_groups if g["name"] == "matrix_warmup"][0]
    assert warm["lr_warmup_steps"] == 5 and len(warm["params"]) == 1
    table = opt.routing_table()
    assert "layers.*.attention.wr.weight" in table and "matrix_warmup" in table


@pytest.mark.parametrize("name,norm_lr", [("muon", 0.015 * 5e-3), ("adamw", 5e-3)])
def test_lr_mult_pattern_only_for_r_norm(name, norm_lr):
    """`\.r_norm\.=1` puts only the ρ-norm gains in their own group at 1× optimizer.lr; q/k and block norms keep
    the norm group's lr; the group name reaches the routing table and the per-group lr log."""
    model = TinyQwen([_mech("parallax"), _mech("parallax")])
    opt = build_optimizers([model], Optimizer(name=name, lr=5e-3, lr_mult_patterns=[r"\.r_norm\.=1"]))
    groups = {g["name"]: g for o in opt.optimizers for g in o.param_groups}
    rho = groups[r"norm[\.r_norm\.]"]
    assert rho["lr"] == pytest.approx(5e-3) and rho["weight_decay"] == 0.0
    assert {id(p) for p in rho["params"]} == {id(model.layers[i].attention.r_norm.weight) for i in "01"}
    assert groups["norm"]["lr"] == pytest.approx(norm_lr)
    assert id(model.layers["0"].attention.q_norm.weight) in {id(p) for p in groups["norm"]["params"]}
    row = [ln.split() for ln in opt.routing_table().splitlines() if ln.startswith("layers.*.attention.r_norm.")]
    assert row and row[0][:4] == ["layers.*.attention.r_norm.weight", "2", "16", r"norm[\.r_norm\.]"]
    assert float(row[0][5]) == pytest.approx(5e-3)
    assert opt.lr_wd()[r"lr/norm[\.r_norm\.]"] == pytest.approx(5e-3)


def test_lr_mult_default_unchanged_and_bad_values():
    model = TinyQwen([_mech("parallax")])
    names = [g["name"] for o in build_optimizers([model], Optimizer(name="muon")).optimizers for g in o.param_groups]
    assert names == ["matrix", "embed", "norm"]
    for bad in ("r_norm", "r_norm=x", "=1", "r_norm=-1", "r_norm=nan", "(=1"):
        with pytest.raises(ValueError, match=r"optimizer.lr_mult_patterns\[0\]"):
            route_parameters(model, Optimizer(lr_mult_patterns=[bad]))


# (group, lr, weight decay) per group: Muon recipe (Table 2b) and AdamW (wd off for norms / vectors)
LR_WD = {
    "muon": {"matrix": (5e-3, 0.1), "embed": (1.5e-3, 0.1), "norm": (7.5e-5, 0.0), "vector": (5e-3, 0.0)},
    "adamw": {"matrix": (3e-4, 0.1), "embed": (3e-4, 0.0), "norm": (3e-4, 0.0), "vector": (3e-4, 0.0)},
}


@pytest.mark.parametrize("name", list(LR_WD))
def test_group_lr_wd(name):
    model = TinyQwen([_mech("parallax", rho_gate=True)])
    cfg = Optimizer(name=name, lr=5e-3 if name == "muon" else 3e-4, weight_decay=0.1, embed_weight_decay=name == "muon")
    opt = build_optimizers([model], cfg)
    vals = opt.lr_wd()
    for g, (lr, wd) in LR_WD[name].items():
        assert vals[f"lr/{g}"] == pytest.approx(lr) and vals[f"wd/{g}"] == pytest.approx(wd), g
    kinds = {g["name"]: type(o).__name__ for o in opt.optimizers for g in o.param_groups}
    assert kinds["matrix"] == ("Muon" if name == "muon" else "AdamW")
    adam = [o for o in opt.optimizers if type(o).__name__ == "AdamW"][0]
    assert adam.defaults["betas"] == ((0.8, 0.95) if name == "muon" else (0.9, 0.95))
    assert adam.defaults["eps"] == (1e-7 if name == "muon" else 1e-8)


@pytest.mark.parametrize(
    "cfg,match",
    [
        (dict(name="sgd"), "optimizer.name"),
        (dict(name="muon", muon_update_scale="rms"), "optimizer.muon_update_scale"),
        (dict(name="muon", muon_ns_dtype="fp8"), "optimizer.muon_ns_dtype"),
        (dict(name="muon", early_step_in_backward=True), "optimizer.early_step_in_backward"),
    ],
)
def test_config_errors(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_optimizers([TinyQwen([_mech("softmax")])], Optimizer(**cfg))


def test_bad_declarations():
    model = nn.Linear(32, 32)
    model.param_roles = {"weight": "adam"}
    with pytest.raises(ValueError, match=r"Linear.param_roles\['weight'\]='adam'; choose from \['matrix', "):
        route_parameters(model, Optimizer())
    model.param_roles = {"bias": "matrix"}
    with pytest.raises(ValueError, match="only 2-D"):
        route_parameters(model, Optimizer())
    model.param_roles = {"wieght": "vector"}
    with pytest.raises(ValueError, match=r"Linear.param_roles\['wieght'\]: names no parameter of its module"):
        route_parameters(model, Optimizer())


def test_declared_role_survives_new_parameter_objects():
    """FSDP2 and ``to_empty`` replace the parameter objects: a role declared by name still applies. KDA's low-rank
    output gate (16 x 64 here, both sides >= muon_min_dim) would otherwise be a "matrix"."""
    attn = _mech("kda")
    model = TinyQwen([attn])
    for lin in attn.g_proj:
        lin.weight = nn.Parameter(lin.weight.detach().clone())
    roles = _roles(model)
    assert roles["layers.0.attention.g_proj.0.weight"] == "vector"
    attn.param_roles = {}
    assert _roles(model)["layers.0.attention.g_proj.0.weight"] == "matrix"


def test_normalisation_layers_are_norms_by_type():
    """A LayerNorm's gain and bias are norms whatever the module calls them (CALA's q_ln / k_ln), so they train at
    the norm group's lr and without weight decay like every other mechanism's norms."""
    roles = _roles(TinyQwen([_mech("cala")]))
    assert {k: v for k, v in roles.items() if "_ln." in k} == {
        f"layers.0.attention.{n}.{w}": "norm" for n in ("q_ln", "k_ln") for w in ("weight", "bias")}
