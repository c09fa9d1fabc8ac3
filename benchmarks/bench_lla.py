"""LLA (and affine family) benchmark against SDPA softmax attention on one GPU.

    python -m benchmarks.bench_lla --quick     # B=4, T=4096, HQ=16, HKV=8, D=128: softmax, LLA-8, 2 pinned tiles
    python -m benchmarks.bench_lla --ptxas 64x64x4,128x64x8   # no GPU: sm_90 registers / spills of every kernel
    python -m benchmarks.bench_lla             # also T=1024, Jacobi, the affine family, the chunk PyTorch LLA
    python -m benchmarks.bench_lla --quick --iters 4,16 --tiles none   # other CG counts

Rows "LLA-N" run the Triton kernels (``attnlab/attention/ops/lla/triton``) with N CG iterations, autotuned; rows
"tiles (BR, BC)" pin one tile for every kernel; "precise" (``--precise``): ``kernels.common.PRECISE``, fp32/TF32
statistics, Σ·p and output products (each PRECISE value autotunes its own kernels).

Columns: ms forward, ms forward+backward, ratio of fwd+bwd to SDPA softmax and to this
project's Triton softmax kernel (row "softmax (ours)": ``parallax_triton`` without a probe), peak
memory (GiB) of fwd+bwd, and for LLA the relative error of the output against the exact float64 solve
(``naive_lla``: Σ_i explicit, ``torch.linalg.solve``) on the first 512 tokens of 2 heads, over all rows
("err") and over rows ≥ 2D ("err≥2D"): rows i < 2D have a nearly rank-deficient Σ_i (λ = 0.1 of ω),
δ_i ≪ ω_i, and truncated CG errors there are amplified by ω/δ (expected, not a kernel bug). Inputs bf16, q/k
RMS-normalised (as after the model's RMSNorm), λ = 0.1 per head.
FLOPs, in units of one causal Q·Kᵀ (softmax: fwd 2, fwd+bwd 7): forward 2 + (3·iters − 1) + 3 (stats, CG steps
(the last needs only pᵀΣp: 2), output), backward 4 + (3·iters − 1) + 5 (passes A, CG, B) + 8 (dk/dv): LLA-8 =
28 + 40 = 68 units ≈ 9.7× softmax fwd+bwd.
``--profile`` prints each LLA row's GPU kernels.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from attnlab.attention.ops.affine import affine_attention
from attnlab.attention.ops.lla import lla_attention, naive_lla
from attnlab.attention.ops.parallax.triton import parallax_triton
from benchmarks.common import kernel_table
from benchmarks.common import timeit as timed


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


def ours_softmax(q, k, v):
    return parallax_triton(q, k, v, None)


def lla_op(iters, jacobi=False, block=None, impl="triton", precise=False):
    lam = torch.full((16,), 0.1, device="cuda")

    def op(q, k, v):
        from attnlab.attention.ops.lla.triton import common

        common.PRECISE = precise
        return lla_attention(q, k, v, lam[: q.shape[2]], cg_iters=iters, jacobi=jacobi, impl=impl, block=block)
    return op


_REF = {}


def lla_error(op, q, k, v):
    """(all rows, rows ≥ 2D) relative error of op's output against the exact float64 LLA."""
    D = q.shape[-1]
    qs, ks, vs = q[:1, :512, :2], k[:1, :512, :1], v[:1, :512, :1]
    key = (q.data_ptr(), q.shape)
    if key not in _REF:
        _REF.clear()
        _REF[key] = naive_lla(qs.double(), ks.double(), vs.double(), torch.full((2,), 0.1, device="cuda").double())
    ref = _REF[key]
    with torch.no_grad():
        out = op(qs, ks, vs).double()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    return rel(out, ref), rel(out[:, 2 * D:], ref[:, 2 * D:])


