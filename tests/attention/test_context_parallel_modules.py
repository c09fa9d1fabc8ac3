"""Every registered mechanism's context-parallel path against its one-process forward, module by module: 2 gloo
processes (CP = 2) each run their two chunks of the same rows (documents crossing the chunks, one starting at a
chunk's first token, a row of one causal sequence) in float64, and their outputs and input gradients must equal the
one-process ones to 1e-9, the gradients of every parameter (summed over the ranks, as FSDP does) to 1e-5 relative
(several mechanisms compute their gates and ridges in float32 by design, FoX's log forget gate, HLA's decay, LLA's λ,
which rounds differently in another summation order). One spawn for the whole registry; the training runs (losses,
resumes) are the conformance matrix's CP column (tests/test_conformance.py)."""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnlab.attention.base import AttentionArgs, AttentionContext
from attnlab.attention.cp import ContextParallel, documents
from attnlab.attention.registry import REGISTRY, build_attention

T = 16
POSITIONS = torch.stack([torch.cat([torch.arange(m) for m in (5, 7, 4)]),  # documents cross the chunks of 4
                         torch.cat([torch.arange(m) for m in (4, 12)]),  # one starts at chunk 1's first token
                         torch.arange(T)])


def _module(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    args = AttentionArgs(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=T)
    m = build_attention(name, args).double()
    with torch.no_grad():
        m.init_weights(0.02)
        for p in m.parameters():  # off the initial values (zeros, ones) so every gradient is exercised
            p.add_(0.01 * torch.randn_like(p))
    return m


def _rope(ctx: AttentionContext, m: torch.nn.Module) -> AttentionContext:
    from torchtitan.models.qwen3.model.model import precompute_rope_cache

    ctx.use_rope_table(precompute_rope_cache(m.args.head_dim, T, ctx.rope_theta).double())
    return ctx


def _one_process(name: str, x: torch.Tensor, g: torch.Tensor):
    m = _module(name)
    x = x.clone().requires_grad_()
    ctx = _rope(AttentionContext.from_positions(POSITIONS, True, 1e6), m)
    o = m(x, ctx)
    (o * g).sum().backward()
    return o.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}


def _rank(rank: int, port: int, names: list[str], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    cp = ContextParallel(dist.group.WORLD, 2, rank)
    torch.manual_seed(1)
    x = torch.randn(3, T, 32, dtype=torch.float64)
    g = torch.randn(3, T, 32, dtype=torch.float64)
    for name in names:
        try:
            m = _module(name)
            xl = cp.shard(x).clone().requires_grad_()
            ctx = _rope(AttentionContext(positions=cp.shard(POSITIONS), cp=cp, cp_docs=documents(POSITIONS),
                                         max_position=T), m)
            o = m(xl, ctx)
            (o * cp.shard(g)).sum().backward()
            grads = {n: p.grad for n, p in m.named_parameters()}
            for t in grads.values():
                dist.all_reduce(t)
            parts = [None, None]
            dist.all_gather_object(parts, (o.detach(), xl.grad))
            result = (cp.assemble([p[0] for p in parts], 1), cp.assemble([p[1] for p in parts], 1), grads, x, g)
        except Exception:  # reported by the mechanism's test; both ranks fail alike (same code, same inputs)
            result = traceback.format_exc()
        if rank == 0:
            out[name] = result
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_results():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, sorted(REGISTRY), out), nprocs=2)
        return dict(out)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_context_parallel_module_matches_one_process(name, cp_results):
    assert not isinstance(cp_results[name], str), cp_results[name]
    o_cp, dx_cp, grads_cp, x, g = cp_results[name]
    o, dx, grads = _one_process(name, x, g)
    torch.testing.assert_close(o_cp, o, rtol=1e-9, atol=1e-10, msg=f"{name}: outputs")
    torch.testing.assert_close(dx_cp, dx, rtol=1e-9, atol=1e-10, msg=f"{name}: input gradients")
    assert grads_cp.keys() == grads.keys()
    for n in grads:
        torch.testing.assert_close(grads_cp[n], grads[n], rtol=1e-5, atol=1e-8, msg=lambda m: f"{name}: d{n}: {m}")
