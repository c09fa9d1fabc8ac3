"""Public entry for Local Linear Attention: ``lla_attention(q, k, v, lam, ...)``.

Implementations (``impl``):

- "reference": :func:`naive_lla` (explicit Σ_i and ``torch.linalg.solve``; exact solve, O(T²·D) memory);
- "chunked":   blockwise PyTorch (``chunked.py``), CG solves, exact hand-written backward, any device;
- "triton":    the blockwise Triton kernels (``triton.py``): forward, and backward with the adjoint solve;
- "auto":      Triton on CUDA, chunked elsewhere.

All non-reference paths use the λω ridge (shift-invariant, spec §5.3), compute in fp32 (float64 inputs:
float64 on the chunked path) and return q's dtype. ρ is solved by ``cg_iters`` CG iterations; the
backward differentiates the exact solution (implicit function theorem), so it is the true gradient of
the function once CG has converged (``cg_iters`` ≥ D in exact arithmetic).
"""

from __future__ import annotations

from typing import Optional

import torch

from attention.base import document_ids
from attention.ops.lla.chunked import lla_bwd_chunked, lla_fwd_chunked
from attention.ops.lla.decode import lla_decode  # noqa: F401
from attention.ops.lla.naive import cg_solve, naive_lla, relmm, sigma_matvec  # noqa: F401

Tensor = torch.Tensor

IMPLS = ("auto", "triton", "chunked", "reference")
TRITON_VARIANT = "v0"
"""Which Triton kernels ``impl="triton"`` runs: "v0" (``triton_v0.py``: fp32/TF32 tiles; the default) or "v1"
(``triton.py``: bf16 tensor-core operands, split masks, autotuned tiles; 3.6x faster fwd+bwd on an H100).
v1 is NOT the default because bf16 operands are too inexact for LLA (precision, not a logic bug: fp32
inputs at the GPU tiles (64, 64)/(64, 32) match float64 to 2e-6). Measured on an H100 (B4 T4096 H16/8
D128, λ=0.1, 8 CG): relative error of o vs float64 v1 15.9 (rows ≥ 2D: 19.6) vs v0 11.2 (0.56); GPU test
bf16 T=1000 λ=0.1: v1 o 46.8; λ=1 T=300: v1 o 1.1e-1 (triton.PRECISE: 2.7e-2). Cause: on ill-conditioned
rows δ = Σ_j a_j ≪ Σ_j |a_j|, so the bf16 rounding of the weights, of t in Σ·p and of ρ and the scores a_j
in the output pass is amplified by Σ|a|/δ (CPU bf16 emulation, λ=1, D=64: o 9.5e-2, PRECISE 1.8e-3).
Those measurements predate CG on the k̄-centred Σ_c (``naive.from_centred``), which removed the 1/δ from the output
pass. Since then 3 of the 4 v1 GPU cases marked xfail pass on an H100 (D=64 bf16, D=128 fp32, the bf16
first-positions test without PRECISE); D=128 bf16 still fails. v1 is not re-timed and stays opt-in."""


def _triton_ops():
    import importlib

    if TRITON_VARIANT not in ("v0", "v1"):
        raise ValueError(f"TRITON_VARIANT={TRITON_VARIANT!r}: choose 'v0' or 'v1'")
    return importlib.import_module("attention.ops.lla.triton" + ("_v0" if TRITON_VARIANT == "v0" else ""))


