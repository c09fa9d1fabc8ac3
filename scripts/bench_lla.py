"""LLA (and affine family) benchmark against SDPA softmax attention on one GPU.

    python scripts/bench_lla.py --quick     # B=4, T=4096, HQ=16, HKV=8, D=128: softmax, LLA-{4,8,16}, tile sweep
    python scripts/bench_lla.py             # also T=1024, Jacobi, the affine family, chunked PyTorch LLA

Columns: ms forward, ms forward+backward, ratio of fwd+bwd to SDPA softmax (target: LLA-8 ≤ 10×), peak
memory (GiB) of fwd+bwd, and for LLA the relative error of the output against a 32-iteration fp32
solve (chunked PyTorch path, first 1024 tokens, spec Table 2 style). Inputs bf16, q/k RMS-normalised
(as after the model's RMSNorm), λ = 0.1 per head. FLOPs (stated): LLA forward does (5 + 3·iters) tile
GEMMs per key tile against softmax's 2, so LLA-8 ≈ 14.5× softmax's forward FLOPs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention.ops.affine import affine_attention  # noqa: E402
from attention.ops.lla import lla_attention  # noqa: E402
from scripts.bench_common import timeit as timed  # noqa: E402


def inputs(B, T, HQ, HKV, D):
    def unit(*s):
        x = torch.randn(*s, device="cuda")
        return (x / x.norm(dim=-1, keepdim=True) * D**0.5).bfloat16()

    q, k = unit(B, T, HQ, D), unit(B, T, HKV, D)
    v = torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def measure(op, q, k, v, reps):
    """op(q, k, v) -> o. Returns (fwd ms, fwd+bwd ms, peak GiB)."""
    with torch.no_grad():
        f = timed(lambda: op(q, k, v), reps)
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    go = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def fb():
        for x in xs:
            x.grad = None
        op(*xs).backward(go)

    torch.cuda.reset_peak_memory_stats()
    fbm = timed(fb, reps)
    return f, fbm, torch.cuda.max_memory_allocated() / 2**30


def sdpa(q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=True)
    return o.transpose(1, 2)


def lla_op(iters, jacobi=False, block=None, impl="triton"):
    lam = torch.full((16,), 0.1, device="cuda")
    return lambda q, k, v: lla_attention(q, k, v, lam[: q.shape[2]], cg_iters=iters, jacobi=jacobi, impl=impl,
                                         block=block)


def lla_error(iters, q, k, v, jacobi=False):
    qs, ks, vs = (t[:1, :1024] for t in (q, k, v))
    lam = torch.full((q.shape[2],), 0.1, device="cuda")
    with torch.no_grad():
        ref = lla_attention(qs.float(), ks.float(), vs.float(), lam, cg_iters=32, rtol=0.0, impl="chunked").float()
        out = lla_attention(qs, ks, vs, lam, cg_iters=iters, jacobi=jacobi, impl="triton").float()
    return ((out - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    HQ, HKV, D, B = 16, 8, 128, 4
    rows = []
    for T in ([4096] if args.quick else [1024, 4096]):
        q, k, v = inputs(B, T, HQ, HKV, D)
        shape = f"B{B}_T{T}_H{HQ}/{HKV}_D{D}"
        f, fb, mem = measure(sdpa, q, k, v, 10)
        base = fb
        rows.append((shape, "softmax (SDPA)", f, fb, 1.0, mem, ""))
        cases = [(f"LLA-{i}", lla_op(i), i, False) for i in (4, 8, 16)]
        cases += [(f"LLA-8 tiles {b}", lla_op(8, block=b), None, False) for b in ((16, 32), (64, 32), (32, 64))]
        if not args.quick:
            cases += [("LLA-8 jacobi", lla_op(8, jacobi=True), 8, True), ("LLA-8 chunked torch", lla_op(8, impl="chunked"), None, False)]
            lam = torch.full((HQ,), 1.0, device="cuda")
            for mech in ("value_avg", "affine_linear", "mesa", "affine_mesa"):
                cases.append((mech, (lambda m: lambda q, k, v: affine_attention(m, q, k, v, lam, cg_iters=8))(mech), None, False))
        for name, op, iters, jac in cases:
            try:
                f, fb, mem = measure(op, q, k, v, args.reps)
                err = f"{lla_error(iters, q, k, v, jac):.3g}" if iters else ""
                rows.append((shape, name, f, fb, fb / base, mem, err))
            except Exception as e:  # keep the table when one configuration fails to compile or run
                rows.append((shape, name, float("nan"), float("nan"), float("nan"), float("nan"), type(e).__name__))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    print(f"\n{'shape':<22} {'mechanism':<22} {'fwd ms':>9} {'fwd+bwd ms':>11} {'x softmax':>10} {'peak GiB':>9} {'rel err':>9}")
    for shape, name, f, fb, ratio, mem, err in rows:
        print(f"{shape:<22} {name:<22} {f:9.2f} {fb:11.2f} {ratio:10.1f} {mem:9.2f} {err:>9}")


if __name__ == "__main__":
    main()
