"""Selective activation checkpointing keeps the project's attention forward outputs (no second forward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

from attnlab.attention.ops.delta_rule.triton import delta_rule_op
from attnlab.attention.ops.delta_rule.triton import ops as drops
from attnlab.attention.ops.parallax.triton import ops as kops
from attnlab.attention.ops.parallax.triton import parallax_triton
from attnlab.models.parallelize import sac_save_list


def test_save_list_adds_the_attention_ops():
    ops = sac_save_list()
    assert torch.ops.attnlab.parallax_fwd.default in ops
    assert torch.ops.attnlab.delta_rule_fwd.default in ops
    assert torch.ops.attnlab.lla_fwd.default in ops
    assert _op_sac_save_list <= ops  # torchtitan's list (matmuls, SDPA, varlen, flex) stays
    for name in ("affine", "gla_triton", "fla_gla", "fla_fox", "fla_path", "chunk_gla_varlen"):
        assert getattr(torch.ops.attnlab, name).default in ops, name


def test_save_list_without_attention_ops():
    """``[attention] sac_save = false``: torchtitan's list alone, so our ops' outputs are recomputed."""
    assert sac_save_list(False) == set(_op_sac_save_list)
    assert torch.ops.attnlab.delta_rule_fwd.default not in sac_save_list(False)


class _Block(nn.Module):
    """A layer whose whole forward is the Parallax custom op (Triton interpreter on a CPU)."""

    def forward(self, q, k, v, r):
        return parallax_triton(q, k, v, r)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block()})


@pytest.mark.parametrize("save_list, forwards", [(sac_save_list, 1), (lambda: _op_sac_save_list, 2)],
                         ids=["project-list", "torchtitan-list"])
def test_selective_ac_runs_the_parallax_forward_once(monkeypatch, save_list, forwards):
    """torchtitan's op-mode SAC with our list saves the op's outputs; with torchtitan's alone the backward
    recomputes the forward (the second case shows the count can fail)."""
    calls = []
    launch = kops.launch_fwd
    monkeypatch.setattr(kops, "launch_fwd", lambda *a, **kw: (calls.append(1), launch(*a, **kw))[1])
    model = _Model()
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"), op_sac_save_list=save_list())
    q, r = torch.randn(1, 20, 2, 16, requires_grad=True), torch.randn(1, 20, 2, 16, requires_grad=True)
    k, v = torch.randn(1, 20, 1, 16, requires_grad=True), torch.randn(1, 20, 1, 16, requires_grad=True)
    out = model.layers["0"](q, k, v, r)
    out.square().sum().backward()
    assert len(calls) == forwards
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v, r))


class _DeltaBlock(nn.Module):
    """A layer whose whole forward is the delta-rule custom op (GDN's gate; the op's CPU path is the chunk form)."""

    def forward(self, q, k, v, beta, g):
        return delta_rule_op(q, k, v, beta, g, backend="chunk", chunk_size=8)[0]


@pytest.mark.parametrize("save_list, forwards", [(sac_save_list, 2), (lambda: _op_sac_save_list, 3)],
                         ids=["project-list", "torchtitan-list"])
def test_selective_ac_saves_the_delta_rule_forward(monkeypatch, save_list, forwards):
    """GDN/KDA/DeltaNet's op: one forward, one inside its own backward (the chunk form's autograd); torchtitan's list
    alone adds a recomputation of the whole forward."""
    calls = []
    chunk = drops.chunk_delta_rule
    monkeypatch.setattr(drops, "chunk_delta_rule", lambda *a, **kw: (calls.append(1), chunk(*a, **kw))[1])
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": _DeltaBlock()})
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"), op_sac_save_list=save_list())
    q, k = (torch.nn.functional.normalize(torch.randn(1, 16, 2, 8), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(1, 16, 2, 8, requires_grad=True)
    beta, g = torch.rand(1, 16, 2, requires_grad=True), (-torch.rand(1, 16, 2)).requires_grad_()
    model.layers["0"](q, k, v, beta, g).square().sum().backward()
    assert len(calls) == forwards
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v, beta, g))
