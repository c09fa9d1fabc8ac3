"""PaTH attention reference (Yang et al., 2025): softmax attention with a Householder-product position
encoding (Variants eqs. 32-33).

    A_{t,i} = k_i^T P_{i+1:t} q_t,   P_{i+1:t} = M_{i+1} ··· M_t,   M_j = I − β_j ν_j ν_j^T
    o_t = Σ_{i<=t} softmax_i( scale · (A_{t,i} + c_t − c_i) ) v_i                     (fla's convention)

with ‖ν_j‖ = 1, β_j ∈ (0, 2), and an optional forget gate (``c`` = per-document cumsum of log gates; fla
scales the gate together with the scores). Computed token by token with the decode form: the
cached keys are replaced by ``M_t k_i`` at every step, so at step t the cache holds ``P_{i+1:t}^T k_i``.
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.fox.naive import doc_cumsum


def naive_path_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, T, HQ, D]; k, w: [B, T, H, D] (w = ν, L2-normalised by the caller); v: [B, T, H, DV];
    beta: [B, T, H] in (0, 2); g: [B, T, HQ] log forget gate or None. GQA: q head h uses kv head
    h // (HQ / H). scale defaults to D**-0.5. cu_seqlens: [N+1] document offsets over the flattened B*T
    tokens (every row starts a document). Returns o: [B, T, HQ, DV] in q's dtype."""
    B, T, HQ, D = q.shape
    if cu_seqlens is not None and B > 1:  # documents index the flattened B*T tokens: one row of B*T
        flat = [None if t is None else t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, w, beta, g)]
        return naive_path_attn(*flat, scale=scale, cu_seqlens=cu_seqlens).view(B, T, HQ, -1)
    G = HQ // k.shape[2]
    scale = D**-0.5 if scale is None else scale
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf, wf, bf = (t.to(cdt) for t in (q, k, v, w, beta))
    c = doc_cumsum(g.to(cdt), cu_seqlens) if g is not None else None
    if cu_seqlens is None:
        segs = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        segs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros(B, T, HQ, v.shape[-1], dtype=cdt, device=q.device)
    for b, s, e in segs:
        kc = kf.new_zeros(kf.shape[2], 0, D)  # [H, n, D] transformed keys
        for t in range(s, e):
            nu, bt = wf[b, t], bf[b, t]  # [H, D], [H]
            kc = kc - bt[:, None, None] * (kc @ nu[:, :, None]) * nu[:, None, :]  # k_i <- M_t k_i
            kc = torch.cat([kc, kf[b, t][:, None]], dim=1)
            logit = (kc.repeat_interleave(G, 0) @ qf[b, t][:, :, None])[..., 0]  # [HQ, n]
            if c is not None:
                logit = logit + c[b, t][:, None] - c[b, s:t + 1].T
            p = torch.softmax(scale * logit, dim=-1)
            o[b, t] = (p[:, :, None] * vf[b, s:t + 1].transpose(0, 1).repeat_interleave(G, 0)).sum(1)
    return o.to(q.dtype)
