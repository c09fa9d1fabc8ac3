"""FoX (Forgetting Transformer, Lin et al. 2025) reference: softmax attention with a forget-gate bias.

    o_t = Σ_{i<=t} softmax_i( scale · q_t·k_i + c_t − c_i ) v_i,    c_t = Σ_{j<=t} log f_j      (Variants eq. 31)

with ``log f = logsigmoid(·) <= 0`` per query head (fla's convention: the gate is not scaled). O(T²) memory;
float64 inputs are computed in float64, others in float32.
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.common import document_ids


def doc_cumsum(g: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Inclusive cumulative log gate, restarted at every document. g: [B, T, H] -> c: [B, T, H]."""
    c = g.cumsum(1)
    if cu_seqlens is None:
        return c
    B, T, H = g.shape
    starts = cu_seqlens[:-1].long()
    before = torch.zeros(B * T, H, dtype=c.dtype, device=c.device)
    cf = c.reshape(B * T, H)
    tok = torch.arange(B * T, device=c.device)
    doc = torch.searchsorted(cu_seqlens[1:].long(), tok, right=True)
    s = starts[doc]
    before = torch.where((s > 0)[:, None], cf[(s - 1).clamp_min(0)], before)
    return (cf - before).view(B, T, H)


def naive_forgetting_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, T, HQ, D]; k: [B, T, HKV, D]; v: [B, T, HKV, DV]; g: [B, T, HQ] log forget gate.

    GQA: query head h reads kv head h // (HQ / HKV). cu_seqlens: [N+1] documents over B*T tokens (fla
    varlen). scale defaults to D**-0.5. Returns o: [B, T, HQ, DV] in q's dtype.
    """
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    scale = D**-0.5 if scale is None else scale
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(cdt).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    kf, vf = kf.repeat_interleave(G, 1), vf.repeat_interleave(G, 1)
    c = doc_cumsum(g.to(cdt), cu_seqlens).transpose(1, 2)  # [B, HQ, T]
    s = scale * qf @ kf.transpose(-1, -2) + c[..., :, None] - c[..., None, :]  # [B, HQ, T, T]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, B, T)  # [B, T]
        mask = mask & (doc[:, :, None] == doc[:, None, :])[:, None]
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return (p @ vf).transpose(1, 2).to(q.dtype)
