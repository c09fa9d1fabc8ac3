"""Context-Aggregated Linear Attention (CALA; Morgan 2025): naive per-token reference.

Per head (CALA Steps 3-6, App. A "Option A", App. C causal form; docs/mechanisms.md):

    Q'_loc, K'_loc = φ_loc(Q), φ_loc(K)                                   (φ_loc = elu + 1)
    C_Q[i] = Σ_{j∈N(i)} softmax_j(Q'_loc,i·K'_loc,j / √d) Q_j,   N(i) = {max(0, i−w), ..., i−1}  (excludes i)
    C_K[i] = Σ_{j∈N(i)} softmax_j(K'_loc,i·K'_loc,j / √d) K_j,   C = 0 when N(i) is empty
    Q'' = φ_glob(LN_q(Q + C_Q)),  K'' = φ_glob(LN_k(K + C_K))
    o_i = Σ_{j≤i} (Q''_i·K''_j) v_j / (Σ_{j≤i} Q''_i·K''_j + ε),  ε = 1e-6

Written as explicit loops (float64); windows and sums never cross a document of ``cu_seqlens``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.attention.ops.common import document_ids


def local_feature(x: torch.Tensor, name: str = "elu") -> torch.Tensor:
    """φ_loc: strictly positive ("elu": elu(x)+1, "softplus")."""
    if name == "elu":
        return F.elu(x) + 1
    if name == "softplus":
        return F.softplus(x)
    raise ValueError(f"attention.cala.local_feature_map={name!r}; choose from ['elu', 'softplus']")


def naive_local_context(q, k, window: int, *, cu_seqlens=None, local_map: str = "elu", start: int = 0):
    """C_Q, C_K: [B, T, H, D] (rows < ``start`` left zero). q, k: [B, T, H, D]; float64 loop over tokens."""
    B, T, H, D = q.shape
    qf, kf = q.double(), k.double()
    ql, kl = local_feature(qf, local_map), local_feature(kf, local_map)
    doc = document_ids(cu_seqlens, B, T) if cu_seqlens is not None else torch.zeros(B, T, dtype=torch.long)
    cq, ck = torch.zeros_like(qf), torch.zeros_like(kf)
    for b in range(B):
        for i in range(start, T):
            js = [j for j in range(max(0, i - window), i) if doc[b, j] == doc[b, i]]
            if not js:
                continue
            kj = kl[b, js]  # [n, H, D]
            aq = torch.softmax(torch.einsum("hd,nhd->hn", ql[b, i], kj) / D**0.5, -1)
            ak = torch.softmax(torch.einsum("hd,nhd->hn", kl[b, i], kj) / D**0.5, -1)
            cq[b, i] = torch.einsum("hn,nhd->hd", aq, qf[b, js])
            ck[b, i] = torch.einsum("hn,nhd->hd", ak, kf[b, js])
    return cq, ck


def naive_cala(q, k, v, window: int, ln_q, ln_k, phi_glob, *, eps: float = 1e-6, cu_seqlens=None,
               local_map: str = "elu"):
    """Full CALA mixing. q, k, v: [B, T, H, D]; ln_q, ln_k, phi_glob: callables on [..., D] (float64).
    Returns [B, T, H, D] float64."""
    B, T, H, D = q.shape
    cq, ck = naive_local_context(q, k, window, cu_seqlens=cu_seqlens, local_map=local_map)
    qg = phi_glob(ln_q(q.double() + cq))  # [B, T, H, F]
    kg = phi_glob(ln_k(k.double() + ck))
    vf = v.double()
    doc = document_ids(cu_seqlens, B, T) if cu_seqlens is not None else torch.zeros(B, T, dtype=torch.long)
    o = torch.zeros_like(vf)
    for b in range(B):
        for i in range(T):
            js = [j for j in range(i + 1) if doc[b, j] == doc[b, i]]
            w = torch.einsum("hf,nhf->hn", qg[b, i], kg[b, js])  # [H, n]
            o[b, i] = torch.einsum("hn,nhd->hd", w, vf[b, js]) / (w.sum(-1, keepdim=True) + eps)
    return o
