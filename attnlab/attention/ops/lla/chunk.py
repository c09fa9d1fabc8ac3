"""Blockwise LLA in PyTorch: the FlashLLA algorithm (LLA paper §4, docs/kernels.md "LLA") one query block at a time.

Every query block of ``block`` rows sees its key range [doc start, block end) as one ``[B, H, BR, L]``
weight tile, so memory is O(BR·T) per step; no T×T and no T×d×d tensor is formed.

Everything is written in the k̄-centred variables (per row i): p_j = w_j/ω (the softmax weights), k̄ = Σ p_j k_j,
y_j = k_j − k̄, A = Σ p_j y_j y_jᵀ + λI = Σ_c/ω, ρ_c = A⁻¹(k̄ − q). The output is the intercept
o = Σ_j p_j (1 − y_j·ρ_c) v_j (eq. 8 with Sherman–Morrison, docs/kernels.md, LLA: the δ of eq. 8 cancels).
Forward: statistics (ω, μ̃, optional Jacobi diagonal), ρ_c by CG on the matrix-free Σ_c (eq. 13), output.
Backward: the exact gradient of that function (implicit function theorem, one adjoint CG solve with the same
matrix). With g = dL/do_i, γ_j = g·v_j, s_j = p_j (1 − y_j·ρ_c) (the scores) and ḡ = Σ_j p_j γ_j = g·v̄:

    h = Σ_j p_j γ_j y_j,   u = A⁻¹h,   dλ = u·ρ_c
    ∂L/∂p_j = γ_j (1 − y_j·ρ_c) + (y_j·u + ḡ)(y_j·ρ_c) − y_j·u,   dℓ_j = p_j (∂L/∂p_j − Σ_m p_m ∂L/∂p_m)
    dq_i = u + scale·Σ_j dℓ_j k_j
    dk_j = Σ_i [p_ij (y_ij·u_i − γ_ij + ḡ_i) ρ_c,i − s_ij u_i + scale·dℓ_ij q_i],   dv_j = Σ_i s_ij g_i

Nothing here divides by δ = ω/(1 + (k̄ − q)·ρ_c), which is small for RMS-normed q, k (‖k̄ − q‖² ≫ λ): the same
gradient written in the q-centred ρ = Σ⁻¹μ and δ cancels terms of size 1/δ and in fp32 was 1000x less accurate
than softmax's (tests/attention/ops/test_lla.py). The Triton backward (``triton/bwd.py``) is this same math.

Tensors here are [B, H, T, D] (heads before time) in the compute dtype; ``doc_start`` [B, T] gives
the first visible key of every query (0, or its document's start).
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.lla.naive import cg_solve, relmm, sigma_matvec


def block_stats(qb, kb, ok, scale):
    """Weights and moments of one query block. qb: [B, H, M, D]; kb: [B, H, L, D]; ok: [B, 1, M, L] bool.
    Returns w [B, H, M, L], omega [B, H, M], mu_t [B, H, M, D], ksq_w (Σ_j w_j k_j², for Jacobi)."""
    logits = (qb @ kb.transpose(-1, -2) * scale).masked_fill(~ok, float("-inf"))
    m = logits.amax(-1, keepdim=True)
    w = torch.exp(logits - m).masked_fill(~ok, 0.0)
    return w, w.sum(-1), w @ kb, w @ (kb * kb)


def _block_mask(doc_start, r0, r1, lo, device):
    """[B, 1, M, L] visibility of keys lo..r1-1 from queries r0..r1-1."""
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(lo, r1, device=device)[None, :]
    return ((j <= i)[None] & (j[None] >= doc_start[:, r0:r1, None]))[:, None]


def _solve(kbar, kb, w, mu_t, ksq_w, rid, rhs, cg_iters, jacobi, rtol):
    """CG against Σ_c (keys centred at their weighted mean k̄ = μ̃/ω, docs/kernels.md, LLA): Σ_c⁻¹ rhs."""
    diag = None
    if jacobi:  # diag Σ_c = Σ_j w k² − ω k̄² + ridge  (the Jacobi diagonal, centred at k̄)
        diag = ksq_w - mu_t * kbar + rid[..., None]
    mv = lambda p: sigma_matvec(p, kbar, kb, w, rid)  # noqa: E731
    return cg_solve(mv, rhs, cg_iters, diag=diag, rtol=rtol)


def lla_fwd_chunked(q, k, v, lam, doc_start, scale, cg_iters, jacobi, rtol, block):
    """q, k, v: [B, H, T, D] (any strides); lam: [B, H, T]. Returns o and ρ_c = A⁻¹(k̄ − q) [B, H, T, D],
    contiguous whatever q's strides (the ``lla_fwd`` op's fake promises that layout to the compiler)."""
    B, H, T, D = q.shape
    nan = float("nan")  # poisoned: every row must be written by exactly one block
    o, rho_c = (torch.full_like(q, nan, memory_format=torch.contiguous_format) for _ in range(2))
    for r0 in range(0, T, block):
        r1 = min(T, r0 + block)
        lo = int(doc_start[:, r0].min())
        qb, kb, vb = q[:, :, r0:r1], k[:, :, lo:r1], v[:, :, lo:r1]
        w, omega, mu_t, ksq_w = block_stats(qb, kb, _block_mask(doc_start, r0, r1, lo, q.device), scale)
        kbar = mu_t / omega[..., None]
        rc = _solve(kbar, kb, w, mu_t, ksq_w, lam[:, :, r0:r1] * omega, mu_t - omega[..., None] * qb, cg_iters,
                    jacobi, rtol)  # Σ_c⁻¹ μ = A⁻¹(k̄ − q)
        o[:, :, r0:r1] = (w * (1 - relmm(rc, kbar, kb))) @ vb / omega[..., None]  # Σ_j p_j (1 − y_j·ρ_c) v_j
        rho_c[:, :, r0:r1] = rc
    return o, rho_c


def lla_bwd_chunked(q, k, v, lam, doc_start, rho_c, do, scale, cg_iters, jacobi, rtol, block):
    """Exact gradients in the k̄-centred form (see the module docstring); rho_c: the forward's ρ_c [B, H, T, D].
    Returns dq, dk, dv [B, H, T, D] and dlam [B, H, T]."""
    B, H, T, D = q.shape
    dq, dk, dv = torch.full_like(q, float("nan")), torch.zeros_like(k), torch.zeros_like(v)  # dk, dv accumulate
    dlam = q.new_full((B, H, T), float("nan"))
    for r0 in range(0, T, block):
        r1 = min(T, r0 + block)
        lo = int(doc_start[:, r0].min())
        qb, kb, vb, g, rc = q[:, :, r0:r1], k[:, :, lo:r1], v[:, :, lo:r1], do[:, :, r0:r1], rho_c[:, :, r0:r1]
        w, omega, mu_t, ksq_w = block_stats(qb, kb, _block_mask(doc_start, r0, r1, lo, q.device), scale)
        p = w / omega[..., None]
        kbar = mu_t / omega[..., None]
        yr = relmm(rc, kbar, kb)  # y_ij·ρ_c,i
        s = p * (1 - yr)  # scores
        gam = g @ vb.transpose(-1, -2)  # γ_ij
        pg = p * gam
        gv = pg.sum(-1, keepdim=True)  # g·v̄
        h = pg @ kb - gv * kbar  # Σ_j p_ij γ_ij y_ij
        u = omega[..., None] * _solve(kbar, kb, w, mu_t, ksq_w, lam[:, :, r0:r1] * omega, h, cg_iters, jacobi,
                                      rtol)  # A⁻¹h = ω Σ_c⁻¹ h
        yu = relmm(u, kbar, kb)  # y_ij·u_i
        dp = gam * (1 - yr) + (yu + gv) * yr - yu  # ∂L/∂p_ij
        dl = p * (dp - (p * dp).sum(-1, keepdim=True))  # ∂L/∂(scale·q_i·k_j), the softmax backward
        dq[:, :, r0:r1] = u + scale * (dl @ kb)
        dk[:, :, lo:r1] += (p * (yu - gam + gv)).transpose(-1, -2) @ rc - s.transpose(-1, -2) @ u \
            + scale * dl.transpose(-1, -2) @ qb
        dv[:, :, lo:r1] += s.transpose(-1, -2) @ g
        dlam[:, :, r0:r1] = (u * rc).sum(-1)
    return dq, dk, dv, dlam
