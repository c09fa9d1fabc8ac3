"""Distributed Muon and AdamW on CPU: 2 gloo ranks with FSDP2 (and a Shard(1) DTensor) equal the 1-process run.

Both ranks see the same batch, so FSDP's averaged gradient is bitwise the single-process gradient and any
difference comes from the optimizer (a shard-local Newton–Schulz would be far off).
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from attnlab.optim.build import build_lr_schedulers, build_optimizers
from attnlab.optim.config import LRScheduler, Optimizer
from tests.utils import free_port
from attnlab.trainer.teardown import destroy_process_groups

STEPS = 5


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = 4
        self.wq = nn.Linear(20, 12, bias=False)  # per-head blocks: 3 heads of 4 rows
        self.wo = nn.Linear(12, 20, bias=False)


class Block0(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attn()
        self.w1 = nn.Linear(20, 35, bias=False)  # 35 rows: uneven shards 18 + 17
        self.w2 = nn.Linear(35, 20, bias=False)
        self.ffn_norm = nn.RMSNorm(20)

    def forward(self, x):
        x = x + self.attention.wo(torch.tanh(self.attention.wq(x)))
        return x + self.w2(torch.relu(self.w1(self.ffn_norm(x))))


class Block1(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(20, 17, bias=True)
        self.w2 = nn.Linear(17, 20, bias=False)

    def forward(self, x):
        return x + self.w2(torch.sigmoid(self.w1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(30, 20)
        self.layers = nn.ModuleDict({"0": Block0(), "1": Block1(), "2": Block0()})  # same shapes: batched NS
        self.norm = nn.RMSNorm(20)

    def forward(self, tok):
        x = self.tok_embeddings(tok)
        for blk in self.layers.values():
            x = blk(x)
        return self.norm(x).pow(2).mean()


CFG = Optimizer(name="muon", lr=0.02, weight_decay=0.1, muon_per_head=True)
SCHED = LRScheduler(schedule="wsd", warmup_steps=0, decay_start=0.4, wd_anneal_gamma=1.0)


def _run(model, batches, cfg=CFG):
    opt = build_optimizers([model], cfg)
    sched = build_lr_schedulers(opt, SCHED, STEPS)
    for tok in batches:
        opt.zero_grad()
        model(tok).backward()
        opt.step()
        sched.step()
    return opt


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        from attnlab.optim.muon import Muon

        batches = [torch.randint(0, 30, (2, 7), generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
        mesh = init_device_mesh("cpu", (world,))

        def compare(cfg):
            """(largest |1-process - FSDP2| over the parameters after STEPS steps, the FSDP optimizer)."""
            torch.manual_seed(0)
            ref, model = Net(), Net()
            model.load_state_dict(ref.state_dict())
            for blk in model.layers.values():
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
            for m in model.modules():
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            _run(ref, batches, cfg)
            opt = _run(model, batches, cfg)
            diff = max((a.detach() - b.full_tensor().detach()).abs().max().item()
                       for a, b in zip(ref.parameters(), model.parameters()))
            return diff, opt

        worst, opt = compare(CFG)
        assert any(type(o).__name__ == "Muon" for o in opt.optimizers)
        sd = opt.state_dict()  # DCP-style flattened state with DTensor buffers
        assert any(k.endswith("momentum_buffer") for k in sd)
        assert any(k.endswith("exp_avg") for k in sd)  # the Adam fallback's state, stepped on local shards...
        assert all(isinstance(v, DTensor) for k, v in sd.items() if k.endswith("exp_avg"))  # ...kept as DTensor

        # AdamW alone (stepping the DTensor shards locally) equals the 1-process AdamW
        diff, opt = compare(Optimizer(name="adamw", lr=0.02, weight_decay=0.1))
        worst = max(worst, diff)
        sd = opt.state_dict()
        assert any(isinstance(v, DTensor) for k, v in sd.items() if k.endswith("exp_avg_sq"))

        # general placement (Shard(1)): every rank assembles the full matrix
        torch.manual_seed(1)
        w, gs = torch.randn(9, 14), [torch.randn(9, 14) for _ in range(3)]
        plain = nn.Parameter(w.clone())
        dt = nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(1)]))
        o1, o2 = Muon([plain], lr=0.05), Muon([dt], lr=0.05)
        for g in gs:
            plain.grad = g.clone()
            dt.grad = distribute_tensor(g.clone(), mesh, [Shard(1)])
            o1.step()
            o2.step()
        worst_s1 = (plain.detach() - dt.full_tensor().detach()).abs().max().item()
        if rank == 0:
            with open(out, "w") as f:
                f.write(f"{worst} {worst_s1}")
    finally:
        destroy_process_groups()


def test_fsdp2_muon_equals_single_process(tmp_path):
    out = str(tmp_path / "diff.txt")
    mp.spawn(_worker, args=(2, free_port(), out), nprocs=2, join=True)
    worst, worst_s1 = map(float, open(out).read().split())
    assert worst <= 1e-6, f"FSDP2 Muon differs from 1-process Muon by {worst}"
    assert worst_s1 <= 1e-6, f"Shard(1) Muon differs by {worst_s1}"
