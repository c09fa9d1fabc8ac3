"""Optimizer step time of Muon (+ Adam fallback) vs AdamW on the 0.6B parameter shapes.

One GPU:      python -m benchmarks.bench_optim [--quick] [--attention parallax] [--train-step]
FSDP2 (N GPUs): torchrun --nproc_per_node=4 -m benchmarks.bench_optim [--quick]

Parameters mimic the model's names and shapes (28 layers of wq 2048x1024, wk/wv 1024x1024, wo 1024x2048,
[wr 2048x1024], w1/w3 3072x1024, w2 1024x3072, norms; tied 151936x1024 embeddings), so routing is the real
one. Gradients are random. ``--train-step`` also times one forward+backward of the project's 0.6B model
(B=--batch, T=--seq) to report the optimizer step as a fraction of the training step.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

from attnlab.optim.build import build_optimizers
from attnlab.optim.config import Optimizer
from benchmarks.common import median_ms as _time
from attnlab.trainer.teardown import destroy_process_groups


class Attn(nn.Module):
    def __init__(self, dim, hq, hkv, hd, parallax):
        super().__init__()
        self.head_dim = hd
        self.wq = nn.Linear(dim, hq * hd, bias=False)
        self.wk = nn.Linear(dim, hkv * hd, bias=False)
        self.wv = nn.Linear(dim, hkv * hd, bias=False)
        self.wo = nn.Linear(hq * hd, dim, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(hd), nn.RMSNorm(hd)
        if parallax:
            self.wr, self.r_norm = nn.Linear(dim, hq * hd, bias=False), nn.RMSNorm(hd)


class FFN(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False),
                                     nn.Linear(dim, hidden, bias=False))


class Layer(nn.Module):
    def __init__(self, parallax):
        super().__init__()
        self.attention = Attn(1024, 16, 8, 128, parallax)
        self.feed_forward = FFN(1024, 3072)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(1024), nn.RMSNorm(1024)

    def forward(self, x):  # FSDP2 needs a forward; never called
        return x


class Shapes06B(nn.Module):
    def __init__(self, n_layers, parallax, vocab=151936):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, 1024)
        self.layers = nn.ModuleDict({str(i): Layer(parallax) for i in range(n_layers)})
        self.norm = nn.RMSNorm(1024)

    def forward(self, x):
        return x


def bench_optimizer(name, args, dist_on) -> tuple[float, int]:
    torch.manual_seed(0)
    model = Shapes06B(args.layers, args.attention == "parallax").cuda()
    if dist_on:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer)
        fully_shard(model)
    cfg = Optimizer(name=name, lr=5e-3 if name == "muon" else 3e-4, weight_decay=0.1,
                    muon_ns_coefficients=args.ns, muon_per_head=args.per_head)
    opt = build_optimizers([model], cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    ms = _time(opt.step, args.iters)
    n = sum(p.numel() for p in model.parameters())
    if args.profile:
        _profile(name, opt, args.iters)
    del opt, model
    torch.cuda.empty_cache()
    return ms, n


def _profile(name, opt, iters) -> None:
    """Where the step goes (every rank runs it: the collectives need all; rank 0 prints): each sub-optimizer
    timed alone, the step's GPU kernels, and a cProfile ending in the host time to enqueue a step."""
    from benchmarks.common import kernel_table, python_profile

    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    parts = [(type(o).__name__, _time(o.step, iters)) for o in opt.optimizers]
    table = kernel_table(opt.step, calls=1, rows=12)
    py = python_profile(opt.step, calls=2, rows=25)
    if rank0:
        print(f"# {name}: parts " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts))
        print(table, flush=True)
        print(py, flush=True)


def bench_train_step(args) -> float | None:
    """Forward+backward of the project's 0.6B model (bf16 autocast), or None when it cannot be built."""
    try:
        from attnlab.models.args import get_flavor
        from attnlab.models.model import Transformer

        margs = get_flavor("0.6B")
        margs.attention, margs.max_seq_len = args.attention, args.seq
        with torch.device("cuda"):
            model = Transformer(margs)
        with torch.no_grad():
            model.init_weights()
        tok = torch.randint(0, margs.vocab_size, (args.batch, args.seq), device="cuda")

        def step(model=model):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(tok)
            loss = out.float().logsumexp(-1).mean() if out.dim() == 3 else out
            loss.backward()

        ms = _time(step, max(3, args.iters // 2), warmup=2)
        del model, step
        torch.cuda.empty_cache()
        return ms
    except Exception as e:  # report and carry on: the optimizer numbers stand alone
        print(f"train step not measured: {type(e).__name__}: {e}")
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4 layers, 5 iterations")
    ap.add_argument("--layers", type=int, default=28, help="transformer layers of the benchmarked model")
    ap.add_argument("--iters", type=int, default=20, help="timed optimizer steps")
    ap.add_argument("--attention", default="parallax", choices=["softmax", "parallax"],
                    help="attention of the benchmarked model")
    ap.add_argument("--ns", default="quintic", help="optimizer.muon_ns_coefficients")
    ap.add_argument("--per-head", action="store_true", help="Muon per head (optimizer.muon_per_head)")
    ap.add_argument("--profile", action="store_true",
                    help="per optimizer: each part timed alone, a kernel table, a cProfile and the host enqueue time")
    ap.add_argument("--train-step", action="store_true", help="also time fwd+bwd of the 0.6B model")
    ap.add_argument("--batch", type=int, default=2, help="micro-batch of --train-step")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length of --train-step")
    ap.add_argument("--global-batch", type=int, default=960,
                    help="sequences per optimizer step (the 0.6B configs: 960); the step's fwd+bwd is "
                         "global/batch times the measured one")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.iters = 4, 5
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist_on = world > 1
    if dist_on:
        import torch.distributed as dist

        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rows = []
    for name in ("adamw", "muon"):
        ms, n = bench_optimizer(name, args, dist_on)
        rows.append((name, ms, n))
    train_ms = bench_train_step(args) if args.train_step and not dist_on else None
    if not dist_on or torch.distributed.get_rank() == 0:
        shape = f"L{args.layers}_{args.attention}_world{world}"
        print(f"\nOptimizer step, {shape}, {torch.cuda.get_device_name()} (median of {args.iters})")
        micro = max(1, args.global_batch // args.batch)
        print(f"{'optimizer':<10} {'params':>10} {'step ms':>9} {'vs adamw':>9} {'of 1 microbatch':>16} "
              f"{'of full step':>13}")
        for name, ms, n in rows:
            one = f"{ms / (ms + train_ms):.1%}" if train_ms else "n/a"
            full = f"{ms / (ms + micro * train_ms):.2%}" if train_ms else "n/a"
            print(f"{name:<10} {n / 1e6:>9.1f}M {ms:>9.2f} {ms / rows[0][1]:>8.2f}x {one:>16} {full:>13}")
        if train_ms:
            print(f"fwd+bwd B{args.batch}_T{args.seq}: {train_ms:.1f} ms; full step = {micro} microbatches "
                  f"({args.global_batch} sequences, one GPU, gradient accumulation)")
    if dist_on:
        destroy_process_groups()


if __name__ == "__main__":
    main()
