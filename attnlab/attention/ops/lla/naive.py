"""Local Linear Attention (Zuo et al., ICLR 2026), reference implementation: the oracle for every other path.

Per query head and query i, with kernel weights w_ij = exp(scale·q_i·k_j − m_i) over the visible keys j
(causal, same document) and centred keys z_ij = k_j − q_i (LLA eqs. 7-8; docs/mechanisms.md):

    ω_i = Σ_j w_ij,   μ_i = Σ_j w_ij z_ij,   Σ_i = Σ_j w_ij z_ij z_ijᵀ + λ_i·c_i·I
    ρ_i = Σ_i⁻¹ μ_i,  δ_i = ω_i − μ_iᵀρ_i,   o_i = Σ_j w_ij (1 − z_ijᵀρ_i) v_j / δ_i

The closed form is the definition (the exact minimiser of eq. 6 with a λ/2 penalty on W).
``ridge="omega"`` uses c_i = ω_i (the public FlashLLA convention): the output is then invariant
to the max-shift m_i, so any stabiliser gives the same function. ``ridge="const"`` uses c_i = 1 (literal
eq. 7), which is only shift-invariant without the shift (``shift=False``); kept to test the convention.

Everything is explicit here: per-row d×d matrices Σ_i ([B, H, T, D, D]) and ``torch.linalg.solve``;
O(T²·D + T·D²) memory, for small shapes only. Computes in float32 (float64 for float64 inputs).
The primitives of the blockwise algorithm (``relmm`` eq. 12, the matrix-free Σ·p of eq. 13, batched CG of
Algorithm 2, corrected) live here too and are shared by the other paths.
"""

from __future__ import annotations

from typing import Callable

import torch

from attnlab.attention.ops.common import visibility_mask