def ptxas_report(tiles):
    """Compile the LLA kernels for sm_90 without a GPU (as a launch at T=4096 sees them:
    ``attnlab/attention/ops/sm90.py``) and print registers, stack (spill) bytes, shared memory and whether wgmma is
    used, per (kernel, BR, BC, warps)."""
    import inspect

    from attnlab.attention.ops.lla.triton import bwd, cg, fwd
    from attnlab.attention.ops.sm90 import compile_sm90, resources, sass, sass_loop_local_memory

    kernels = {"_stats_kernel": fwd, "_cg_step_kernel": cg, "_out_kernel": fwd, "_bwd_a_kernel": bwd,
               "_bwd_b_kernel": bwd, "_bwd_kv_kernel": bwd}
    B, T, HQ, HKV, D = 4, 4096, 16, 8, 128  # the benchmark's shape; λ per head, expanded over (B, T)
    ints = dict(T=T, HQ=HQ, HKV=HKV, s_qb=T * HQ * D, s_qt=HQ * D, s_qh=D, s_kb=T * HKV * D, s_kt=HKV * D, s_kh=D,
                s_lb=0, s_lt=0, s_lh=1)
    const = {"D": 128, "G": 2, "JACOBI": False, "BD": 128, "PRECISE": False,
             "LAST": os.environ.get("LLA_LAST") == "1",  # CG step: the last one sums x from the history
             "EVEN": True}  # CG step: T a multiple of BR (the benchmark's T), no masks on its state tiles
    for name in os.environ.get("LLA_KERNELS", ",".join(kernels)).split(","):
        fn = getattr(kernels[name], name)
        fn = fn.fn if hasattr(fn, "configs") else fn  # an autotuner's JIT function
        params = list(inspect.signature(fn.fn).parameters)
        for br, bc, nw in tiles:
            sig, cex = {}, {}
            for n in params:
                if n in ("BR", "BC") or n in const:
                    sig[n] = "constexpr"
                    cex[n] = {"BR": br, "BC": bc}.get(n, const.get(n))
                elif n in ("Q", "K", "V", "DO", "P", "CB", "RB", "UB", "DMB"):
                    sig[n] = "*bf16"
                elif n in ("DS", "DE"):
                    sig[n] = "*i32"
                elif n.isupper() and n not in ("T", "HQ", "HKV", "D"):
                    sig[n] = "*fp32"
                else:
                    sig[n] = "fp32" if n in ("scale", "qk_scale", "rtol2") else "i32"
            t0 = time.time()
            k = compile_sm90(fn, sig, cex, nw, 2, ints={n: v for n, v in ints.items() if n in params})
            listing = sass(k)
            r, (ldl, stl) = resources(k), sass_loop_local_memory(listing)
            ldl1, stl1 = sass_loop_local_memory(listing, innermost=True)
            print(f"{name:<20} BR={br:<4} BC={bc:<4} warps={nw}  regs={r['regs']} stack={r['stack']}B "
                  f"spill st/ld={r['spill_st']}/{r['spill_ld']}B LDL/STL in loops={ldl}/{stl} "
                  f"(innermost {ldl1}/{stl1}) smem={r['smem']}B "
                  f"wgmma={r['wgmma']} "
                  f"async copies={r['async']}  compile {time.time() - t0:.1f}s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T=4096 only, 8 CG iterations, two tiles")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per row")
    ap.add_argument("--profile", action="store_true", help="print each LLA row's GPU kernels (torch.profiler, "
                    "2 fwd+bwd calls)")
    ap.add_argument("--iters", default=None, help="comma list of CG iteration counts (default 8 with --quick, "
                    "else 4,8,16)")
    ap.add_argument("--tiles", default=None, help="LLA-8 pinned tiles BRxBC, or none (default 64x32,64x64 with "
                    "--quick, else also 64x128,128x64)")
    ap.add_argument("--precise", action="store_true", help="also with kernels.common.PRECISE (fp32 products)")
    ap.add_argument("--ptxas", default=None, help="no GPU needed: compile for sm_90 at tiles BRxBCxWARPS,... "
                    "(e.g. 64x64x4,128x64x8) and print registers / spill stack / smem, then exit")
    args = ap.parse_args()
    if args.ptxas:
        ptxas_report([tuple(int(x) for x in t.split("x")) for t in args.ptxas.split(",")])
        return
    iters = [int(i) for i in (args.iters or ("8" if args.quick else "4,8,16")).split(",")]
    args.tiles = args.tiles or ("64x32,64x64" if args.quick else "64x32,64x64,64x128,128x64")
    tiles = [] if args.tiles == "none" else [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    HQ, HKV, D, B = 16, 8, 128, 4
    rows = []
    for T in ([4096] if args.quick else [1024, 4096]):
        q, k, v = inputs(B, T, HQ, HKV, D)
        shape = f"B{B}_T{T}_H{HQ}/{HKV}_D{D}"
        f, fb, mem = measure(sdpa, q, k, v, 10)
        base = fb
        rows.append((shape, "softmax (SDPA)", f, fb, 1.0, mem, "", "", None))
        f, fb, mem = measure(ours_softmax, q, k, v, 10)
        ours = fb
        rows.append((shape, "softmax (ours)", f, fb, fb / base, mem, "", "", None))
        cases = [(f"LLA-{i}", lla_op(i), True) for i in iters]
        cases += [(f"LLA-8 tiles {b[0]}x{b[1]}", lla_op(8, block=b), False) for b in tiles]
        if args.precise:
            cases += [(f"LLA-{i} precise", lla_op(i, precise=True), True) for i in iters]
        if not args.quick:
            cases += [("LLA-8 jacobi", lla_op(8, jacobi=True), True),
                      ("LLA-8 chunk torch", lla_op(8, impl="chunk"), False)]
            lam = torch.full((HQ,), 1.0, device="cuda")
            for mech in ("value_avg", "affine_linear", "mesa", "affine_mesa"):
                cases.append((mech, (lambda m: lambda q, k, v: affine_attention(m, q, k, v, lam, cg_iters=8))(mech), False))
        for name, op, with_err in cases:
            try:
                f, fb, mem = measure(op, q, k, v, args.reps)
                if args.profile:
                    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                    print(f"-- {name}: GPU kernels of 2 fwd+bwd\n" + kernel_table(lambda: op(*xs).sum().backward(), 2, 12),
                          flush=True)
                e_all, e_tail = lla_error(op, q, k, v) if with_err else ("", "")
                e_all, e_tail = (f"{e:.3g}" if e != "" else "" for e in (e_all, e_tail))
                rows.append((shape, name, f, fb, fb / base, mem, e_all, e_tail, fb / ours))
            except Exception as e:  # keep the table when one configuration fails to compile or run
                nan = float("nan")
                rows.append((shape, name, nan, nan, nan, nan, type(e).__name__, "", nan))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    print(f"\n{'shape':<22} {'mechanism':<24} {'fwd ms':>9} {'fwd+bwd ms':>11} {'x SDPA':>8} {'x ours':>8} "
          f"{'peak GiB':>9} {'err':>9} {'err>=2D':>9}")
    for shape, name, f, fb, ratio, mem, err, err2, vs_ours in rows:
        x_ours = f"{'':8}" if vs_ours is None else f"{vs_ours:8.2f}"
        print(f"{shape:<22} {name:<24} {f:9.2f} {fb:11.2f} {ratio:8.2f} {x_ours} {mem:9.2f} {err:>9} {err2:>9}")


if __name__ == "__main__":
    main()
