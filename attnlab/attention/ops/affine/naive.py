"""The affine (uniform-weight) family of the Parallax paper §3.2 (docs/mechanisms.md), reference.

With uniform weights over the visible keys j ≤ i of the query's document (n_i of them) and

    v̄_i = mean v,  k̄_i = mean k,  S_i = mean v kᵀ,  H_i = mean k kᵀ + λ_i I              (eq. 9)
    S̃_i = S_i − v̄_i k̄_iᵀ,  H̃_i = H_i − k̄_i k̄_iᵀ                                          (eq. 10)

the four mechanisms are

    value_avg:      o_i = v̄_i                                           (eq. 11, probe zero)
    affine_linear:  o_i = v̄_i − S̃_i ρ_i,  ρ_i learned                   (eq. 12)
    mesa:           o_i = S_i H_i⁻¹ q_i                                  (eq. 5 / MesaNet, no intercept)
    affine_mesa:    o_i = v̄_i − S̃_i ρ*_i,  ρ*_i = H̃_i⁻¹ (k̄_i − q_i)     (eq. 13, solved probe)

affine_mesa is LLA's h → ∞ limit (λ in LLA's λω convention). Explicit d×d matrices per token and
``torch.linalg.solve``: O(T·D²) memory, for tests. Inputs [B, T, H, D] (k, v may have fewer heads: GQA);
float32 compute (float64 for float64 inputs), output in the input dtype.
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.common import visibility_mask

MECHANISMS = ("value_avg", "affine_linear", "mesa", "affine_mesa")


def naive_affine(mechanism: str, q, k, v, lam=None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """
    mechanism: one of MECHANISMS. q: [B, T, HQ, D] (the probe ρ for affine_linear; ignored by value_avg);
    k, v: [B, T, HKV, D]; lam: float, [HQ] or [B, T, HQ] (mesa, affine_mesa).
    Returns [B, T, HQ, D].
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism={mechanism!r}; choose from {list(MECHANISMS)}")
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(ct).transpose(1, 2)  # [B, HQ, T, D]
    kf = k.to(ct).transpose(1, 2).repeat_interleave(G, dim=1)
    vf = v.to(ct).transpose(1, 2).repeat_interleave(G, dim=1)
    a = visibility_mask(B, T, q.device, cu_seqlens).to(ct)  # [B|1, 1, T, T]
    a = a / a.sum(-1, keepdim=True)  # uniform weights 1/n_i
    vbar, kbar = a @ vf, a @ kf  # [B, HQ, T, D]
    if mechanism == "value_avg":
        return vbar.transpose(1, 2).to(q.dtype)
    S = torch.einsum("bhij,bhjd,bhje->bhide", a.expand(B, HQ, T, T), vf, kf)  # [B, HQ, T, D, D]
    if mechanism == "affine_linear":
        St = S - vbar[..., :, None] * kbar[..., None, :]
        o = vbar - (St @ qf[..., None]).squeeze(-1)
        return o.transpose(1, 2).to(q.dtype)
    lam = torch.as_tensor(lam, dtype=ct, device=q.device)
    lam = (lam.view(1, 1, HQ) if lam.dim() == 1 else lam).expand(B, T, HQ).permute(0, 2, 1)  # [B, HQ, T]
    H = torch.einsum("bhij,bhjd,bhje->bhide", a.expand(B, HQ, T, T), kf, kf) \
        + lam[..., None, None] * torch.eye(D, dtype=ct, device=q.device)
    if mechanism == "mesa":
        rho = torch.linalg.solve(H, qf[..., None])
        o = (S @ rho).squeeze(-1)
    else:
        Ht = H - kbar[..., :, None] * kbar[..., None, :]
        rho = torch.linalg.solve(Ht, (kbar - qf)[..., None])
        St = S - vbar[..., :, None] * kbar[..., None, :]
        o = vbar - (St @ rho).squeeze(-1)
    return o.transpose(1, 2).to(q.dtype)
