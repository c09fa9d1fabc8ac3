"""Chunked (WY / UT-transform) delta rule in PyTorch: runs on the CPU and, under ``torch.compile``, on any GPU.

The WY/UT chunk form of Variants eqs. 12-16 (Corollary C.8), with the gates folded in as in eqs. 25-26.
Per chunk of m tokens with chunk-local cumulative log gates G (G_i = sum of g over the chunk up to i, so every
exp(G_i - G_j), i >= j, is <= 1 and nothing can overflow), in fla's layout h = S^T [K, V]:

    Akk  = strictLower(sum_d k_i k_j exp(G_i - G_j))        Aqk = lower(sum_d q_i k_j exp(G_i - G_j))
    Tm   = I + diag(beta) Akk                                (unit lower triangular)
    W    = Tm^{-1} (beta * k * exp(G))                       U = Tm^{-1} (beta * v)
    vnew = U - W h                                           (the "pseudo-values")
    o    = (q * exp(G)) h + Aqk vnew
    h   <- exp(G_last) * h + (k * exp(G_last - G))^T vnew

Gates: None (DeltaNet), scalar per head [B, T, H] (Gated DeltaNet) or per key channel [B, T, H, K] (KDA).
For per-channel gates the pair sums are computed with the two-level trick of fla's GLA/KDA kernels: blocks
of ``sub_chunk_size`` rows against earlier blocks are matmuls with the exponent split at the block's first
row (both factors <= 1); the diagonal blocks are summed element by element.

Everything is computed in float32 (float64 for float64 inputs) and cast back to v's dtype. Only the
inter-chunk state pass is sequential (a Python loop over chunks that ``torch.compile`` unrolls).

Packed documents (``cu_seqlens``, B == 1): chunks are laid over the flat token stream; pairs across a
document boundary are masked out of Akk/Aqk, the carried state reaches only tokens of the document that was
already running when the chunk started, and the state restarts (zeros) where a document starts on a chunk
boundary. With ``initial_state`` or ``output_final_state`` and ``cu_seqlens`` it runs document by document
instead (a host sync; used for tests and prefill, never in training).
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.common import document_ids, position_in_doc


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    sub_chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (gated) delta rule, same contract as :func:`naive_recurrent_delta_rule`.

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; g: None, [B, T, H] or [B, T, H, K] log decay (<= 0).
    initial_state: [N, H, K, V]; cu_seqlens: [N + 1] (B == 1). chunk_size: tokens per chunk (any >= 1);
    sub_chunk_size: block size of the per-channel-gate pair sums (must divide chunk_size, else one block).
    Returns o [B, T, H, V] in v's dtype and the final state [N, H, K, V] float32 (float64) or None.
    """
    B, T, H, K = q.shape
    if k.shape != q.shape or v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"chunk_delta_rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"beta {tuple(beta.shape)}: expected q,k [B,T,H,K], v [B,T,H,V], beta [B,T,H]")
    if g is not None and g.shape not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"chunk_delta_rule: g {tuple(g.shape)} must be [B,T,H] or [B,T,H,K]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1 (flattened documents), got B={B}")
        if initial_state is not None or output_final_state:
            return _per_document(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens,
                                 chunk_size, sub_chunk_size)
    o, h = _chunk(q, k, v, beta, g, scale, initial_state, cu_seqlens, chunk_size, sub_chunk_size)
    return o, (h if output_final_state else None)


def _per_document(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens, C, S):
    bounds = [int(x) for x in cu_seqlens.tolist()]
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        s, e = bounds[n], bounds[n + 1]
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, h = _chunk(q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], None if g is None else g[:, s:e],
                      scale, h0, None, C, S)
        outs.append(o)
        finals.append(h)
    final = torch.cat(finals) if output_final_state else None
    return torch.cat(outs, dim=1), final


