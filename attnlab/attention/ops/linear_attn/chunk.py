"""Chunked gated linear attention in PyTorch (runs on CPU; compiled, on any GPU, forward and backward).

Chunkwise-parallel form of Variants eqs. 6, 19-21 and 22-23, in
chunk-local log space so that no exponent is ever positive (nothing can overflow, whatever the gates):

- inter-chunk: ``o += (q ⊙ exp(G_i)) S_in`` and ``S_out = exp(G_last) ⊙ S_in + (k ⊙ exp(G_last − G_j))^T V``,
  where ``G`` is the inclusive cumulative log gate restarted at every chunk (all exponents <= 0);
- intra-chunk, scalar gate: ``A = (Q K^T) ⊙ exp(G_i − G_j)`` on the causal triangle (−inf above it);
- intra-chunk, per-channel gate (GLA): ``A_ij = Σ_d q_id k_jd exp(G_id − G_jd)`` without the [C, C, K]
  tensor, by *recursive secondary chunking*: the chunk is split in halves, the lower-left block is one
  matmul of ``q ⊙ exp(G_i − G_r)`` and ``k ⊙ exp(G_r − G_j)`` with the reference row ``r`` = the last row of
  the upper half (both exponents <= 0), and the two diagonal halves recurse down to single tokens. This is
  fla's two-level ``BT``/``BC`` scheme taken to every level: the same FLOPs as one dense C×C matmul.

The state pass over chunks is a sequential loop (``S`` is [K, V] per head). Packed documents are laid out
so that every chunk belongs to one document (each document padded to a multiple of the chunk size with
k = v = 0, log gate 0); states reset at document starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _intra_colgate(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """A_ij = Σ_d q_id k_jd exp(G_id − G_jd) for j <= i, else 0.  q, k, G: [..., C, K] (C a power of 2)
    -> [..., C, C]. G is the inclusive chunk-local cumsum (non-increasing along C)."""
    *lead, C, K = q.shape
    blocks = (q * k).sum(-1)[..., None, None]  # [..., C, 1, 1] diagonal 1x1 blocks
    b = 1
    while b < C:
        n = C // (2 * b)
        qv, kv, Gv = (t.reshape(*lead, n, 2, b, K) for t in (q, k, G))
        ref = Gv[..., 0, b - 1 : b, :]  # [..., n, 1, K] G at the last row of the upper half
        qt = qv[..., 1, :, :] * torch.exp(Gv[..., 1, :, :] - ref)  # rows below r: exponent <= 0
        kt = kv[..., 0, :, :] * torch.exp(ref - Gv[..., 0, :, :])  # cols up to r:  exponent <= 0
        off = qt @ kt.transpose(-1, -2)  # [..., n, b, b]
        bl = blocks.reshape(*lead, n, 2, b, b)
        top = torch.cat([bl[..., 0, :, :], torch.zeros_like(off)], dim=-1)
        bot = torch.cat([off, bl[..., 1, :, :]], dim=-1)
        blocks = torch.cat([top, bot], dim=-2)  # [..., n, 2b, 2b]
        b *= 2
    return blocks.reshape(*lead, C, C)


def _doc_layout(cu_seqlens: torch.Tensor, C: int):
    """Padded layout of packed documents. Returns (inv [Ttot] padded position of each token, Tp,
    chunk_doc list[int] doc index of each chunk, first list[bool] chunk starts a doc, last_chunk list[int])."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    nchunks = [max(1, -(-L // C)) for L in lens]
    chunk_doc, first, last_chunk, pstart = [], [], [], []
    p = 0
    for n, m in enumerate(nchunks):
        pstart.append(p)
        chunk_doc += [n] * m
        first += [True] + [False] * (m - 1)
        p += m * C
        last_chunk.append(len(chunk_doc) - 1)
    dev = cu_seqlens.device
    tok = torch.arange(cu[-1], device=dev)
    cu_t = torch.tensor(cu, device=dev)
    doc = torch.searchsorted(cu_t[1:], tok, right=True)
    inv = torch.tensor(pstart, device=dev)[doc] + tok - cu_t[doc]
    return inv, p, chunk_doc, first, last_chunk


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated linear attention; same contract as :func:`naive_recurrent_gla`.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None; gk: [B, T, H, K] or None (log space, <= 0);
    initial_state: [N, H, K, V]; cu_seqlens: [N+1] (B must be 1). chunk_size: any for scalar or no gates, a power
    of 2 with per-channel gates (the secondary chunking halves it).
    Math in float32 (float64 for float64 inputs); o in q's dtype, final state [N, H, K, V] float32/64.
    """
    C = chunk_size
    if C < 1 or (gk is not None and C & (C - 1)):
        raise ValueError(f"attention chunk_size={C} must be {'a power of 2 (per-channel gates)' if C > 0 else '>= 1'}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    gate = None  # per-token log gate [B, T, H, K] or [B, T, H, 1]
    if gk is not None:
        gate = gk.to(cdt) + (g.to(cdt)[..., None] if g is not None else 0.0)
    elif g is not None:
        gate = g.to(cdt)[..., None]
    xs = [q.to(cdt) * scale, k.to(cdt), v.to(cdt)] + ([gate] if gate is not None else [])

    if cu_seqlens is None:
        Tp = -(-T // C) * C if T > 0 else C
        xs = [F.pad(x, (0, 0, 0, 0, 0, Tp - T)) for x in xs]
        NC = Tp // C
        first, chunk_doc, last_chunk = [True] + [False] * (NC - 1), [0] * NC, [NC - 1]
        h0 = initial_state.to(cdt) if initial_state is not None else None  # [B, H, K, V]
        Bp = B
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1 (flattened documents), got B={B}")
        inv, Tp, chunk_doc, first, last_chunk = _doc_layout(cu_seqlens, C)
        xs = [x.new_zeros(Tp, *x.shape[2:]).index_copy(0, inv, x[0])[None] for x in xs]
        NC, Bp = Tp // C, 1
        h0 = initial_state.to(cdt)[None] if initial_state is not None else None  # [1, N, H, K, V]

    # [B, H, NC, C, D]
    qc, kc, vc, *gc = (x.reshape(Bp, NC, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4) for x in xs)
    if gc:
        G = gc[0].cumsum(-2)  # inclusive chunk-local cumsum, <= 0
        Glast = G[..., -1:, :]  # [B, H, NC, 1, K|1]
        if G.shape[-1] == 1:  # scalar gate: exact decay mask
            seg = G[..., :, None, 0] - G[..., None, :, 0]  # [B, H, NC, C, C]
            causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
            A = (qc @ kc.transpose(-1, -2)) * torch.exp(seg.masked_fill(~causal, float("-inf")))
        else:
            A = _intra_colgate(qc, kc, G)
        qg, kg, decay = qc * torch.exp(G), kc * torch.exp(Glast - G), torch.exp(Glast)  # decay [B,H,NC,1,K|1]
    else:
        A = (qc @ kc.transpose(-1, -2)).tril()
        qg, kg, decay = qc, kc, None
    U = kg.transpose(-1, -2) @ vc  # [B, H, NC, K, V] contribution of each chunk to its end state

    S = torch.zeros(Bp, H, K, V, dtype=cdt, device=q.device)
    S_in, finals, ends = [], [], set(last_chunk)
    for c in range(NC):
        if first[c]:
            S = h0[:, chunk_doc[c]] if (h0 is not None and cu_seqlens is not None) else (
                h0 if h0 is not None else torch.zeros_like(S))
        S_in.append(S)
        S = (S * decay[:, :, c, 0, :, None] if decay is not None else S) + U[:, :, c]
        if c in ends:
            finals.append(S)
    o = A @ vc + qg @ torch.stack(S_in, dim=2)  # [B, H, NC, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(Bp, Tp, H, V)
    if cu_seqlens is None:
        o = o[:, :T]
        final = finals[0] if output_final_state else None
    else:
        o = o[0, inv][None]
        final = torch.cat(finals, dim=0) if output_final_state else None
    return o.to(q.dtype), final
