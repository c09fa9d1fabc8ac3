"""FoX (Forgetting Transformer) attention: one public op and the decode step.

``forgetting_attention(q, k, v, g, ..., impl=...)``:

- "reference": :func:`naive_forgetting_attn` (O(T²) memory, float64-capable, the oracle);
- "chunk":     :func:`chunk_forgetting_attn` (blockwise online softmax in PyTorch, any device);
- "triton":    FlexAttention (torch's generated Triton kernels) with ``score_mod = s + c_q − c_k`` and a
               causal/document block mask (CUDA, compiled; gradients flow into the captured cumulative gate);
- "fla":       fla-core 0.6.0 ``parallel_forgetting_attn`` (its backward is not one of the refused gated
               chunk kernels);
- "auto":      fla on CUDA when importable, else "triton" on CUDA, else "chunk".
"""

from __future__ import annotations

from typing import Optional

import torch

from attnlab.attention.ops.common import check_impl, document_ids, fla_importable, log_once
from attnlab.attention.ops.custom_ops import fake_attention_out, opaque_op
from attnlab.attention.ops.fox.chunk import chunk_forgetting_attn
from attnlab.attention.ops.fox.naive import doc_cumsum, naive_forgetting_attn

IMPLS = ("auto", "reference", "chunk", "triton", "fla")

__all__ = ["forgetting_attention", "naive_forgetting_attn", "chunk_forgetting_attn", "fox_decode", "IMPLS"]

Tensor = torch.Tensor


def resolve_impl(impl: str, device: torch.device) -> str:
    """The path that runs: "reference", "chunk", "triton" (FlexAttention) or "fla"."""
    check_impl(impl, IMPLS, "fox")
    if impl in ("auto", "fla"):
        ok, why = (False, "not a CUDA device") if device.type != "cuda" else fla_importable()
        if ok:
            return "fla"
        if impl == "fla":
            log_once(f"attention.impl='fla' unavailable for fox ({why}); using {'triton' if device.type == 'cuda' else 'chunk'}")
        return "triton" if device.type == "cuda" else "chunk"
    return impl


_flex_compiled = None


def flex_forgetting_attn(q, k, v, g, scale=None, cu_seqlens=None):
    """FlexAttention path (CUDA): q [B,T,HQ,D], k/v [B,T,HKV,D], g [B,T,HQ] -> [B,T,HQ,D]."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    B, T, HQ, D = q.shape
    c = doc_cumsum(g.float(), cu_seqlens).transpose(1, 2).contiguous()  # [B, HQ, T]
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, B, T)

        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (doc[b, qi] == doc[b, ki])
    else:
        def mask_mod(b, h, qi, ki):
            return qi >= ki

    # two tensors, each indexed once: inductor's flex backward cannot lower a gradient for a captured tensor
    # indexed twice in score_mod (torch 2.11: "multiple indexing operations on the same tensor")
    cq, ck = c, c.clone()

    def score_mod(s, b, h, qi, ki):
        return s + cq[b, h, qi] - ck[b, h, ki]

    bm = create_block_mask(mask_mod, B, None, T, T, device=q.device)
    o = _flex_compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                       block_mask=bm, scale=scale, enable_gqa=HQ != k.shape[2])
    return o.transpose(1, 2)


def forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    block_size: int = 64,
    impl: str = "auto",
) -> torch.Tensor:
    """q: [B, T, HQ, D]; k: [B, T, HKV, D]; v: [B, T, HKV, DV]; g: [B, T, HQ] log forget gate (<= 0).

    logits = scale · q·k + c_t − c_i (gate unscaled, fla's convention), scale defaults to D**-0.5;
    cu_seqlens: [N+1] fla varlen documents over the B*T tokens. Returns o: [B, T, HQ, DV] in q's dtype.
    """
    B, T, HQ, D = q.shape
    if k.shape[:2] != (B, T) or HQ % k.shape[2] or g.shape != (B, T, HQ):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)}: need k [B,T,HKV,D] with HQ % HKV == 0 and g [B,T,HQ]")
    path = resolve_impl(impl, q.device)
    if path == "reference":
        return naive_forgetting_attn(q, k, v, g, scale, cu_seqlens)
    if path == "chunk":
        return chunk_forgetting_attn(q, k, v, g, scale, cu_seqlens, block_size)
    if path == "triton":
        return flex_forgetting_attn(q, k, v, g, scale, cu_seqlens)
    scale = D**-0.5 if scale is None else float(scale)
    if cu_seqlens is not None:
        flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
        return _fla_fox_op(flat(q), flat(k), flat(v), flat(g), scale, cu_seqlens).view(B, T, HQ, v.shape[-1])
    return _fla_fox_op(q, k, v, g, scale, None)


def _fla_fox_eager(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float, cu_seqlens: Optional[Tensor]) -> Tensor:
    from fla.ops.forgetting_attn import parallel_forgetting_attn

    cu = None if cu_seqlens is None else cu_seqlens.long()
    return parallel_forgetting_attn(q, k, v, g.float(), scale=scale, cu_seqlens=cu).contiguous()


# fla's entry point cannot be traced: an opaque op inside compiled models (backward recomputes the forward)
_fla_fox_op = opaque_op("fla_fox", _fla_fox_eager, fake_attention_out)


def fox_decode(q, k_cache, v_cache, c_cache, n_prev: int, scale: float | None = None) -> torch.Tensor:
    """Attend T new queries to a KV cache that already holds them at [n_prev, n_prev + T).

    q: [B, T, HQ, D]; k_cache, v_cache: [B, L, HKV, ·]; c_cache: [B, L, HQ] cumulative log gate
    (float32). Returns [B, T, HQ, DV] in q's dtype.
    """
    B, T, HQ, D = q.shape
    n = n_prev + T
    scale = D**-0.5 if scale is None else scale
    G = HQ // k_cache.shape[2]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    kf = k_cache[:, :n].to(cdt).transpose(1, 2).repeat_interleave(G, 1)  # [B, HQ, n, D]
    vf = v_cache[:, :n].to(cdt).transpose(1, 2).repeat_interleave(G, 1)
    c = c_cache[:, :n].to(cdt).transpose(1, 2)  # [B, HQ, n]
    s = scale * q.to(cdt).transpose(1, 2) @ kf.transpose(-1, -2) + c[..., n_prev:, None] - c[..., None, :]
    ok = torch.arange(n, device=q.device)[None, :] <= torch.arange(n_prev, n, device=q.device)[:, None]
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
    return (p @ vf).transpose(1, 2).to(q.dtype)
