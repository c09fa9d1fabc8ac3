"""Parallax attention, reference implementation (the oracle for every kernel).

Per query head, with causal softmax weights p_ij = softmax_j(q_i·k_j · scale) over the visible keys and
a probe ρ_i (``r``), the output is eq. (8)/(35) of the Parallax paper:

    o_i = Σ_j p_ij (1 + t̄_i − t_ij) v_j,   t_ij = ρ_i·k_j (NOT scaled),   t̄_i = Σ_j p_ij t_ij

With ``r=None`` (or ρ = 0) this is plain softmax attention. O(T²) memory; computes in float32 (float64
when the inputs are float64) and returns the input dtype.
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.common import offset_visibility_mask, visibility_mask


def naive_parallax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window_size: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """
    q: [B, T, HQ, D]; k, v: [B, T, HKV, D] with HQ % HKV == 0 (GQA); r: [B, T, HQ, D] or None.
    cu_seqlens: [N+1] int32 document offsets over the flattened B*T tokens (no attention across them).
    window_size: each query sees at most this many most recent keys (itself included).
    cu_seqlens_k: [N+1] int32 key segment offsets over k, v's flattened Bk*Tk tokens (Tk may differ from T), with
          cu_seqlens (query offsets, context parallelism): segment s's query j sits at key position Lk - Lq + j of
          its keys and sees those up to it (bottom-right causal, :func:`attention.ops.common.offset_visibility_mask`).
    scale: applied to q·k only; default D**-0.5.
    Returns o: [B, T, HQ, D] in q's dtype.
    """
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    if HQ % HKV:
        raise ValueError(f"q heads ({HQ}) must be a multiple of kv heads ({HKV})")
    if cu_seqlens_k is not None:  # one flattened row of queries against one of keys
        if cu_seqlens is None:
            raise ValueError("cu_seqlens_k needs cu_seqlens (the query segments)")
        mask = offset_visibility_mask(cu_seqlens, cu_seqlens_k, window_size)  # [1, 1, B*T, Nk]
        q, k, v, r = (None if t is None else t.flatten(0, 1)[None] for t in (q, k, v, r))
    else:
        mask = visibility_mask(B, T, q.device, cu_seqlens, window_size)  # [B|1, 1, T, T]
    scale = D**-0.5 if scale is None else scale
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    G = HQ // HKV
    qf = q.to(ct).transpose(1, 2)  # [B, HQ, T, D]
    kf = k.to(ct).transpose(1, 2).repeat_interleave(G, dim=1)  # [B, HQ, T, D]
    vf = v.to(ct).transpose(1, 2).repeat_interleave(G, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)  # [B, HQ, T, T]
    if r is None:
        w = p
    else:
        t = r.to(ct).transpose(1, 2) @ kf.transpose(-1, -2)  # [B, HQ, T, T], t_ij = ρ_i·k_j
        tbar = (p * t).sum(-1, keepdim=True)
        w = p * (1 + tbar - t)  # s_ij of eq. (8)
    o = w @ vf  # [B, HQ, T, D] ([1, HQ, B*T, D] with cu_seqlens_k)
    return o.transpose(1, 2).reshape(B, T, HQ, D).to(q.dtype)


def naive_parallax_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    r: torch.Tensor | None = None,
    scale: float | None = None,
    window_size: int | None = None,
) -> torch.Tensor:
    """Decode-shaped reference (Tq != Tk): TQ new tokens per row against a KV cache that already holds them.

    q, r: [B, TQ, HQ, D]; k_cache, v_cache: [B, LMAX, HKV, D]; cache_seqlens: [B] valid tokens per row (the TQ
    new ones included), so query t of row b sits at position cache_seqlens[b] − TQ + t and sees cache
    positions j ≤ that position (and inside the window). Same formula as :func:`naive_parallax`.
    Returns [B, TQ, HQ, D] in q's dtype.
    """
    B, TQ, HQ, D = q.shape
    LMAX, HKV = k_cache.shape[1], k_cache.shape[2]
    scale = D**-0.5 if scale is None else scale
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    G = HQ // HKV
    qf = q.to(ct).transpose(1, 2)  # [B, HQ, TQ, D]
    kf = k_cache.to(ct).transpose(1, 2).repeat_interleave(G, dim=1)  # [B, HQ, LMAX, D]
    vf = v_cache.to(ct).transpose(1, 2).repeat_interleave(G, dim=1)
    pos = cache_seqlens.to(q.device, torch.int64)[:, None] - TQ + torch.arange(TQ, device=q.device)  # [B, TQ]
    j = torch.arange(LMAX, device=q.device)
    mask = j[None, None, :] <= pos[:, :, None]  # [B, TQ, LMAX]
    if window_size is not None and window_size > 0:
        mask = mask & (pos[:, :, None] - j[None, None, :] < window_size)
    s = (qf @ kf.transpose(-1, -2)) * scale  # [B, HQ, TQ, LMAX]
    p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    if r is None:
        w = p
    else:
        t = r.to(ct).transpose(1, 2) @ kf.transpose(-1, -2)  # [B, HQ, TQ, LMAX]
        w = p * (1 + (p * t).sum(-1, keepdim=True) - t)
    return (w @ vf).transpose(1, 2).to(q.dtype)  # [B, TQ, HQ, D]
