"""Blockwise PaTH attention in PyTorch (Variants eq. 34, tiling algorithm with one local inverse per block).

Per block J of m tokens (N_J = ν rows, β_J):

    Λ_J = (I_m + strictLower(diag(β_J) N_J N_J^T))^{-1} diag(β_J)        (unit lower triangular solve)
    A_JJ = lower(Q_J K_J^T) − lower(Q_J N_J^T) Λ_J strictLower(N_J K_J^T)
    Q⃖_J = Q_J − lower(Q_J N_J^T) Λ_J N_J        (rows (P_{J1:t} q_t)^T)
    K⃗_J = K_J − strictLower(N_J K_J^T)^T Λ_J^T N_J   (rows (P_{i+1:J2}^T k_i)^T)

and for a query block I and key block J < I, ``A_IJ = Q_int K⃗_J^T`` where ``Q_int`` starts at Q⃖_I and
is multiplied by ``P_J^T = I − N_J^T Λ_J N_J`` (a rank-m update) as J walks right to left. The walk over
the block distance δ = I − J is vectorised over all I, with a FlashAttention-style online softmax, so
there are ``ceil(T / block_size)`` Python iterations. Packed documents only need the mask: a pair in one
document has its whole path inside that document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.attention.ops.common import document_ids
from attnlab.attention.ops.fox.naive import doc_cumsum


def _blocks(x: torch.Tensor, NB: int, m: int) -> torch.Tensor:
    """[B, T, H, X] -> [B, H, NB, m, X] (zero padded)."""
    B, T, H, X = x.shape
    x = F.pad(x, (0, 0, 0, 0, 0, NB * m - T))
    return x.view(B, NB, m, H, X).permute(0, 3, 1, 2, 4)


def chunk_path_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    block_size: int = 64,
) -> torch.Tensor:
    """Same contract as :func:`naive_path_attn`."""
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    m = block_size
    NB = -(-T // m)
    scale = D**-0.5 if scale is None else scale
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = lambda x: x.repeat_interleave(G, 1)  # noqa: E731  kv heads -> query heads
    Q = _blocks(q.to(cdt), NB, m)  # [B, HQ, NB, m, D]
    K, N, Vb = (rep(_blocks(t.to(cdt), NB, m)) for t in (k, w, v))
    bet = rep(_blocks(beta.to(cdt)[..., None], NB, m))[..., 0]  # [B, HQ, NB, m] (padding: β = 0, M = I)
    ones = torch.ones(m, m, dtype=torch.bool, device=q.device)
    low, slow = ones.tril(), ones.tril(-1)

    NNt = N @ N.transpose(-1, -2)
    Tm = torch.eye(m, dtype=cdt, device=q.device) + (bet[..., :, None] * NNt) * slow
    Lam = torch.linalg.solve_triangular(Tm, torch.diag_embed(bet), upper=False, unitriangular=True)
    QNt = (Q @ N.transpose(-1, -2)) * low
    NKt = (N @ K.transpose(-1, -2)) * slow
    A_diag = (Q @ K.transpose(-1, -2)) * low - QNt @ Lam @ NKt
    Qint = (Q - QNt @ Lam @ N)[:, :, 1:]  # Q⃖_I for query blocks I >= 1 (block 0 has no earlier keys)
    Kar = K - NKt.transpose(-1, -2) @ Lam.transpose(-1, -2) @ N

    c = doc_cumsum(g.to(cdt), cu_seqlens) if g is not None else torch.zeros(B, T, HQ, dtype=cdt, device=q.device)
    cb = _blocks(c[..., None], NB, m)[..., 0]  # [B, HQ, NB, m]
    doc = document_ids(cu_seqlens, B, T) if cu_seqlens is not None else torch.zeros(B, T, dtype=torch.long, device=q.device)
    docb = F.pad(doc, (0, NB * m - T), value=-1).view(B, 1, NB, m)
    posb = torch.arange(NB * m, device=q.device).view(1, 1, NB, m)

    mrow = torch.full((B, HQ, NB, m), float("-inf"), dtype=cdt, device=q.device)
    lrow = torch.zeros(B, HQ, NB, m, dtype=cdt, device=q.device)
    acc = torch.zeros(B, HQ, NB, m, Vb.shape[-1], dtype=cdt, device=q.device)
    for d in range(NB):  # key block J = I - d for all query blocks I >= d
        sq, sk = slice(d, NB), slice(0, NB - d)
        if d == 0:
            A = A_diag
        else:
            A = Qint @ Kar[:, :, sk].transpose(-1, -2)
            # Q_int <- Q_int P_J^T for J = I - d, then drop I = d (it has no key block I - d - 1)
            Qint = Qint - (Qint @ N[:, :, sk].transpose(-1, -2)) @ Lam[:, :, sk] @ N[:, :, sk]
            Qint = Qint[:, :, 1:]
        s = scale * (A + cb[:, :, sq, :, None] - cb[:, :, sk, None, :])
        ok = (posb[:, :, sq, :, None] >= posb[:, :, sk, None, :]) & (docb[:, :, sq, :, None] == docb[:, :, sk, None, :])
        s = s.masked_fill(~ok, float("-inf"))
        m_new = torch.maximum(mrow[:, :, sq], s.amax(-1))
        m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)
        p = torch.exp(s - m_safe[..., None])
        corr = torch.exp(mrow[:, :, sq] - m_safe)
        lrow = torch.cat([lrow[:, :, :d], lrow[:, :, sq] * corr + p.sum(-1)], dim=2)
        acc = torch.cat([acc[:, :, :d], acc[:, :, sq] * corr[..., None] + p @ Vb[:, :, sk]], dim=2)
        mrow = torch.cat([mrow[:, :, :d], m_new], dim=2)
    o = acc / lrow.clamp_min(torch.finfo(cdt).tiny)[..., None]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, NB * m, HQ, -1)[:, :T]
    return o.to(q.dtype)
