"""Public entry for Local Linear Attention: ``lla_attention(q, k, v, lam, ...)``.

Implementations (``impl``):

- "reference": :func:`naive_lla` (explicit Σ_i and ``torch.linalg.solve``; exact solve, O(T²·D) memory);
- "chunk":     blockwise PyTorch (``chunk.py``), CG solves, exact hand-written backward, any device;
- "triton":    the blockwise Triton kernels (``triton/``), forward and backward with the adjoint solve;
- "auto":      Triton on CUDA, chunk elsewhere.

All non-reference paths use the λω ridge (shift-invariant, docs/mechanisms.md "LLA"), compute in fp32
(float64 inputs: float64 on the chunk path) and return q's dtype. ρ is solved by ``cg_iters`` CG iterations; the
backward differentiates the exact solution (implicit function theorem), so it is the true gradient of
the function once CG has converged (``cg_iters`` ≥ D in exact arithmetic).
"""

from __future__ import annotations

from typing import Optional

import torch

from attnlab.attention.ops.common import check_impl, doc_bounds
from attnlab.attention.ops.custom_ops import attnlab_op
from attnlab.attention.ops.lla.chunk import lla_bwd_chunked, lla_fwd_chunked
from attnlab.attention.ops.lla.naive import cg_solve, naive_lla, relmm, sigma_matvec  # noqa: F401
from attnlab.attention.ops.lla.recurrent import lla_decode  # noqa: F401

Tensor = torch.Tensor

IMPLS = ("auto", "reference", "chunk", "triton")


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
def _fwd_fake(q, k, v, lam, cu_seqlens, scale, cg_iters, jacobi, rtol, use_triton, block_r, block_c):
    B, T, HQ, D = q.shape
    ct = _compute_dtype(q, use_triton)
    if use_triton:
        aux, big, small = (1 + bool(jacobi), B, T, HQ, D), (B, T, HQ, D), (B, T, HQ)
    else:
        aux, big, small = (0,), (B, HQ, T, D), (0,)
    return (q.new_empty(B, T, HQ, D), q.new_empty(aux, dtype=ct), q.new_empty(big, dtype=ct),
            q.new_empty(small, dtype=ct), q.new_empty(small, dtype=ct), q.new_empty(small, dtype=ct))


@attnlab_op("lla_fwd", _fwd_fake, keep_under_sac=True)
def lla_fwd(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, cu_seqlens: Optional[Tensor], scale: float, cg_iters: int,
            jacobi: bool, rtol: float, use_triton: bool, block_r: Optional[int], block_c: Optional[int]
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o in q's dtype [B, T, HQ, D], then for the backward: aux, ρ, δ, m, ω).

    Triton (:func:`triton.lla_fwd_triton`): aux = k̄ and the Jacobi diagonal [1 + jacobi, B, T, HQ, D], ρ
    [B, T, HQ, D] fp32; δ, m, ω [B, T, HQ] fp32. Chunk: the k̄-centred ρ_c [B, HQ, T, D] in fp32 (float64 for
    float64 inputs), its backward's only statistic (``chunk.py``); aux, δ, m and ω empty."""
    B, T, HQ, D = q.shape
    ds, _ = doc_bounds(cu_seqlens, B, T, q.device)
    if use_triton:
        from attnlab.attention.ops.lla.triton import lla_fwd_triton

        out, o, rho, delta, m, om = lla_fwd_triton(q.contiguous(), k.contiguous(), v.contiguous(),
                                                   lam.to(torch.float32).contiguous(), ds, scale, cg_iters,
                                                   jacobi, rtol, block_r, block_c)
    else:
        ct, G = _compute_dtype(q, False), HQ // k.shape[2]
        o, rho = lla_fwd_chunked(_heads_first(q, ct), _heads_first(k, ct, G), _heads_first(v, ct, G),
                                 lam.to(ct).permute(0, 2, 1), ds, scale, cg_iters, jacobi, rtol, block_r)
        out = o.transpose(1, 2).to(q.dtype, memory_format=torch.contiguous_format, copy=True)
        o, delta, m, om = (q.new_empty(0, dtype=ct) for _ in range(4))
    return out, o, rho, delta, m, om


def _bwd_fake(do, q, k, v, lam, cu_seqlens, o, rho, delta, m, om, scale, cg_iters, jacobi, rtol, use_triton,
              block_r, block_c):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, lam))


@attnlab_op("lla_bwd", _bwd_fake)
def lla_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, cu_seqlens: Optional[Tensor], o: Tensor,
            rho: Tensor, delta: Tensor, m: Tensor, om: Tensor, scale: float, cg_iters: int, jacobi: bool, rtol: float,
            use_triton: bool, block_r: Optional[int], block_c: Optional[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dλ) in the dtypes and shapes of q, k, v, λ: the adjoint solve on the forward's statistics (o:
    the forward's aux); both paths in the k̄-centred variables (``chunk.py``)."""
    B, T, HQ, D = q.shape
    ds, de = doc_bounds(cu_seqlens, B, T, q.device)
    if use_triton:
        from attnlab.attention.ops.lla.triton import lla_bwd_triton

        dq, dk, dv, dlam = lla_bwd_triton(q.contiguous(), k.contiguous(), v.contiguous(),
                                          lam.to(torch.float32).contiguous(), ds, de, o, do, rho,
                                          delta, m, om, scale, cg_iters, jacobi, rtol, block_r, block_c)
    else:
        ct, G = _compute_dtype(q, False), HQ // k.shape[2]
        dq, dk, dv, dlam = lla_bwd_chunked(_heads_first(q, ct), _heads_first(k, ct, G), _heads_first(v, ct, G),
                                           lam.to(ct).permute(0, 2, 1), ds, rho, _heads_first(do, ct), scale,
                                           cg_iters, jacobi, rtol, block_r)
        dq = dq.transpose(1, 2)
        dk = dk.unflatten(1, (-1, G)).sum(2).transpose(1, 2)
        dv = dv.unflatten(1, (-1, G)).sum(2).transpose(1, 2)
        dlam = dlam.permute(0, 2, 1)
    return tuple(g.to(t.dtype).contiguous() for g, t in ((dq, q), (dk, k), (dv, v), (dlam, lam)))


def _setup_context(ctx, inputs, output):
    q, k, v, lam, cu_seqlens, *args = inputs
    out, o, rho, delta, m, om = output
    ctx.mark_non_differentiable(o, rho, delta, m, om)
    ctx.save_for_backward(q, k, v, lam, cu_seqlens, o, rho, delta, m, om)
    ctx.args = args


def _backward(ctx, do, *_):  # no gradient flows into the saved statistics (non-differentiable)
    grads = lla_bwd(do.contiguous(), *ctx.saved_tensors, *ctx.args)
    return (*grads, None, *(None,) * len(ctx.args))  # nothing for cu_seqlens and the non-tensor arguments


lla_fwd.register_autograd(_backward, setup_context=_setup_context)


def resolve_impl(impl: str, device: torch.device) -> str:
    check_impl(impl, IMPLS, "lla")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "chunk"
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
    block: (query, key) tile sizes; default: autotuned for Triton, (128, ·) for the chunk path.
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
        else:
            block = (None, None)  # autotuned
    br, bc = (None if b is None else int(b) for b in block)
    return lla_fwd(q, k, v, lam_full, cu_seqlens, float(scale), int(cg_iters), bool(jacobi), float(rtol), use_triton,
                   br, bc)[0]
