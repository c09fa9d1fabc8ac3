"""Blockwise FoX in PyTorch: FlashAttention-style online softmax over key blocks (docs/mechanisms.md, "FoX").

Each tile computes ``scale · Q_I K_J^T + c_I − c_J`` and updates the running (max, sum, acc) per query
row. The loop runs over the block distance δ = I − J and is vectorised over all query blocks, so there
are ``ceil(T / block_size)`` Python iterations. Runs anywhere (CPU included), with autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.attention.ops.common import document_ids
from attnlab.attention.ops.fox.naive import doc_cumsum


def chunk_forgetting_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    block_size: int = 64,
) -> torch.Tensor:
    """Same contract as :func:`naive_forgetting_attn` (q [B,T,HQ,D], k/v [B,T,HKV,·], g [B,T,HQ])."""
    B, T, HQ, D = q.shape
    DV = v.shape[-1]
    G = HQ // k.shape[2]
    m = block_size
    scale = D**-0.5 if scale is None else scale
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    c = doc_cumsum(g.to(cdt), cu_seqlens)  # [B, T, HQ]
    doc = document_ids(cu_seqlens, B, T) if cu_seqlens is not None else torch.zeros(B, T, dtype=torch.long, device=q.device)
    NB = -(-T // m)
    pad = NB * m - T
    pos = torch.arange(NB * m, device=q.device)
    doc = F.pad(doc, (0, pad), value=-1)  # padded keys belong to no document

    def blocks(x):  # [B, T, H, X] -> [B, H, NB, m, X]
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.view(B, NB, m, x.shape[2], x.shape[3]).permute(0, 3, 1, 2, 4)

    qb = blocks(q.to(cdt) * scale)
    kb = blocks(k.to(cdt)).repeat_interleave(G, 1)
    vb = blocks(v.to(cdt)).repeat_interleave(G, 1)
    cb = blocks(c[..., None])[..., 0]  # [B, HQ, NB, m]
    docb, posb = doc.view(B, 1, NB, m), pos.view(1, 1, NB, m)
    mrow = torch.full((B, HQ, NB, m), float("-inf"), dtype=cdt, device=q.device)
    lrow = torch.zeros(B, HQ, NB, m, dtype=cdt, device=q.device)
    acc = torch.zeros(B, HQ, NB, m, DV, dtype=cdt, device=q.device)
    for d in range(NB):  # key block J = I - d for every query block I >= d
        sl_q, sl_k = slice(d, NB), slice(0, NB - d)
        s = qb[:, :, sl_q] @ kb[:, :, sl_k].transpose(-1, -2)  # [B, HQ, NB-d, m, m]
        s = s + cb[:, :, sl_q, :, None] - cb[:, :, sl_k, None, :]
        ok = (posb[:, :, sl_q, :, None] >= posb[:, :, sl_k, None, :]) & (docb[:, :, sl_q, :, None] == docb[:, :, sl_k, None, :])
        s = s.masked_fill(~ok, float("-inf"))
        m_new = torch.maximum(mrow[:, :, sl_q], s.amax(-1))
        m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)  # rows that saw no key yet
        p = torch.exp(s - m_safe[..., None])
        corr = torch.exp(mrow[:, :, sl_q] - m_safe)
        lrow = torch.cat([lrow[:, :, :d], lrow[:, :, sl_q] * corr + p.sum(-1)], dim=2)
        acc = torch.cat([acc[:, :, :d], acc[:, :, sl_q] * corr[..., None] + p @ vb[:, :, sl_k]], dim=2)
        mrow = torch.cat([mrow[:, :, :d], m_new], dim=2)
    o = acc / lrow.clamp_min(torch.finfo(cdt).tiny)[..., None]  # padded query rows have l = 0
    o = o.permute(0, 2, 3, 1, 4).reshape(B, NB * m, HQ, DV)[:, :T]
    return o.to(q.dtype)
