"""Selective activation checkpointing both ways: the project's save list (our attention ops' outputs kept) vs
torchtitan's Qwen3 list alone (they are recomputed in the backward). One GPU, the 0.6B model, compiled blocks,
op-mode SAC as ``models.parallelize`` applies it, bf16 autocast, packed documents:

    python -m scripts.bench_sac [--attention parallax,gdn] [--batch 2] [--seq 4096] [--layers 28]
    python -m scripts.bench_sac --device cpu --flavor debug --seq 64 --layers 2 --no-compile --iters 2   # smoke

Prints fwd+bwd ms (median) and peak memory (CUDA only) per (mechanism, save list).
"""

from __future__ import annotations

import argparse

import torch


from torchtitan.config.job_config import ActivationCheckpoint, Compile
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama4.infra.parallelize import apply_compile
from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

from models.args import get_flavor
from models.model import Transformer
from models.parallelize import sac_save_list
from scripts.bench_common import median_ms, timeit


def measure(mechanism: str, save: set, args) -> tuple[float, float]:
    margs = get_flavor(args.flavor)
    margs.attention, margs.max_seq_len, margs.n_layers = mechanism, args.seq, args.layers
    margs.attn_mask_type = "block_causal"
    with torch.device(args.device):
        model = Transformer(margs)
    with torch.no_grad():
        model.init_weights()
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"),
             model_compile_enabled=args.compile, op_sac_save_list=save)
    if args.compile:
        apply_compile(model, Compile(enable=True, components=["model"]), ep_enabled=False)
    B, T = args.batch, args.seq
    tok = torch.randint(0, margs.vocab_size, (B, T), device=args.device)
    doc = torch.cat([torch.arange(n) for n in (T // 3, T // 2, T - T // 3 - T // 2)])  # three documents a row
    pos = doc.to(args.device).expand(B, T)
    cuda = args.device == "cuda"

    def step():
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=cuda):
            out = model(tok, pos)
        out.float().logsumexp(-1).mean().backward()

    for _ in range(3):  # compile and autotune
        step()
    if not cuda:
        return timeit(step, args.iters, warmup=0, device=args.device), float("nan")
    torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step, args.iters, warmup=1)
    gib = torch.cuda.max_memory_allocated() / 2**30
    del model
    torch.cuda.empty_cache()
    return ms, gib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", default="parallax,gdn", help="comma list of mechanisms to time")
    ap.add_argument("--batch", type=int, default=2, help="batch size")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length")
    ap.add_argument("--layers", type=int, default=28, help="number of blocks (the flavor's other sizes are kept)")
    ap.add_argument("--iters", type=int, default=10, help="timed fwd+bwd iterations per setting")
    ap.add_argument("--flavor", default="0.6B", help="model flavor (debug for a CPU smoke run)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="compile each block as the trainer does")
    args = ap.parse_args()
    rows = []
    for mech in args.attention.split(","):
        for label, save in (("project (ours saved)", sac_save_list()), ("torchtitan (ours recomputed)",
                                                                        set(_op_sac_save_list))):
            ms, gib = measure(mech, save, args)
            rows.append((mech, label, ms, gib))
            print(f"{mech:10s} {label:30s} {ms:8.1f} ms {gib:6.1f} GiB", flush=True)
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"\nSAC save list, {args.flavor} x{args.layers} layers, B{args.batch} x T{args.seq}, "
          f"{'compiled' if args.compile else 'eager'}, {where}")
    print(f"{'mechanism':10s} {'save list':30s} {'fwd+bwd ms':>10s} {'peak GiB':>9s}")
    for mech, label, ms, gib in rows:
        print(f"{mech:10s} {label:30s} {ms:10.1f} {gib:9.1f}")


if __name__ == "__main__":
    main()
