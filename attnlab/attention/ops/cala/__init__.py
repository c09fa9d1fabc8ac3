"""CALA ops: the local context aggregation through the project's sliding-window softmax path, and normalised
causal linear attention through the gated-linear-attention primitive (``attention.ops.linear_attn``, γ = 1).

- :func:`local_context` — C_Q, C_K of CALA step 3 with ``parallax_attention(..., window_size=w)``:
  keys and values shifted right by one token so that query i sees tokens i−w .. i−1; the slot of a document's
  first token holds a pad key −M·1 with value 0 (φ_loc > 0 so its weight underflows to 0 whenever a real key is
  visible, and C = 0 exactly when none is). Both streams run in one call (batch concatenation).
- :func:`normalized_linear_attention` — o_i = Σ_{j≤i} (φq_i·φk_j) v_j / (Σ_{j≤i} φq_i·φk_j + ε).
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.common import document_ids
from attnlab.attention.ops.cala.naive import local_feature, naive_cala, naive_local_context
from attnlab.attention.ops.linear_attn import gated_linear_attention
from attnlab.attention.ops.parallax import parallax_attention

PAD_KEY = 1e5


def _shift(x: torch.Tensor, starts: torch.Tensor, fill: float) -> torch.Tensor:
    """x: [B, T, H, D] shifted right by one token; positions in ``starts`` [B, T] get ``fill``."""
    y = torch.cat([x[:, :1], x[:, :-1]], 1)
    return torch.where(starts[:, :, None, None], torch.full_like(y, fill), y)


def local_context(q, k, window: int, *, cu_seqlens=None, max_seqlen: int = 0, local_map: str = "elu",
                  impl: str = "auto"):
    """q, k: [B, T, H, D] -> (C_Q, C_K) [B, T, H, D] in q's dtype. ``impl`` is the softmax path's impl."""
    B, T, H, D = q.shape
    if cu_seqlens is None:
        starts = torch.zeros(B, T, dtype=torch.bool, device=q.device)
        starts[:, 0] = True
    else:
        doc = document_ids(cu_seqlens, B, T)
        starts = torch.ones(B, T, dtype=torch.bool, device=q.device)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    ql, kl = local_feature(q, local_map), local_feature(k, local_map)
    keys = _shift(kl, starts, -PAD_KEY)
    qs, ks = torch.cat([ql, kl], 0), torch.cat([keys, keys], 0)  # [2B, T, H, D]
    vs = torch.cat([_shift(q, starts, 0.0), _shift(k, starts, 0.0)], 0)
    cu2 = None
    if cu_seqlens is not None:
        cu2 = torch.cat([cu_seqlens, cu_seqlens[1:] + B * T]).to(torch.int32)
    c = parallax_attention(qs, ks, vs, None, scale=D**-0.5, cu_seqlens=cu2, max_seqlen=max_seqlen,
                           window_size=window, impl=impl)
    return c[:B], c[B:]


def normalized_linear_attention(qf, kf, v, *, eps: float = 1e-6, cu_seqlens=None, impl: str = "auto",
                                initial_state=None, output_final_state: bool = False):
    """qf, kf: [B, T, H, F] non-negative features; v: [B, T, H, V]. State: [B, H, F, V+1] fp32 (numerator and
    denominator columns). impl: "triton" | "chunk" | "auto" (Triton on CUDA without states)."""
    qf, kf = qf.to(v.dtype), kf.to(v.dtype)  # LayerNorm under autocast returns fp32; run in v's dtype
    va = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    path = "triton" if impl == "triton" or (impl == "auto" and qf.is_cuda) else "chunk"
    o, st = gated_linear_attention(qf, kf, va, scale=1.0, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                   output_final_state=output_final_state, impl=path)
    out = divide_by_normaliser(o, eps, v.dtype)
    return (out, st) if output_final_state else out


def divide_by_normaliser(o: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """o [..., V + 1], the linear attention of [v | 1] (numerator and denominator) -> num / (den + ε) [..., V] in
    ``dtype``."""
    ct = torch.float64 if o.dtype == torch.float64 else torch.float32
    num, den = o[..., :-1].to(ct), o[..., -1:].to(ct)
    return (num / (den + eps)).to(dtype)


__all__ = ["local_context", "normalized_linear_attention", "divide_by_normaliser", "naive_cala", "naive_local_context", "local_feature"]
