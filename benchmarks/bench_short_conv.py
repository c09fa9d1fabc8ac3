"""The short convolution fwd+bwd: the compiled PyTorch reference (as the model ran it before the kernels) against
the Triton kernels behind ``attnlab::short_conv_fwd`` / ``_bwd``, with each kernel's GPU time alone.

    python -m benchmarks.bench_short_conv [--batch 2 --seq 4096 --channels 2048 --kernel 4 --docs 8] [--sweep]
    python -m benchmarks.bench_short_conv --device cpu --quick      # smoke: tiny shape, Triton interpreter

Inputs bf16 (float32 on the CPU), weight [C, K], SiLU on, ``cu_seqlens`` of ``--docs`` random documents over the
flattened B*T tokens. Prints the median ms of fwd+bwd of each and the ratio; ``--sweep`` also times the forward at
each of its tiles, and the backward (both kernels) at each tile of one kernel with the other's first tile (CUDA).
"""

from __future__ import annotations

import argparse
import os


def _cu_seqlens(total: int, docs: int, device, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[: docs - 1] + 1
    return torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([total])]).to(device, torch.int32)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda (timing) or cpu (smoke)")
    p.add_argument("--quick", action="store_true", help="tiny shape, few iterations (with --device cpu)")
    p.add_argument("--batch", type=int, default=2, help="batch rows B")
    p.add_argument("--seq", type=int, default=4096, help="tokens per row T")
    p.add_argument("--channels", type=int, default=2048, help="channels C")
    p.add_argument("--kernel", type=int, default=4, help="kernel size K")
    p.add_argument("--docs", type=int, default=8, help="packed documents over the B*T tokens (0: no cu_seqlens)")
    p.add_argument("--iters", type=int, default=50, help="timed iterations (median)")
    p.add_argument("--sweep", action="store_true", help="also time every forward and backward tile alone (CUDA)")
    a = p.parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("ATTNLAB_AUTOTUNE", "first")  # the interpreter cannot time candidates
    if a.quick:
        a.batch, a.seq, a.channels, a.docs, a.iters = 1, 37, 20, 3, 2

    import torch

    from attnlab.attention.ops.short_conv import naive_short_conv
    from attnlab.attention.ops.short_conv.triton.conv import DPRE_SPEC, FWD_SPEC, conv_bwd, conv_fwd, short_conv_fwd
    from benchmarks.common import median_ms, timeit

    dev = a.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    B, T, C, K = a.batch, a.seq, a.channels, a.kernel
    cu = _cu_seqlens(B * T, a.docs, dev) if a.docs > 0 else None
    x = torch.randn(B, T, C, device=dev, dtype=dtype, requires_grad=True)
    w = ((torch.rand(C, K, device=dev) - 0.5) / K**0.5).to(dtype).requires_grad_(True)
    dy = torch.randn(B, T, C, device=dev, dtype=dtype)
    ref = torch.compile(lambda x, w: naive_short_conv(x, w, cu, None, True)[0]) if dev == "cuda" else \
        (lambda x, w: naive_short_conv(x, w, cu, None, True)[0])

    def step(fn):
        return lambda: torch.autograd.grad(fn(x, w), (x, w), dy)

    def time_ms(fn):
        return median_ms(fn, rep=a.iters, warmup=5) if dev == "cuda" else timeit(fn, a.iters, 1, dev)

    kern = lambda x, w: short_conv_fwd(x, w, cu, True)  # noqa: E731
    y_r, *g_r = [t.float() for t in (ref(x, w), *step(ref)())]
    y_k, *g_k = [t.float() for t in (kern(x, w), *step(kern)())]
    err = max(((k - r).norm() / r.norm()).item() for k, r in zip([y_k, *g_k], [y_r, *g_r]))
    t_ref, t_kern = time_ms(step(ref)), time_ms(step(kern))
    label = " (compiled)" if dev == "cuda" else ""
    print(f"B={B} T={T} C={C} K={K} docs={a.docs} {str(dtype).split('.')[-1]} on {dev}: fwd+bwd "
          f"reference{label} {t_ref:.3f} ms, kernel {t_kern:.3f} ms, ratio {t_ref / t_kern:.2f}x "
          f"(max relative difference {err:.1e})")
    if dev == "cuda":  # GPU time alone: the timings above include the host's launch cost where it is larger
        print("  kernel GPU time, mean over 20 fwd+bwd: " + ", ".join(
            f"{name} {us:.1f} us" for name, us in kernel_us(step(kern), 20).items()))
    if a.sweep and dev == "cuda":
        xd = x.detach()
        for cfg in FWD_SPEC:
            print(f"  fwd tile {cfg}: {median_ms(lambda: conv_fwd(xd, w.detach(), cu, True, config=cfg)):.3f} ms")
        for cfg in DPRE_SPEC:  # the whole backward, dpre kernel at this tile, dx kernel at the forward's first
            ms = median_ms(lambda: conv_bwd(dy, xd, w.detach(), cu, True, config=cfg, dx_config=FWD_SPEC[0]))
            print(f"  bwd, dpre tile {cfg}: {ms:.3f} ms")
        for cfg in FWD_SPEC:
            ms = median_ms(lambda: conv_bwd(dy, xd, w.detach(), cu, True, config=DPRE_SPEC[0], dx_config=cfg))
            print(f"  bwd, dx tile {cfg}: {ms:.3f} ms")


def kernel_us(fn, n: int) -> dict[str, float]:
    """Mean GPU µs per call of ``fn`` for each CUDA kernel it runs (torch.profiler), by kernel name."""
    from benchmarks.common import kernel_events

    fn()
    return {e.key[:40]: e.self_device_time_total / n for e in kernel_events(fn, n) if e.self_device_time_total > 0}


if __name__ == "__main__":
    main()
