"""Higher-order Linear Attention (Zhang, Qin, Gu 2025, arXiv:2510.27258): naive definitions (the oracle).

Everything here is written from the *definitions* (HLA eqs. 3, 7 and the masked third order;
docs/mechanisms.md, "HLA"), not from the recurrences, with per-token log-decays ``g``
(``b(i,t) = exp(g_{i+1} + ... + g_t)``; a fixed γ is ``g = log γ``; ``g=None`` is no decay). Each factor decays by
its own age, so the recurrence and a chunk scan agree.

- second order (masked, eq. 3):  o_t = Σ_{i≤j≤t} b(i,t) b(j,t) (q_t·k_i)(k_i·q_j) v_j
- AHLA (eq. 7):                   o_t = Σ_{j≤i≤t} b(i,t) b(j,i) (q_t·k_i)(q_i·k_j) v_j      = (A_γ A_γ) V
- third order (masked):           o_t = Σ_{u≤t} Σ_{i≤u} Σ_{j≤u} b(i,t) b(u,t) b(j,t) (q_t·k_i)(k_i·q_u)(q_u·k_j) v_j

Normalised variants divide by the same sum with v ≡ 1 (``safe_div``: sign(den)(|den|+ε), a documented deviation
from the paper's den+ε (eq. 4) because the masked denominator is not sign-definite).
Shapes: q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] (log-decays ≤ 0) or None; returns [B, T, H, V].
Cost O(T³) (second order, AHLA) and O(T⁴) (third order): tiny T only. Computes in float64.
The scan operators (as printed in the paper and corrected) are at the end, for associativity tests.
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.common import document_ids


def safe_div(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """num / (sign(den)·(|den| + eps)); sign(0) = +1. num: [..., V], den: [...]."""
    den = torch.where(den >= 0, den + eps, den - eps)
    return num / den.unsqueeze(-1)


def _prep(q, k, v, g, cu_seqlens):
    """-> float64 [B, H, T, *] tensors, log-decay matrix Lg[b,h,t,i] = log b(i,t) (−inf where i>t or other doc)."""
    B, T, H, _ = q.shape
    qf, kf, vf = (x.double().transpose(1, 2) for x in (q, k, v))  # [B, H, T, *]
    G = torch.zeros(B, H, T, dtype=torch.float64, device=q.device) if g is None else g.double().transpose(1, 2).cumsum(-1)
    t = torch.arange(T, device=q.device)
    mask = (t[:, None] >= t[None, :])[None, None]  # [1, 1, T, T]
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, B, T)
        mask = mask & (doc[:, :, None] == doc[:, None, :])[:, None]
    Lg = torch.where(mask, G[..., :, None] - G[..., None, :], float("-inf"))  # [B, H, T, T]
    return qf, kf, vf, Lg


def _finish(num, den, normalize, eps, dtype):
    o = safe_div(num, den, eps) if normalize else num
    return o.transpose(1, 2).to(dtype)


def naive_hla2(q, k, v, g=None, *, normalize=False, eps=1e-6, cu_seqlens=None):
    """Masked second-order HLA as the triple sum over i ≤ j ≤ t (HLA eq. 3, each factor decayed by its age)."""
    qf, kf, vf, Lg = _prep(q, k, v, g, cu_seqlens)
    B, H, T, _ = qf.shape
    qk = qf @ kf.transpose(-1, -2)  # [B, H, t, i] q_t·k_i
    W = torch.exp(Lg[..., :, :, None] + Lg[..., :, None, :])  # [B, H, t, i, j] = b(i,t) b(j,t)
    tri = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # [j, i]: i <= j
    W = W * tri.T[None, None, None]  # keep i <= j
    coef = torch.einsum("bhti,bhji,bhtij->bhtj", qk, qk, W)  # (q_t·k_i)(q_j·k_i)
    return _finish(coef @ vf, coef.sum(-1), normalize, eps, q.dtype)


def naive_hla2_matrix(q, k, v):
    """Undecayed masked HLA in the paper's matrix form O = tril(A Aᵀ) V, A = tril(Q Kᵀ) (one doc, float64)."""
    qf, kf, vf = (x.double().transpose(1, 2) for x in (q, k, v))
    A = (qf @ kf.transpose(-1, -2)).tril()
    return ((A @ A.transpose(-1, -2)).tril() @ vf).transpose(1, 2)


def naive_ahla(q, k, v, g=None, *, normalize=False, eps=1e-6, cu_seqlens=None):
    """AHLA O = (A_γ A_γ) V with A_γ[t, i] = b(i,t) q_t·k_i, i ≤ t (HLA eq. 7)."""
    qf, kf, vf, Lg = _prep(q, k, v, g, cu_seqlens)
    A = (qf @ kf.transpose(-1, -2)) * torch.exp(Lg)  # [B, H, T, T]
    AA = A @ A
    return _finish(AA @ vf, AA.sum(-1), normalize, eps, q.dtype)


