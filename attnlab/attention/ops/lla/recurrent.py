"""Single-pass LLA decode: one sweep over the KV cache per new token.

For one query q with weights w_j = exp(scale·q·k_j − m) over the cached keys, accumulate
ω, μ̃ = Σ w k, ṽ = Σ w v, Σ̃ = Σ w k kᵀ (D×D) and A = Σ w v kᵀ (D×D); then
ρ_c = Σ_c⁻¹μ with Σ_c = Σ̃ − ωk̄k̄ᵀ + λω I, k̄ = μ̃/ω (eq. 11 with the keys centred at k̄,
docs/kernels.md, LLA) by the same CG as training (same iterates), and
o = [(1 + q·ρ) ṽ − A ρ] / δ = [(1 + k̄·ρ_c) ṽ − A ρ_c] / ω (test L of ``verify_lla.py``). HBM traffic equals softmax
decode (K and V read once); every accumulator is a sum, so split-KV partials merge under max-rescaling.
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.lla.naive import cg_solve


def lla_decode(q, k, v, lam, *, scale: float | None = None, cg_iters: int = 16, jacobi: bool = False,
               rtol: float = 1e-6) -> torch.Tensor:
    """q: [B, HQ, D] (one new token per row); k, v: [B, L, HKV, D] (the visible cache, new token included);
    lam: [B, HQ] (or broadcastable). Returns o: [B, HQ, D] in q's dtype (fp32 accumulation)."""
    B, HQ, D = q.shape
    G = HQ // k.shape[2]
    scale = D**-0.5 if scale is None else scale
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(ct)
    kf = k.to(ct).transpose(1, 2).repeat_interleave(G, 1)  # [B, HQ, L, D]
    vf = v.to(ct).transpose(1, 2).repeat_interleave(G, 1)
    logits = (kf @ qf[..., None]).squeeze(-1) * scale  # [B, HQ, L]
    w = torch.exp(logits - logits.amax(-1, keepdim=True))
    omega = w.sum(-1)  # [B, HQ]
    wk = w[..., None] * kf
    mu_t, v_t = wk.sum(2), (w[..., None] * vf).sum(2)  # [B, HQ, D]
    sig_t = wk.transpose(-1, -2) @ kf  # [B, HQ, D, D]
    A = (w[..., None] * vf).transpose(-1, -2) @ kf  # Σ w v kᵀ
    rid = torch.as_tensor(lam, dtype=ct, device=q.device).expand(B, HQ) * omega
    kbar = mu_t / omega[..., None]  # CG against the k̄-centred Σ_c (docs/kernels.md, LLA)
    sigma_c = (sig_t - omega[..., None, None] * kbar[..., :, None] * kbar[..., None, :]
               + rid[..., None, None] * torch.eye(D, dtype=ct, device=q.device))
    mu = mu_t - omega[..., None] * qf
    diag = torch.diagonal(sigma_c, dim1=-2, dim2=-1) if jacobi else None
    rho_c = cg_solve(lambda p: (sigma_c @ p[..., None]).squeeze(-1), mu, cg_iters, diag=diag, rtol=rtol)
    # o = [(1 + q·ρ) ṽ − Aρ]/δ = [(1 + k̄·ρ_c) ṽ − Aρ_c]/ω (docs/kernels.md, LLA)
    o = ((1 + (kbar * rho_c).sum(-1, keepdim=True)) * v_t - (A @ rho_c[..., None]).squeeze(-1)) / omega[..., None]
    return o.to(q.dtype)