def _to_chunks(x: torch.Tensor, NT: int, C: int, acc: torch.dtype) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, NT, C, ...] in ``acc``, zero-padded at the end."""
    B, T = x.shape[:2]
    x = x.to(acc)
    pad = NT * C - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
    x = x.view(B, NT, C, *x.shape[2:])
    return x.movedim(3, 1)


def _channel_gated_pairs(q, k, G, S):
    """A[i, j] = sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d]) for j <= i (0 above), for x = q and x = k.

    q, k, G: [..., C, K] (G = chunk-local cumsum of the log gate, non-increasing). Returns Aqk, Akk [..., C, C].
    """
    C, K = q.shape[-2:]
    S = S if (S >= 1 and C % S == 0) else C
    nS = C // S
    lead = q.shape[:-2]
    Gb = G.view(*lead, nS, S, K)
    Gr = Gb[..., :1, :]  # [..., nS, 1, K] reference: the block's first row
    # Off-diagonal blocks (row block I > column block J): exp(G_i - G_r) * exp(G_r - G_j), both <= 1.
    ea = torch.exp(Gb - Gr)  # [..., nS, S, K]
    qa, ka = q.view(*lead, nS, S, K) * ea, k.view(*lead, nS, S, K) * ea
    cols = torch.arange(C, device=q.device)
    before = cols[None, :] < (torch.arange(nS, device=q.device) * S)[:, None]  # [nS, C]: j in an earlier block
    expo = torch.where(before[..., None], Gr - G.unsqueeze(-3), float("-inf"))  # [..., nS, C, K]
    kb = k.unsqueeze(-3) * torch.exp(expo)  # [..., nS, C, K]
    Aq = (qa @ kb.transpose(-1, -2)).reshape(*lead, C, C)
    Ak = (ka @ kb.transpose(-1, -2)).reshape(*lead, C, C)
    # Diagonal blocks: exact pairwise sums (S x S x K per block).
    tri = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    E = torch.exp(torch.where(tri[..., None], Gb.unsqueeze(-2) - Gb.unsqueeze(-3), float("-inf")))  # [.., nS, S, S, K]
    kd = k.view(*lead, nS, S, K).unsqueeze(-3)
    Dq = (q.view(*lead, nS, S, K).unsqueeze(-2) * kd * E).sum(-1)  # [..., nS, S, S]
    Dk = (k.view(*lead, nS, S, K).unsqueeze(-2) * kd * E).sum(-1)
    eye = torch.eye(nS, dtype=q.dtype, device=q.device)[:, None, :, None]  # [nS, 1, nS, 1]
    Aq = Aq + (Dq.unsqueeze(-2) * eye).reshape(*lead, C, C)
    Ak = Ak + (Dk.unsqueeze(-2) * eye).reshape(*lead, C, C)
    return Aq, Ak


def _doc_masks(cu_seqlens, T, NT, C, device):
    """Masks of the packed-document chunk layout ([1, 1, NT, ...], broadcast over heads)."""
    L = NT * C
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    doc = document_ids(cu, 1, T)  # cumsum form: inductor cannot lower searchsorted here
    if L > T:
        doc = torch.cat([doc, doc.new_full((1, L - T), cu.numel() - 1)], dim=1)  # padding -> N
    doc = doc.view(1, 1, NT, C)
    pos = position_in_doc(cu_seqlens, 1, T, device)
    if L > T:
        pos = torch.cat([pos, pos.new_ones(1, L - T)], dim=1)  # padding never starts a document
    same = doc.unsqueeze(-1) == doc.unsqueeze(-2)  # [1, 1, NT, C, C]
    cont = doc == doc[..., :1]  # [1, 1, NT, C]: token belongs to the document running at the chunk start
    start = pos.view(1, 1, NT, C)[..., 0] == 0  # [1, 1, NT]: a document starts exactly at the chunk start
    return same, cont, start


def _chunk(q, k, v, beta, g, scale, h0, cu_seqlens, C, S):
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    NT = max(1, -(-T // C))
    q, k, v = (_to_chunks(x, NT, C, acc) for x in (q, k, v))  # [B, H, NT, C, D]
    q = q * scale
    beta = _to_chunks(beta, NT, C, acc)  # [B, H, NT, C]
    dev = q.device
    lower = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    strict = lower.logical_not().transpose(0, 1)  # j < i

    if g is None:
        Aqk, Akk = q @ k.transpose(-1, -2), k @ k.transpose(-1, -2)
        kw, qg, kdec, decay = k, q, k, None
    else:
        G = _to_chunks(g, NT, C, acc).cumsum(dim=3)  # chunk-local cumsum, [B, H, NT, C(, K)]
        if G.dim() == 4:  # scalar gate
            D = torch.exp(torch.where(lower, G.unsqueeze(-1) - G.unsqueeze(-2), float("-inf")))
            Aqk, Akk = (q @ k.transpose(-1, -2)) * D, (k @ k.transpose(-1, -2)) * D
            eg, Gl = torch.exp(G).unsqueeze(-1), G[..., -1:]
            kw, qg, kdec = k * eg, q * eg, k * torch.exp(Gl - G).unsqueeze(-1)
            decay = torch.exp(Gl)[..., None]  # [B, H, NT, 1, 1]
        else:  # per-channel gate
            Aqk, Akk = _channel_gated_pairs(q, k, G, S)
            eg, Gl = torch.exp(G), G[..., -1:, :]
            kw, qg, kdec = k * eg, q * eg, k * torch.exp(Gl - G)
            decay = torch.exp(Gl).transpose(-1, -2)  # [B, H, NT, K, 1]
    Aqk = Aqk.masked_fill(~lower, 0.0)
    Akk = Akk.masked_fill(~strict, 0.0)
    cont = start = None
    if cu_seqlens is not None:
        same, cont, start = _doc_masks(cu_seqlens, T, NT, C, dev)
        Aqk, Akk = Aqk * same, Akk * same
        kdec = kdec * same[..., -1, :].unsqueeze(-1)  # only the last document's tokens reach the next chunk
        qg = qg * cont.unsqueeze(-1)
        last_cont = cont[..., -1:].unsqueeze(-1).to(acc)  # [1, 1, NT, 1, 1]
        decay = last_cont if decay is None else decay * last_cont
    eye = torch.eye(C, dtype=acc, device=dev)
    Tm = eye + beta.unsqueeze(-1) * Akk
    rhs = torch.cat([beta.unsqueeze(-1) * kw, beta.unsqueeze(-1) * v], dim=-1)
    WU = torch.linalg.solve_triangular(Tm, rhs, upper=False, unitriangular=True)
    W, U = WU[..., :K], WU[..., K:]
    if cont is not None:
        W = W * cont.unsqueeze(-1)  # the carried state only corrects tokens of the running document

    h = q.new_zeros(B, H, K, V) if h0 is None else h0.to(acc).clone()
    hs, vnew = [], []
    for n in range(NT):
        if start is not None:
            h = h * (~start[:, :, n]).to(acc)[..., None, None]
        hs.append(h)
        vn = U[:, :, n] - W[:, :, n] @ h  # [B, H, C, V]
        vnew.append(vn)
        hn = h if decay is None else h * decay[:, :, n]
        h = hn + kdec[:, :, n].transpose(-1, -2) @ vn
    hs_t, vn_t = torch.stack(hs, dim=2), torch.stack(vnew, dim=2)  # [B, H, NT, K, V], [B, H, NT, C, V]
    o = qg @ hs_t + Aqk @ vn_t  # [B, H, NT, C, V]
    o = o.movedim(1, 3).reshape(B, NT * C, H, V)[:, :T]
    return o.to(out_dtype), h