def naive_hla3(q, k, v, g=None, *, normalize=False, eps=1e-6, cu_seqlens=None):
    """Masked third order (docs/mechanisms.md, "HLA") as the explicit sum over triples (i, u, j), per t."""
    qf, kf, vf, Lg = _prep(q, k, v, g, cu_seqlens)
    B, H, T, _ = qf.shape
    qk = qf @ kf.transpose(-1, -2)  # [B, H, a, b] q_a·k_b
    tri = torch.ones(T, T, dtype=torch.bool, device=q.device).tril().double()  # [u, i]: i <= u
    nums, dens = [], []
    for t in range(T):
        bt = torch.exp(Lg[:, :, t])  # [B, H, s] = b(s, t) (0 for s > t or other doc)
        # weight[i,u,j] = b(i,t) b(u,t) b(j,t) [i<=u][j<=u]
        w = bt[..., :, None, None] * bt[..., None, :, None] * bt[..., None, None, :]
        w = w * tri.T[None, None, :, :, None] * tri[None, None, None, :, :]
        coef = torch.einsum("bhi,bhui,bhuj,bhiuj->bhj", qk[:, :, t], qk, qk, w)  # [B, H, j]
        nums.append(torch.einsum("bhj,bhjv->bhv", coef, vf))
        dens.append(coef.sum(-1))
    return _finish(torch.stack(nums, 2), torch.stack(dens, 2), normalize, eps, q.dtype)


def naive_hla3_matrix(q, k, v):
    """Undecayed masked third order in matrix form O = tril(A Aᵀ)(A V)."""
    qf, kf, vf = (x.double().transpose(1, 2) for x in (q, k, v))
    A = (qf @ kf.transpose(-1, -2)).tril()
    return ((A @ A.transpose(-1, -2)).tril() @ (A @ vf)).transpose(1, 2)


def naive_hla3_paper(q, k, v):
    """What the paper's Thm 7.1 / Alg. 3 actually computes (a paper erratum): the sum over triples (i, u, j) ≤ t whose
    maximum index is attained at least twice. Single head, q, k: [T, K], v: [T, V] -> [T, V]."""
    qk = q.double() @ k.double().T
    T = q.shape[0]
    out = torch.zeros(T, v.shape[1], dtype=torch.float64)
    for t in range(T):
        for i in range(t + 1):
            for u in range(t + 1):
                for j in range(t + 1):
                    m = max(i, u, j)
                    if (i == m) + (u == m) + (j == m) >= 2:
                        out[t] += qk[t, i] * qk[u, i] * qk[u, j] * v[j].double()
    return out


# ---- scan operators (the paper's associative operators); segments are dicts of per-head tensors -------------------------

def token_segment(q, k, v):
    """Single-token segment of the masked second-order tuple (S, C, m, G, h) with ρ = γ."""
    return dict(S=torch.outer(k, k), C=torch.outer(q, v), m=q.clone(), G=torch.zeros(q.shape[0], v.shape[0], dtype=q.dtype),
                h=torch.zeros_like(q))


def op_masked(A, B):
    """Eq. (6)/(4.1), undecayed masked semidirect product."""
    return dict(S=A["S"] + B["S"], C=A["C"] + B["C"], m=A["m"] + B["m"],
                G=A["G"] + B["G"] + B["S"] @ A["C"], h=A["h"] + B["h"] + B["S"] @ A["m"])


def op_decay(A, B, *, paper: bool = False):
    """Decayed masked operator ⊕_γ; ``paper=True`` is the printed (non-associative) one, else the corrected
    G_AB = ρ_B² G_A + G_B + ρ_B S_B C_A (the paper's decayed operator, corrected). Segments carry ``rho``."""
    r = B["rho"]
    out = dict(S=r * A["S"] + B["S"], C=r * A["C"] + B["C"], m=r * A["m"] + B["m"], rho=A["rho"] * B["rho"])
    if paper:
        out["G"] = r * A["G"] + B["G"] + B["S"] @ (r * A["C"])
        out["h"] = r * A["h"] + B["h"] + B["S"] @ (r * A["m"])
    else:
        out["G"] = r * r * A["G"] + B["G"] + r * B["S"] @ A["C"]
        out["h"] = r * r * A["h"] + B["h"] + r * B["S"] @ A["m"]
    return out


def ahla_token_segment(q, k, v):
    """Single-token AHLA segment (R, P, m, E, n); E is nonzero."""
    qk = q @ k
    return dict(R=torch.outer(k, q), P=torch.outer(k, v), m=k.clone(), E=qk * torch.outer(k, v), n=qk * k)


def op_ahla(A, B, *, decay_R: bool = False):
    """HLA eq. (8), third order, with decay; R must not decay (a paper erratum): ``decay_R=True`` reproduces the
    printed operator."""
    r = B["rho"]
    return dict(R=(r * A["R"] if decay_R else A["R"]) + B["R"], P=r * A["P"] + B["P"], m=r * A["m"] + B["m"],
                E=r * A["E"] + B["E"] + B["R"] @ (r * A["P"]), n=r * A["n"] + B["n"] + B["R"] @ (r * A["m"]),
                rho=A["rho"] * B["rho"])
