"""What float8 can buy at the 0.6B model's linear shapes: compiled fwd+bwd of bf16 vs torchao float8 linears.

    python -m benchmarks.bench_fp8 [--tokens 16384] [--profile]

Rows: the issue's anchor (two 4096×4096 linears), and the 0.6B Qwen3 block's linears (dim 1024: q 1024→2048,
k/v 1024→1024, o 2048→1024, [r 1024→2048 for Parallax], gate/up 1024→3072, down 3072→1024), each as a chain of
linears under ``torch.compile``, bf16 inputs, fwd+bwd, median of CUDA-event timings. Columns: bf16 ms, float8
tensorwise and rowwise ms (torchao ``convert_to_float8_training``), speedup. The block row bounds the end-to-end
fp8 speedup of the 0.6B model: only these GEMMs get faster; attention, norms, the LM head and the optimizer do not.
``--profile`` adds, per row and variant, the GPU time of one step split into GEMM kernels and the rest (amax,
scale, cast and transpose kernels for float8; the loss for both): what bounds the speedup.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from benchmarks.common import kernel_events, median_ms

SHAPES = {
    "anchor 2x 4096->4096": [(4096, 4096), (4096, 4096)],
    "0.6B block linears (softmax)": [(1024, 2048), (1024, 1024), (1024, 1024), (2048, 1024),
                                     (1024, 3072), (1024, 3072), (3072, 1024)],
    "0.6B FFN only": [(1024, 3072), (1024, 3072), (3072, 1024)],
    "1.7B block linears": [(2048, 2048), (2048, 1024), (2048, 1024), (2048, 2048),
                           (2048, 6144), (2048, 6144), (6144, 2048)],
}


class Parallel(nn.Module):
    """Independent linears on one input (each reads x of its own in-width); outputs summed into one loss."""

    def __init__(self, shapes):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(i, o, bias=False) for i, o in shapes)

    def forward(self, xs):
        return sum(lin(x).float().square().mean() for lin, x in zip(self.lins, xs, strict=True))


GEMM_MARKERS = ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")
"""Library GEMM kernel names. Inductor's kernels (``triton_*``) never count: its float8 cast/amax kernels are named
after the op they feed (``triton_poi_fused__scaled_mm__to_copy_clamp_...``)."""


def is_gemm(kernel: str) -> bool:
    name = kernel.lower()
    return not name.startswith("triton_") and any(m in name for m in GEMM_MARKERS)


def split_gpu_time(step, calls: int = 5) -> tuple[float, float, int]:
    """(GEMM ms, other-kernel ms, kernels) per call of ``step`` from torch.profiler (already warm)."""
    gemm = other = 0.0
    count = 0
    events = sorted(kernel_events(step, calls), key=lambda e: -e.self_device_time_total)
    for ev in events[:8]:
        print(f"    {ev.self_device_time_total / 1e3 / calls:8.3f} ms x{ev.count // calls:<3d} {ev.key[:90]}")
    for ev in events:
        us = ev.self_device_time_total
        if us <= 0:
            continue
        count += ev.count
        if is_gemm(ev.key):
            gemm += us
        else:
            other += us
    return gemm / 1e3 / calls, other / 1e3 / calls, count // calls


def time_variant(shapes, tokens: int, recipe: str | None, profile: bool = False):
    torch._dynamo.reset()  # each variant compiles afresh (the float8 modules would exhaust the recompile limit)
    torch.manual_seed(0)
    model = Parallel(shapes).cuda().to(torch.bfloat16)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = convert_to_float8_training(copy.deepcopy(model), config=Float8LinearConfig.from_recipe_name(recipe))
    model = torch.compile(model)
    xs = [torch.randn(tokens, i, device="cuda", dtype=torch.bfloat16, requires_grad=True) for i, _ in shapes]

    def step():
        model(xs).backward()

    ms = median_ms(step, rep=20, warmup=5)
    return (ms, split_gpu_time(step)) if profile else ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step (rows of every GEMM)")
    ap.add_argument("--profile", action="store_true", help="also split each step's GPU time: GEMMs vs the rest")
    a = ap.parse_args()
    if a.profile:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: GPU ms per fwd+bwd, GEMM / other kernels")
        print(f"{'shapes':<32} {'variant':<11} {'wall ms':>8} {'GEMM ms':>8} {'other ms':>9} {'kernels':>8}")
        for name, shapes in SHAPES.items():
            for recipe in (None, "tensorwise", "rowwise"):
                ms, (gemm, other, n) = time_variant(shapes, a.tokens, recipe, profile=True)
                print(f"{name:<32} {recipe or 'bf16':<11} {ms:>8.3f} {gemm:>8.3f} {other:>9.3f} {n:>8d}", flush=True)
        return
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.tokens} tokens, fwd+bwd, compiled")
    print(f"{'shapes':<32} {'bf16 ms':>8} {'tensorwise':>11} {'x':>6} {'rowwise':>8} {'x':>6}")
    for name, shapes in SHAPES.items():
        base = time_variant(shapes, a.tokens, None)
        cells = []
        for recipe in ("tensorwise", "rowwise"):
            try:
                ms = time_variant(shapes, a.tokens, recipe)
                cells.append(f"{ms:>11.3f} {base / ms:>5.2f}x")
            except Exception as e:  # report and go on
                cells.append(f"{'failed':>11} {type(e).__name__[:6]:>6}")
        print(f"{name:<32} {base:>8.3f} {cells[0]} {cells[1].replace('  ', ' ', 1)}")


if __name__ == "__main__":
    main()
