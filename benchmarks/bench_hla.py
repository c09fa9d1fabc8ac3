"""Benchmark HLA (second order, AHLA, third order), CALA and their primitive against SDPA softmax and GDN.

Forward and forward+backward milliseconds at B4_T4096_H16_D128 in bf16 by default (the target: HLA
fwd+bwd <= 2x the GDN path). Rows:

- sdpa:        causal softmax attention (F.scaled_dot_product_attention, flash/cuDNN)
- gla:         the Triton chunked gated linear attention kernel alone (one pass; HLA runs 2, third order 3)
- hla2 / ahla / hla3 / hla2_norm: ``attention.ops.hla.hla`` with a fixed per-head decay, impl "auto"
  (Triton on CUDA)
- cala:        CALA mixing (window 64): windowed softmax local context (``parallax_attention``, impl auto) +
               LayerNorm + elu+1 + normalised linear attention (Triton)
- gdn:         ``attention.ops.delta_rule.delta_rule`` with a scalar decay (impl auto: fla when allowed, else the
               PyTorch chunk path), if importable

TFLOP/s for the HLA rows use the chunk-form count of the module (passes x (4CD + 4D²) per token and head, x3
for fwd+bwd; C = 64).

    python -m benchmarks.bench_hla --quick
    python -m benchmarks.bench_hla --device cpu --B 1 --T 256 --H 2 --D 32 --quick     # smoke test
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from attnlab.attention.ops.cala import local_context, normalized_linear_attention
from attnlab.attention.ops.hla import hla
from benchmarks.common import timeit


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def rows(B, T, H, D, dtype, device):
    """name -> (function of requires_grad tensors returning the output, inputs)."""
    mk = lambda: torch.randn(B, T, H, D, dtype=dtype, device=device)  # noqa: E731
    q, k = (F.normalize(mk().float(), dim=-1).to(dtype) for _ in range(2))
    v = mk()
    g = torch.log(torch.linspace(0.9, 0.995, H, device=device)).view(1, 1, H).expand(B, T, H).contiguous()
    out = {
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                                is_causal=True), [mk(), mk(), mk()]),
        "hla2": (lambda q, k, v: hla(q, k, v, g), [q, k, v]),
        "ahla": (lambda q, k, v: hla(q, k, v, g, variant="asymmetric"), [q, k, v]),
        "hla3": (lambda q, k, v: hla(q, k, v, g, order=3), [q, k, v]),
        "hla2_norm": (lambda q, k, v: hla(q, k, v, g, normalize=True), [q, k, v]),
    }
    if device == "cuda":
        from attnlab.attention.ops.linear_attn.triton.gla import gla_triton

        out["gla"] = (lambda q, k, v: gla_triton(q, k, v, g), [q, k, v])
    ln = torch.nn.LayerNorm(D, device=device, dtype=dtype)

    def cala(q, k, v):
        cq, ck = local_context(q, k, 64)
        return normalized_linear_attention(F.elu(ln(q + cq)) + 1, F.elu(ln(k + ck)) + 1, v)

    out["cala"] = (cala, [mk(), mk(), mk()])
    try:
        from attnlab.attention.ops.delta_rule import delta_rule

        beta = torch.rand(B, T, H, dtype=dtype, device=device).sigmoid()
        gg = -torch.rand(B, T, H, device=device) * 0.1
        out["gdn"] = (lambda q, k, v: _first(delta_rule(q, k, v, beta, gg)), [q, k, v])
    except Exception as e:  # noqa: BLE001 - the GDN path is another engineer's and may not exist yet
        print(f"gdn row skipped: {type(e).__name__}: {e}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=4, help="batch size")
    p.add_argument("--T", type=int, default=4096, help="sequence length")
    p.add_argument("--H", type=int, default=16, help="heads")
    p.add_argument("--D", type=int, default=128, help="head dimension")
    p.add_argument("--dtype", default="bfloat16", help="torch dtype of the inputs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--quick", action="store_true", help="5 timed repetitions after 2 warm-ups (default 20 after 5)")
    p.add_argument("--rows", nargs="*", default=None, help="row names to time (default: all)")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    reps, warmup = (5, 2) if a.quick else (20, 5)
    results = []
    for name, (fn, xs) in rows(a.B, a.T, a.H, a.D, dtype, a.device).items():
        if a.rows and name not in a.rows:
            continue
        try:
            xs = [x.detach().requires_grad_() for x in xs]
            with torch.no_grad():
                f_ms = timeit(lambda: fn(*xs), reps, warmup, a.device)
            do = torch.randn_like(fn(*xs))

            def fb():
                out = fn(*xs)
                torch.autograd.grad(out, xs, do)

            fb_ms = timeit(fb, reps, warmup, a.device)
            results.append((name, f_ms, fb_ms))
            print(f"{name}: fwd {f_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001 - report and continue with the other rows
            results.append((name, float("nan"), float("nan")))
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    base = {n: fb for n, _, fb in results}
    passes = {"hla2": 2, "ahla": 2, "hla3": 3, "hla2_norm": 2, "gla": 1}
    C, D = 64, a.D
    print(f"\nB{a.B}_T{a.T}_H{a.H}_D{a.D} {a.dtype} on {torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}")
    print(f"{'row':<10} {'fwd ms':>9} {'fwd+bwd':>9} {'x sdpa':>7} {'x gdn':>7} {'TFLOP/s f+b':>11}")
    for name, f, fb in results:
        xs = fb / base["sdpa"] if "sdpa" in base else float("nan")
        xg = fb / base["gdn"] if "gdn" in base else float("nan")
        tf = ""
        if name in passes:
            flops = 3 * passes[name] * a.B * a.T * a.H * (4 * C * D + 4 * D * D)
            tf = f"{flops / (fb * 1e-3) / 1e12:.1f}"
        print(f"{name:<10} {f:>9.3f} {fb:>9.3f} {xs:>7.2f} {xg:>7.2f} {tf:>11}")


if __name__ == "__main__":
    main()
