"""Benchmark the part-B linear-family ops: gla, gated_linear, linear, fox, path (fwd and fwd+bwd, ms).

Shape B4_T4096_H16_D128 (bf16 q/k/v, float32 gates), every available path per mechanism:
  gla / gated_linear / linear: chunk (PyTorch, torch.compile'd), fla (chunk_gla / chunk_simple_gla /
  chunk_linear_attn; fwd+bwd only where fla's gated backward is safe, else "refused");
  fox: chunk (blockwise PyTorch, compiled), flex (FlexAttention), fla (parallel_forgetting_attn);
  path: chunk (blockwise PyTorch, compiled), fla (parallel_path_attn);
  softmax SDPA as the yardstick.
TFLOP/s use the chunked-form FLOP counts stated in ``flops()``.

    python -m benchmarks.bench_linear_b [--quick] [--T 4096] [--only gla,fox]
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch
import torch.nn.functional as F

from attnlab.attention.ops.common import fla_gated_backward_ok, fla_importable
from attnlab.attention.ops.fox import chunk_forgetting_attn, flex_forgetting_attn
from attnlab.attention.ops.linear_attn import chunk_gla, fla_gla
from attnlab.attention.ops.path import chunk_path_attn
from benchmarks.common import timeit as bench


def flops(mech: str, B: int, T: int, H: int, D: int, C: int = 64) -> float:
    """Forward FLOPs. Linear family (chunked): per token and head 2·(2·D·D) (q·S, state update) +
    2·C·D (intra QK^T, AV over one chunk, causal half); softmax-like: 2·2·T·D/2 per token and head (causal).
    PaTH: about twice softmax (the key/query transforms)."""
    if mech in ("gla", "gated_linear", "linear"):
        return B * T * H * (4 * D * D + 2 * C * D)
    f = 2 * 2 * B * H * T * T * D / 2
    return 2 * f if mech == "path" else f


def make_inputs(mech, B, T, H, D, dev):
    q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    ins = dict(q=q, k=k, v=v)
    if mech == "gla":
        ins["gk"] = (F.logsigmoid(torch.randn(B, T, H, D, device=dev)) / 16).requires_grad_()
    if mech in ("gated_linear", "fox", "path"):
        ins["g"] = F.logsigmoid(torch.randn(B, T, H, device=dev) + 3).requires_grad_()
    if mech == "path":
        ins["w"] = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).requires_grad_()
        ins["beta"] = (2 * torch.sigmoid(torch.randn(B, T, H, device=dev))).requires_grad_()
    return ins


def paths(mech, dev):
    """name -> callable(ins) returning o, or a string saying why the path is unavailable."""
    fla_ok, fla_why = fla_importable()
    out = {}
    if mech in ("gla", "gated_linear", "linear"):
        comp = torch.compile(chunk_gla)
        out["chunk(compiled)"] = lambda i: comp(i["q"], i["k"], i["v"], i.get("g"), i.get("gk"))[0]
        out["fla"] = (lambda i: fla_gla(i["q"], i["k"], i["v"], i.get("g"), i.get("gk"))[0]) if fla_ok else fla_why
    elif mech == "fox":  # fla first: the path "auto" takes; the compiled chunk path last (the longest compile)
        if fla_ok:
            from fla.ops.forgetting_attn import parallel_forgetting_attn

            out["fla"] = lambda i: parallel_forgetting_attn(i["q"], i["k"], i["v"], i["g"])
        else:
            out["fla"] = fla_why
        out["flex"] = lambda i: flex_forgetting_attn(i["q"], i["k"], i["v"], i["g"])
        comp = torch.compile(chunk_forgetting_attn)
        out["chunk(compiled)"] = lambda i: comp(i["q"], i["k"], i["v"], i["g"], block_size=128)
    elif mech == "path":
        if fla_ok:
            from fla.ops.path_attn import parallel_path_attn

            out["fla"] = lambda i: parallel_path_attn(i["q"], i["k"], i["v"], i["w"], i["beta"], g=i["g"])[0]
        else:
            out["fla"] = fla_why
        comp = torch.compile(chunk_path_attn)
        out["chunk(compiled)"] = lambda i: comp(i["q"], i["k"], i["v"], i["w"], i["beta"], i["g"], block_size=64)
    elif mech == "softmax":
        out["sdpa"] = lambda i: F.scaled_dot_product_attention(*(i[x].transpose(1, 2) for x in "qkv"), is_causal=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (and T=2048 unless --T is given)")
    ap.add_argument("--B", type=int, default=4, help="batch size")
    ap.add_argument("--T", type=int, default=None, help="sequence length (default 4096)")
    ap.add_argument("--H", type=int, default=16, help="heads")
    ap.add_argument("--D", type=int, default=128, help="head dimension")
    ap.add_argument("--only", default="softmax,gla,gated_linear,linear,fox,path",
                    help="comma list of mechanisms to time")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear_b.py needs CUDA")
    dev = torch.device("cuda")
    T = a.T or (2048 if a.quick else 4096)
    iters, warmup = (5, 2) if a.quick else (20, 5)
    bwd_ok, bwd_why = fla_gated_backward_ok(dev)
    shape = f"B{a.B}_T{T}_H{a.H}_D{a.D}"
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  shape {shape}  fla gated bwd: {bwd_ok or bwd_why}")
    rows = []
    for mech in a.only.split(","):
        for name, fn in paths(mech, dev).items():
            if isinstance(fn, str):
                rows.append((mech, name, "n/a", "n/a", "", fn[:60]))
                print("  " + " | ".join(rows[-1]), flush=True)
                continue
            note, fwd, fb, tf = "", float("nan"), float("nan"), ""
            try:
                ins = make_inputs(mech, a.B, T, a.H, a.D, dev)
                with torch.no_grad():
                    fwd = bench(lambda: fn(ins), iters, warmup)
                tf = f"{flops(mech, a.B, T, a.H, a.D) / fwd / 1e9:.0f}"
                if name == "fla" and mech in ("gla", "gated_linear", "linear") and not bwd_ok:
                    note = f"bwd refused: {bwd_why}"[:60]
                else:
                    leaves = [t for t in ins.values() if t.requires_grad]
                    do = torch.randn_like(fn(ins))

                    def fwd_bwd():
                        torch.autograd.grad(fn(ins), leaves, do)

                    fb = bench(fwd_bwd, iters, warmup)
            except Exception as e:  # keep the table going; report the failure in the row
                note = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:60]
                traceback.print_exc(limit=2)
            torch.cuda.empty_cache()
            rows.append((mech, name, f"{fwd:.2f}", f"{fb:.2f}", tf, note))
            print("  " + " | ".join(rows[-1]), flush=True)  # progress: a slow compile later loses nothing
    print(f"\n| mechanism | path | fwd ms | fwd+bwd ms | fwd TFLOP/s | note |  ({shape}, bf16)")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
