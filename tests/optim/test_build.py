"""Containers: bit-exact resume with Muon + AdamW and annealed weight decay; per-group lr/wd through a run."""

import copy
import io

import pytest
import torch
from torch import nn

from attnlab.optim.build import build_lr_schedulers, build_optimizers
from attnlab.optim.config import LRScheduler, Optimizer


class Toy(nn.Module):
    """Qwen3-like names: Muon matrices, embeddings, norms, a biased gate (vectors)."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(40, 24)
        self.layers = nn.ModuleDict({"0": nn.ModuleDict({"wq": nn.Linear(24, 32, bias=False),
                                                          "wr": nn.Linear(24, 32, bias=False),
                                                          "r_gate": nn.Linear(24, 4),
                                                          "attention_norm": nn.RMSNorm(24)})})
        self.norm = nn.RMSNorm(24)


def _grads(model: Toy, step: int) -> None:
    """Gradient depending on the parameters and the step (seeded), like a real loss would."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = 0.1 * p.detach() + torch.randn(p.shape, generator=gen)


OPT = Optimizer(name="muon", lr=0.02, weight_decay=0.1, lr_warmup_patterns=[r"\.wr\."], lr_warmup_steps=4)
SCHED = LRScheduler(schedule="wsd", warmup_steps=1, decay_start=0.5, wd_anneal_gamma=2.0)
STEPS = 8


def _setup(model):
    opt = build_optimizers([model], OPT)
    return opt, build_lr_schedulers(opt, SCHED, STEPS)


def _train(model, opt, sched, steps):
    log = []
    for s in steps:
        _grads(model, s)
        log.append(sched.lr_wd())
        opt.step()
        sched.step()
    return log


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_resume_is_bit_exact():
    torch.manual_seed(0)
    ref = Toy()
    model = copy.deepcopy(ref)
    opt_ref, sched_ref = _setup(ref)
    log_ref = _train(ref, opt_ref, sched_ref, range(STEPS))

    opt, sched = _setup(model)
    log = _train(model, opt, sched, range(5))
    ckpt = _roundtrip({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()})
    assert ckpt["sched"] == {"last_epoch": 5}

    resumed = Toy()
    resumed.load_state_dict(ckpt["model"])
    opt2, sched2 = _setup(resumed)
    opt2.load_state_dict(ckpt["optim"])
    sched2.load_state_dict(ckpt["sched"])
    log += _train(resumed, opt2, sched2, range(5, STEPS))

    assert log == log_ref  # every group's lr and annealed wd at every step
    for (n, a), (_, b) in zip(ref.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), n
    assert len(opt2.optimizers) == 2  # Muon + AdamW


def test_lr_wd_log_table():
    """Per-group lr and wd through an 8-step run: WSD decay from step 4, γ = 2, W_R warmup over 4 steps."""
    torch.manual_seed(0)
    model = Toy()
    opt, sched = _setup(model)
    log = _train(model, opt, sched, range(STEPS))
    lr = [0.02 * f for f in (1, 1, 1, 1, 1, 0.75, 0.5, 0.25)]  # warmup_steps=1 then decay t=(s-4)/4
    wd = [0.1 * f for f in (1, 1, 1, 1, 1, 0.5625, 0.25, 0.0625)]  # (1 - t)^2
    warm = (0.25, 0.5, 0.75, 1, 1, 1, 1, 1)
    for s in range(STEPS):
        assert log[s]["lr/matrix"] == pytest.approx(lr[s])
        assert log[s]["wd/matrix"] == pytest.approx(wd[s])
        assert log[s]["lr/matrix_warmup"] == pytest.approx(lr[s] * warm[s])
        assert log[s]["lr/embed"] == pytest.approx(0.3 * lr[s])
        assert log[s]["lr/norm"] == pytest.approx(0.015 * lr[s])
        assert log[s]["wd/norm"] == 0.0
    assert sched.schedulers[0].get_last_lr()[0] == pytest.approx(0.0)  # trainer logs this one


def test_scheduler_state_with_two_optimizer_types():
    """torchtitan 0.2.2 copies the first scheduler's state (base_lrs of Muon's groups) into AdamW's scheduler;
    ours keeps each optimizer's own base lrs."""
    torch.manual_seed(0)
    model = Toy()
    opt, sched = _setup(model)
    _train(model, opt, sched, range(3))
    fresh_opt, fresh = _setup(Toy())
    fresh.load_state_dict(sched.state_dict())
    for a, b in zip(fresh.schedulers, sched.schedulers):
        assert a.last_epoch == b.last_epoch == 3
        assert a.get_last_lr() == b.get_last_lr()
    assert fresh.lr_wd() == sched.lr_wd()


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_shard_local_adam_equals_torch(name, impl):
    """optim.adam's Adam/AdamW (stepping DTensor shards locally) are torch's on plain tensors, bit for bit; the
    FSDP2 side is tests/optim/test_fsdp_muon.py (distributed == 1 process)."""
    import attnlab.optim.adam as ob

    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    kw = dict(lr=0.05, weight_decay=0.1, foreach=impl == "foreach")
    ours, ref = getattr(ob, name)(ps, **kw), getattr(torch.optim, name)(qs, **kw)
    for step in range(4):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) + p.detach()
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, q in zip(ps, qs):
        assert not torch.equal(p, torch.zeros_like(p))
        torch.testing.assert_close(p, q, rtol=0, atol=0)