def relmm(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Eq. 12: out[..., i, j] = x_i·(k_j − q_i). x, q: [..., M, D]; k: [..., N, D] -> [..., M, N]."""
    return x @ k.transpose(-1, -2) - (x * q).sum(-1, keepdim=True)


def sigma_matvec(p, q, k, w, ridge) -> torch.Tensor:
    """Eq. 13, matrix-free Σ_i p_i = Σ_j w_ij (k_j − q_i)(k_j − q_i)ᵀp_i + ridge_i p_i for a block of rows.

    Computed as t = w ⊙ relmm(p, q, k), Σ_j t_ij k_j − (Σ_j t_ij) q_i: the centred projections come first, so
    nothing of size ω‖q‖²‖p‖ is formed and cancelled (the expanded Σ w k kᵀp − (q·p)μ̃ − (μ̃·p)q + ω(q·p)q
    lost ~30× the operand rounding with keys centred at k̄, measured with TF32 operands).
    p, q: [..., M, D]; k: [..., N, D]; w: [..., M, N] (masked weights); ridge (the λ_i·c_i added to the
    diagonal): [..., M]. Returns [..., M, D]."""
    t = w * relmm(p, q, k)
    return t @ k - t.sum(-1, keepdim=True) * q + ridge[..., None] * p


def cg_solve(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    b: torch.Tensor,
    iters: int,
    diag: torch.Tensor | None = None,
    rtol: float = 0.0,
) -> torch.Tensor:
    """Batched (preconditioned) conjugate gradients, x_0 = 0, one system per row of ``b`` ([..., D]).

    ``diag`` ([..., D]): Jacobi preconditioner (the diagonal of each system). A row stops updating once
    ‖r‖² ≤ rtol²·‖b‖² (the active mask of Algorithm 2) or when its curvature pᵀAp is not positive or not
    finite (zero right-hand side, NaN guard)."""
    x = torch.zeros_like(b)
    r = b.clone()
    z = r / diag if diag is not None else r
    p = z.clone()
    rz = (r * z).sum(-1, keepdim=True)
    thresh = (rtol**2) * (b * b).sum(-1, keepdim=True)
    for _ in range(iters):
        ap = matvec(p)
        pap = (p * ap).sum(-1, keepdim=True)
        active = (pap > 0) & torch.isfinite(pap) & ((r * r).sum(-1, keepdim=True) > thresh)
        alpha = torch.where(active, rz / torch.where(active, pap, torch.ones_like(pap)), torch.zeros_like(pap))
        x = x + alpha * p
        r = r - alpha * ap
        z = r / diag if diag is not None else r
        rz_new = (r * z).sum(-1, keepdim=True)
        beta = torch.where(active, rz_new / torch.where(rz > 0, rz, torch.ones_like(rz)), torch.zeros_like(rz))
        p = torch.where(active, z + beta * p, p)
        rz = torch.where(active, rz_new, rz)
    return x


def _expand_lam(lam, B: int, T: int, HQ: int, device, dtype) -> torch.Tensor:
    """λ as a float, [HQ] (per head) or [B, T, HQ] (per token) -> [B, HQ, T]."""
    lam = torch.as_tensor(lam, device=device, dtype=dtype)
    if lam.dim() == 1:
        lam = lam.view(1, 1, HQ)
    return lam.expand(B, T, HQ).permute(0, 2, 1)


def naive_lla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ridge: str = "omega",
    shift: bool = True,
    return_aux: bool = False,
):
    """
    q: [B, T, HQ, D]; k, v: [B, T, HKV, D] (GQA: HQ % HKV == 0).
    lam: ridge λ, a float, a [HQ] tensor (per head) or a [B, T, HQ] tensor (per token); differentiable.
    scale: 1/h of the kernel exp(scale·q·k); default D**-0.5.
    cu_seqlens: [N+1] int32 document offsets over the flattened B*T tokens.
    ridge: "omega" (λ·ω_i·I, shift-invariant, default) or "const" (λ·I, literal eq. 7).
    shift: subtract the row max of the logits (does not change the output under ridge="omega").
    Returns o: [B, T, HQ, D] in q's dtype; with ``return_aux`` also a dict of [B, HQ, T(, D)] tensors
    rho, delta, omega, m, mu and the scores s [B, HQ, T, T].
    """
    if ridge not in ("omega", "const"):
        raise ValueError(f"ridge={ridge!r}; choose from ['omega', 'const']")
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    scale = D**-0.5 if scale is None else scale
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(ct).transpose(1, 2)  # [B, HQ, T, D]
    kf = k.to(ct).transpose(1, 2).repeat_interleave(G, dim=1)
    vf = v.to(ct).transpose(1, 2).repeat_interleave(G, dim=1)
    lam_f = _expand_lam(lam, B, T, HQ, q.device, ct)  # [B, HQ, T]
    mask = visibility_mask(B, T, q.device, cu_seqlens)  # [B|1, 1, T, T]
    logits = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    m = logits.amax(-1, keepdim=True).detach() if shift else torch.zeros_like(logits[..., :1])
    w = torch.exp(logits - m).masked_fill(~mask, 0.0)  # [B, HQ, T, T]
    omega = w.sum(-1)  # [B, HQ, T]
    mu_t = w @ kf  # eq. 10
    mu = mu_t - omega[..., None] * qf  # eq. 11
    sig_t = torch.einsum("bhij,bhjd,bhje->bhide", w, kf, kf)  # [B, HQ, T, D, D]
    ridge_i = lam_f * (omega if ridge == "omega" else 1.0)
    sigma = (sig_t - mu_t[..., :, None] * qf[..., None, :] - qf[..., :, None] * mu_t[..., None, :]
             + omega[..., None, None] * qf[..., :, None] * qf[..., None, :]
             + ridge_i[..., None, None] * torch.eye(D, dtype=ct, device=q.device))  # eq. 11 + ridge
    rho = torch.linalg.solve(sigma, mu.unsqueeze(-1)).squeeze(-1)  # [B, HQ, T, D]
    delta = omega - (mu * rho).sum(-1)
    s = w * (1 - relmm(rho, qf, kf)) / delta[..., None]  # eq. 8 / 16
    o = (s @ vf).transpose(1, 2).to(q.dtype)
    if return_aux:
        return o, dict(rho=rho, delta=delta, omega=omega, m=m.squeeze(-1), mu=mu, s=s)
    return o
