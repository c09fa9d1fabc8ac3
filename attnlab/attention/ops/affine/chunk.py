"""Chunked implementations of the affine family (see ``naive.py`` for the equations).

Building blocks, all over [B, H, T, D] tensors with ``doc_start`` [B, T] (first visible token of every
query, so states reset at document starts):

- :func:`segment_mean`: v̄, k̄, mean k² by a float64 segmented prefix sum, O(T·D);
- :func:`causal_linear`: Σ_{doc_start_i ≤ j ≤ i} (p_i·k_j) v_j, chunked linear attention (intra-chunk
  masked C×C products plus a D×D state carried across chunks and reset at document starts);
- :class:`_ImplicitSolve`: x = A(θ)⁻¹ b by CG with a gradient by the implicit function theorem
  (adjoint CG solve u = A⁻¹ ḡ; b̄ = u; θ̄ = −∂/∂θ [uᵀ A(θ) x]), so memory does not grow with the
  number of CG iterations.

Never forms T×T or T×D×D tensors (the states are (T/C)·D² at most, inside autograd).
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.lla.naive import cg_solve


def segment_mean(x: torch.Tensor, doc_start: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D] -> mean over j in [doc_start_i, i], [B, H, T, D] (x's dtype)."""
    B, H, T, D = x.shape
    c = torch.cumsum(x.to(torch.float64), dim=2)
    c = torch.cat([c.new_zeros(B, H, 1, D), c], dim=2)  # c[:, :, t] = Σ_{j<t}
    idx = doc_start.long()[:, None, :, None].expand(B, H, T, D)
    n = (torch.arange(1, T + 1, device=x.device)[None] - doc_start.long()).to(torch.float64)  # [B, T]
    s = c[:, :, 1:] - torch.gather(c, 2, idx)
    return (s / n[:, None, :, None]).to(x.dtype)


def causal_linear(p, k, v, doc_start, chunk: int = 64) -> torch.Tensor:
    """p, k: [B, H, T, DK]; v: [B, H, T, DV]; doc_start: [B, T]. Returns [B, H, T, DV] with
    o_i = Σ_{doc_start_i ≤ j ≤ i} (p_i·k_j) v_j."""
    B, H, T, DK = p.shape
    state = p.new_zeros(B, H, DK, v.shape[-1])
    ds = doc_start.long()
    outs = []
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        pc, kc, vc, dsc = p[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1], ds[:, c0:c1]
        i = torch.arange(c0, c1, device=p.device)
        ok = (i[None, :, None] >= i[None, None, :]) & (i[None, None, :] >= dsc[:, :, None])  # [B, C, C]
        scores = (pc @ kc.transpose(-1, -2)) * ok[:, None].to(p.dtype)
        carry = (dsc < c0).to(p.dtype)[:, None, :, None]  # document began before this chunk
        outs.append(scores @ vc + carry * (pc @ state))
        # state for the next chunk: the document of token c1-1, from its start
        keep = (dsc[:, -1] < c0).to(p.dtype)[:, None, None, None]
        inside = (i[None, :] >= dsc[:, -1:]).to(p.dtype)[:, None, :, None]  # [B, 1, C, 1]
        state = keep * state + (kc * inside).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=2)


class _ImplicitSolve(torch.autograd.Function):
    """x = A(θ)⁻¹ b for symmetric positive-definite A given as ``matvec(p, *theta)``."""

    @staticmethod
    def forward(ctx, b, matvec, iters, diag, rtol, *theta):
        with torch.no_grad():
            x = cg_solve(lambda p: matvec(p, *theta), b, iters, diag=diag, rtol=rtol)
        ctx.save_for_backward(x, diag, *theta)
        ctx.cfg = (matvec, iters, rtol)
        return x

    @staticmethod
    def backward(ctx, gx):
        x, diag, *theta = ctx.saved_tensors
        matvec, iters, rtol = ctx.cfg
        with torch.no_grad():
            u = cg_solve(lambda p: matvec(p, *theta), gx, iters, diag=diag, rtol=rtol)
        with torch.enable_grad():
            th = [None if t is None else t.detach().requires_grad_(ctx.needs_input_grad[5 + i])
                  for i, t in enumerate(theta)]
            need = [t for t in th if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(-(u * matvec(x, *th)).sum(), need, allow_unused=True) if need else [])
        return (u, None, None, None, None, *[next(grads) if t is not None and t.requires_grad else None for t in th])


def implicit_solve(matvec, b, iters: int, *theta, diag=None, rtol: float = 1e-6):
    """Differentiable CG solve of A(θ) x = b (A symmetric positive-definite); see the module docstring."""
    return _ImplicitSolve.apply(b, matvec, iters, diag, rtol, *theta)


def _mesa_matvec(p, k, lam, kbar, doc_start, chunk, n):
    out = causal_linear(p, k, k, doc_start, chunk) / n + lam[..., None] * p
    if kbar is not None:
        out = out - kbar * (kbar * p).sum(-1, keepdim=True)
    return out


def affine_chunked(mechanism, q, k, v, lam, doc_start, cg_iters=16, jacobi=False, rtol=1e-6, chunk=64):
    """The four mechanisms of ``naive.py`` over [B, H, T, D] (k, v already expanded to q's heads);
    lam: [B, H, T] (mesa, affine_mesa). Returns [B, H, T, D]."""
    B, H, T, D = v.shape
    n = (torch.arange(1, T + 1, device=v.device)[None] - doc_start.long()).to(v.dtype)[:, None, :, None]
    vbar = segment_mean(v, doc_start)
    if mechanism == "value_avg":
        return vbar
    kbar = segment_mean(k, doc_start)
    if mechanism == "affine_linear":  # v̄ − S̃ρ = v̄ − mean v (k·ρ) + v̄ (k̄·ρ)
        return vbar - causal_linear(q, k, v, doc_start, chunk) / n + vbar * (kbar * q).sum(-1, keepdim=True)
    affine = mechanism == "affine_mesa"
    kb = kbar if affine else None
    diag = None
    if jacobi:
        diag = segment_mean(k * k, doc_start) + lam[..., None] - (kbar * kbar if affine else 0.0)
        diag = diag.detach()
    mv = lambda p, k_, lam_, kb_: _mesa_matvec(p, k_, lam_, kb_, doc_start, chunk, n)  # noqa: E731
    rhs = (kbar - q) if affine else q
    rho = implicit_solve(mv, rhs, cg_iters, k, lam, kb, diag=diag, rtol=rtol)
    sr = causal_linear(rho, k, v, doc_start, chunk) / n  # S ρ
    if not affine:
        return sr
    return vbar - sr + vbar * (kbar * rho).sum(-1, keepdim=True)