def doc_bounds(cu_seqlens: torch.Tensor | None, B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """doc_start, doc_end: [B, T] int32, the first visible key of each query and the end (exclusive) of
    its document, as positions inside the row."""
    if cu_seqlens is None:
        return (torch.zeros(B, T, dtype=torch.int32, device=device),
                torch.full((B, T), T, dtype=torch.int32, device=device))
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    doc = document_ids(cu, B, T)  # [B, T]
    row0 = (torch.arange(B, device=device) * T)[:, None]
    return (cu[doc] - row0).to(torch.int32), (cu[doc + 1] - row0).to(torch.int32)


def _lam_btH(lam, B, T, HQ, device) -> torch.Tensor:
    lam = torch.as_tensor(lam, device=device)
    if lam.dim() == 1:
        lam = lam.view(1, 1, HQ)
    return lam.expand(B, T, HQ)


def _heads_first(t: Tensor, ct: torch.dtype, G: int = 1) -> Tensor:
    """[B, T, H, ·] -> [B, H·G, T, ·] in ``ct`` (kv heads repeated G times for the chunked path)."""
    t = t.to(ct).transpose(1, 2)
    return t.repeat_interleave(G, 1) if G > 1 else t


def _compute_dtype(q: Tensor, use_triton: bool) -> torch.dtype:
    return torch.float64 if (q.dtype == torch.float64 and not use_triton) else torch.float32


# ---------------------------------------------------------------- forward / backward ops
# One forward per training step: the forward returns the statistics its backward needs (ρ, δ and, on the Triton
# path, the row max m and ω), as the Parallax and delta-rule ops do. (Through ``opaque_op`` the backward re-ran the
# whole forward, CG solves included, before its own adjoint solve.) The ops are opaque to torch.compile.
@torch.library.custom_op("attnlab::lla_fwd", mutates_args=())
def lla_fwd(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, cu_seqlens: Optional[Tensor], scale: float, cg_iters: int,
            jacobi: bool, rtol: float, use_triton: bool, block_r: Optional[int],
            block_c: Optional[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o in q's dtype [B, T, HQ, D], then for the backward: o and ρ in the compute dtype, δ, m, ω).

    Triton: o_c, ρ [B, T, HQ, D] fp32; δ, m, ω [B, T, HQ] fp32. Chunked: o_c, ρ [B, HQ, T, D] and δ [B, HQ, T] in
    fp32 (float64 for float64 inputs); m and ω empty."""
    B, T, HQ, D = q.shape
    ds, _ = doc_bounds(cu_seqlens, B, T, q.device)
    if use_triton:
        o, rho, delta, m, om = _triton_ops().lla_fwd_triton(q.contiguous(), k.contiguous(), v.contiguous(),
                                                            lam.to(torch.float32).contiguous(), ds, scale,
                                                            cg_iters, jacobi, rtol, block_r, block_c)
        out = o.to(q.dtype, copy=True)  # a new tensor: an op's outputs may not alias each other
    else:
        ct, G = _compute_dtype(q, False), HQ // k.shape[2]
        o, rho, delta = lla_fwd_chunked(_heads_first(q, ct), _heads_first(k, ct, G), _heads_first(v, ct, G),
                                        lam.to(ct).permute(0, 2, 1), ds, scale, cg_iters, jacobi, True, rtol,
                                        block_r)
        out = o.transpose(1, 2).to(q.dtype, memory_format=torch.contiguous_format, copy=True)
        m, om = q.new_empty(0, dtype=ct), q.new_empty(0, dtype=ct)
    return out, o, rho, delta, m, om


@lla_fwd.register_fake
def _(q, k, v, lam, cu_seqlens, scale, cg_iters, jacobi, rtol, use_triton, block_r, block_c):
    B, T, HQ, D = q.shape
    ct = _compute_dtype(q, use_triton)
    if use_triton:
        big, small, none = (B, T, HQ, D), (B, T, HQ), (B, T, HQ)
    else:
        big, small, none = (B, HQ, T, D), (B, HQ, T), (0,)
    return (q.new_empty(B, T, HQ, D), q.new_empty(big, dtype=ct), q.new_empty(big, dtype=ct),
            q.new_empty(small, dtype=ct), q.new_empty(none, dtype=ct), q.new_empty(none, dtype=ct))


@torch.library.custom_op("attnlab::lla_bwd", mutates_args=())
def lla_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, cu_seqlens: Optional[Tensor], o: Tensor,
            rho: Tensor, delta: Tensor, m: Tensor, om: Tensor, scale: float, cg_iters: int, jacobi: bool, rtol: float,
            use_triton: bool, block_r: Optional[int],
            block_c: Optional[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dλ) in the dtypes and shapes of q, k, v, λ: the adjoint solve on the forward's statistics."""
    B, T, HQ, D = q.shape
    ds, de = doc_bounds(cu_seqlens, B, T, q.device)
    if use_triton:
        ops = _triton_ops()
        dd = do.to(torch.float32).contiguous() if ops.__name__.endswith("_v0") else do.contiguous()
        dq, dk, dv, dlam = ops.lla_bwd_triton(q.contiguous(), k.contiguous(), v.contiguous(),
                                              lam.to(torch.float32).contiguous(), ds, de, o, dd, rho, delta, m, om,
                                              scale, cg_iters, jacobi, rtol, block_r, block_c)
    else:
        ct, G = _compute_dtype(q, False), HQ // k.shape[2]
        dq, dk, dv, dlam = lla_bwd_chunked(_heads_first(q, ct), _heads_first(k, ct, G), _heads_first(v, ct, G),
                                           lam.to(ct).permute(0, 2, 1), ds, o, rho, delta, _heads_first(do, ct),
                                           scale, cg_iters, jacobi, True, rtol, block_r)
        dq = dq.transpose(1, 2)
        dk = dk.unflatten(1, (-1, G)).sum(2).transpose(1, 2)
        dv = dv.unflatten(1, (-1, G)).sum(2).transpose(1, 2)
        dlam = dlam.permute(0, 2, 1)
    return tuple(g.to(t.dtype).contiguous() for g, t in ((dq, q), (dk, k), (dv, v), (dlam, lam)))


@lla_bwd.register_fake
def _(do, q, k, v, lam, cu_seqlens, o, rho, delta, m, om, scale, cg_iters, jacobi, rtol, use_triton, block_r,
      block_c):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, lam))


def _setup_context(ctx, inputs, output):
    q, k, v, lam, cu_seqlens, *args = inputs
    _, o, rho, delta, m, om = output
    ctx.mark_non_differentiable(o, rho, delta, m, om)
    ctx.save_for_backward(q, k, v, lam, cu_seqlens, o, rho, delta, m, om)
    ctx.args = args


def _backward(ctx, do, *_):  # no gradient flows into the saved statistics (non-differentiable)
    grads = lla_bwd(do.contiguous(), *ctx.saved_tensors, *ctx.args)
    return (*grads, None, *(None,) * len(ctx.args))  # nothing for cu_seqlens and the non-tensor arguments


lla_fwd.register_autograd(_backward, setup_context=_setup_context)


def resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in IMPLS:
        raise ValueError(f"attention.impl={impl!r} is not valid for lla; choose from {list(IMPLS)}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "chunked"
    return impl


def lla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam,
    *,
    scale: float | None = None,
    cg_iters: int = 16,
    jacobi: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    rtol: float = 1e-6,
    impl: str = "auto",
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Causal Local Linear Attention with the λω ridge.

    q: [B, T, HQ, D]; k, v: [B, T, HKV, D] (GQA: HQ % HKV == 0); any float dtype (bf16: fp32 solves).
    lam: λ ≥ 0 as a float, a [HQ] tensor (per head) or a [B, T, HQ] tensor (per token); gradients flow to it.
    scale: kernel exp(scale·q·k), default D**-0.5. cg_iters: CG iterations (paper: 16 suffice in bf16).
    jacobi: Jacobi-preconditioned CG. rtol: CG stops per row at ‖r‖ ≤ rtol·‖b‖.
    cu_seqlens: [N+1] int32 document offsets over the flattened B*T tokens.
    block: (query, key) tile sizes; default: autotuned for Triton (v1; v0: (32, 32) at D > 64, else (64, 64)),
    (128, ·) for the chunked path.
    Returns o: [B, T, HQ, D] in q's dtype.
    """
    B, T, HQ, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != D or HQ % k.shape[2]:
        raise ValueError(f"lla_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} must be "
                         f"[B, T, HQ, D] and [B, T, HKV, D] with HQ % HKV == 0")
    if cg_iters < 0:
        raise ValueError(f"attention.lla.cg_iters={cg_iters} must be >= 0")
    scale = D**-0.5 if scale is None else scale
    impl = resolve_impl(impl, q.device)
    if impl == "reference":
        return naive_lla(q, k, v, lam, scale=scale, cu_seqlens=cu_seqlens)
    lam_full = _lam_btH(lam, B, T, HQ, q.device)
    if not lam_full.is_floating_point():
        lam_full = lam_full.to(torch.float32)
    use_triton = impl == "triton"
    if block is None:
        if not use_triton:
            block = (128, 128)
        elif TRITON_VARIANT == "v0":
            block = (32, 32) if D > 64 else (64, 64)
        else:
            block = (None, None)  # autotuned
    br, bc = (None if b is None else int(b) for b in block)
    return lla_fwd(q, k, v, lam_full, cu_seqlens, float(scale), int(cg_iters), bool(jacobi), float(rtol), use_triton,
                   br, bc)[0]
