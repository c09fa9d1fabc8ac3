"""Blockwise LLA in PyTorch: the FlashLLA algorithm (LLA paper §4, docs/kernels.md "LLA") one query block at a time.

Every query block of ``block`` rows sees its key range [doc start, block end) as one ``[B, H, BR, L]``
weight tile, so memory is O(BR·T) per step; no T×T and no T×d×d tensor is formed. Forward: statistics
(ω, μ̃, optional Jacobi diagonal), ρ by CG on the matrix-free Σ (eq. 13), δ, output (eq. 16).
Backward: the exact gradient of the λω-ridge forward (the paper's backward, corrected, with the λω ridge's
term added), with the second (adjoint) CG solve u = Σ⁻¹ Σ_j c_ij z_ij, and dλ_i = c·(u_iᵀρ_i − β_i‖ρ_i‖²).

Derivation used here (per row i; g = dL/do_i, γ_j = g·v_j, a_j = w_j n_j / δ, n_j = 1 − z_jᵀρ):
    β = g·o/δ,  c_j = γ_j w_j/δ,  τ = Σ c_j,  u = Σ⁻¹(Σ c_j k_j − τ q),  Δμ = 2βρ − u,
    tr G = u·ρ − β‖ρ‖²   (G = ∂L/∂Σ),
    F_j = w_j ∂L/∂w_j = γ_j a_j + w_j[−β + z_j·Δμ + (z_j·u)(z_j·ρ) − β(z_j·ρ)² + λ·tr G]
    dq_i = scale·Σ_j F_j k_j + τρ − δΔμ − (u·μ)ρ
    dk_j = Σ_i [scale·F_ij q_i + w_ij n_ij Δμ_i + (w_ij z_ij·u_i − c_ij) ρ_i],   dv_j = Σ_i a_ij g_i
(the λ·tr G term and dλ's factor ω_i only with ridge "omega"; m is a constant because the λω-ridge
output does not depend on it). This is also the math of the Triton kernels.

Tensors here are [B, H, T, D] (heads before time) in the compute dtype; ``doc_start`` [B, T] gives
the first visible key of every query (0, or its document's start).
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.lla.naive import cg_solve, from_centred, relmm, sigma_matvec, solve_via_centred


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
    """CG against Σ_c (keys centred at their weighted mean k̄ = μ̃/ω, :func:`naive.from_centred`): Σ_c⁻¹ rhs."""
    diag = None
    if jacobi:  # diag Σ_c = Σ_j w k² − ω k̄² + ridge  (the Jacobi diagonal, centred at k̄)
        diag = ksq_w - mu_t * kbar + rid[..., None]
    mv = lambda p: sigma_matvec(p, kbar, kb, w, rid)  # noqa: E731
    return cg_solve(mv, rhs, cg_iters, diag=diag, rtol=rtol)


def lla_fwd_chunked(q, k, v, lam, doc_start, scale, cg_iters, jacobi, ridge_omega, rtol, block):
    """q, k, v: [B, H, T, D] (any strides); lam: [B, H, T]. Returns o [B, H, T, D], rho [B, H, T, D], delta
    [B, H, T], contiguous whatever q's strides (the ``lla_fwd`` op's fake promises that layout to the compiler)."""
    B, H, T, D = q.shape
    nan = float("nan")  # poisoned: every row must be written by exactly one block
    o, rho = (torch.full_like(q, nan, memory_format=torch.contiguous_format) for _ in range(2))
    delta = q.new_full((B, H, T), nan)
    for r0 in range(0, T, block):
        r1 = min(T, r0 + block)
        lo = int(doc_start[:, r0].min())
        qb, kb, vb = q[:, :, r0:r1], k[:, :, lo:r1], v[:, :, lo:r1]
        w, omega, mu_t, ksq_w = block_stats(qb, kb, _block_mask(doc_start, r0, r1, lo, q.device), scale)
        rid = lam[:, :, r0:r1] * (omega if ridge_omega else 1.0)
        mu = mu_t - omega[..., None] * qb
        kbar = mu_t / omega[..., None]
        rc = _solve(kbar, kb, w, mu_t, ksq_w, rid, mu, cg_iters, jacobi, rtol)
        rb, db = from_centred(rc, mu, omega)
        # eq. 16 in the centred form: w_j (1 − z_j·ρ)/δ = w_j (1 − (k_j − k̄)·ρ_c)/ω, no 1/δ amplification
        o[:, :, r0:r1] = (w * (1 - relmm(rc, kbar, kb))) @ vb / omega[..., None]
        rho[:, :, r0:r1], delta[:, :, r0:r1] = rb, db
    return o, rho, delta


def lla_bwd_chunked(q, k, v, lam, doc_start, o, rho, delta, do, scale, cg_iters, jacobi, ridge_omega, rtol,
                    block):
    """Exact gradients (see the module docstring). Returns dq, dk, dv [B, H, T, D] and dlam [B, H, T]."""
    B, H, T, D = q.shape
    dq, dk, dv = torch.full_like(q, float("nan")), torch.zeros_like(k), torch.zeros_like(v)  # dk, dv accumulate
    dlam = q.new_full((B, H, T), float("nan"))
    for r0 in range(0, T, block):
        r1 = min(T, r0 + block)
        lo = int(doc_start[:, r0].min())
        qb, kb, vb, g = q[:, :, r0:r1], k[:, :, lo:r1], v[:, :, lo:r1], do[:, :, r0:r1]
        rb, db, lb = rho[:, :, r0:r1], delta[:, :, r0:r1], lam[:, :, r0:r1]
        w, omega, mu_t, ksq_w = block_stats(qb, kb, _block_mask(doc_start, r0, r1, lo, q.device), scale)
        rid = lb * (omega if ridge_omega else 1.0)
        mu = mu_t - omega[..., None] * qb
        zr = relmm(rb, qb, kb)  # z_ij·ρ_i
        wn = w * (1 - zr)
        a = wn / db[..., None]  # scores s_ij
        gam = g @ vb.transpose(-1, -2)  # γ_ij
        beta = (g * o[:, :, r0:r1]).sum(-1) / db
        c = gam * w / db[..., None]
        tau = c.sum(-1)
        y = c @ kb - tau[..., None] * qb
        a_c = _solve(mu_t / omega[..., None], kb, w, mu_t, ksq_w, rid, y, cg_iters, jacobi, rtol)
        u = solve_via_centred(a_c, rb, mu, omega)
        dmu = 2 * beta[..., None] * rb - u
        trg = (u * rb).sum(-1) - beta * (rb * rb).sum(-1)
        zu = relmm(u, qb, kb)
        lam_term = (lb * trg) if ridge_omega else torch.zeros_like(trg)
        f = gam * a + w * (-beta[..., None] + relmm(dmu, qb, kb) + zu * zr - beta[..., None] * zr * zr
                           + lam_term[..., None])
        dq[:, :, r0:r1] = (scale * (f @ kb) + tau[..., None] * rb - db[..., None] * dmu
                           - (u * mu).sum(-1, keepdim=True) * rb)
        dk[:, :, lo:r1] += scale * f.transpose(-1, -2) @ qb + wn.transpose(-1, -2) @ dmu \
            + (w * zu - c).transpose(-1, -2) @ rb
        dv[:, :, lo:r1] += a.transpose(-1, -2) @ g
        dlam[:, :, r0:r1] = trg * (omega if ridge_omega else 1.0)
    return dq, dk, dv, dlam
