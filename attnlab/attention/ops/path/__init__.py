"""PaTH attention: one public op and the decode-time key-cache update.

``path_attention(q, k, v, w, beta, g=None, ..., impl=...)``:

- "reference": :func:`naive_path_attn` (token loop with the transformed-key cache, float64-capable);
- "chunk":     :func:`chunk_path_attn` (blockwise, one triangular solve per block, online softmax);
- "fla":       fla-core 0.6.0 ``parallel_path_attn`` (head dims 32/64/128, float32 w/beta/g; 16 crashed on an H100);
- "auto":      fla on CUDA when importable and the head dim fits, else "chunk".
"""

from __future__ import annotations

from typing import Optional

import torch

from attnlab.attention.ops.common import check_impl, fla_importable, log_once
from attnlab.attention.ops.custom_ops import fake_attention_out, opaque_op
from attnlab.attention.ops.path.chunk import chunk_path_attn
from attnlab.attention.ops.path.naive import naive_path_attn

IMPLS = ("auto", "reference", "chunk", "fla")
FLA_DIMS = (32, 64, 128)
"""Head dims given to fla's PaTH kernels. 16 is left out: fla 0.6.0's ``parallel_path_attn`` hit an illegal memory
access at D=16 (T=40, packed or not, eager) on an H100 with Triton 3.6, while D=64 ran."""

__all__ = ["path_attention", "naive_path_attn", "chunk_path_attn", "householder_update_", "IMPLS"]

Tensor = torch.Tensor


def resolve_impl(impl: str, device: torch.device, head_dim: int) -> str:
    check_impl(impl, IMPLS, "path")
    if impl in ("auto", "fla"):
        if device.type != "cuda":
            ok, why = False, "not a CUDA device"
        elif head_dim not in FLA_DIMS:
            ok, why = False, f"head_dim={head_dim} not in {FLA_DIMS}"
        else:
            ok, why = fla_importable()
        if ok:
            return "fla"
        if impl == "fla":
            log_once(f"attention.impl='fla' unavailable for path ({why}); using the PyTorch chunk path")
        return "chunk"
    return impl


def path_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    block_size: int = 64,
    impl: str = "auto",
) -> torch.Tensor:
    """q: [B, T, HQ, D]; k, w: [B, T, H, D] (w L2-normalised); v: [B, T, H, DV]; beta: [B, T, H] in (0, 2);
    g: [B, T, HQ] log forget gate or None. Logits scale · (A_path + c_t − c_i), scale = D**-0.5 by default.
    cu_seqlens: [N+1] fla varlen over B*T tokens. Returns o: [B, T, HQ, DV] in q's dtype."""
    B, T, HQ, D = q.shape
    if k.shape != w.shape or HQ % k.shape[2] or beta.shape != k.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)}, beta {tuple(beta.shape)}: "
                         "need k, w [B,T,H,D], beta [B,T,H], HQ % H == 0")
    path = resolve_impl(impl, q.device, D)
    if path == "reference":
        return naive_path_attn(q, k, v, w, beta, g, scale, cu_seqlens)
    if path == "chunk":
        return chunk_path_attn(q, k, v, w, beta, g, scale, cu_seqlens, block_size)
    scale = D**-0.5 if scale is None else float(scale)
    if cu_seqlens is not None:
        flat = lambda t: None if t is None else t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
        o = _fla_path_op(flat(q), flat(k), flat(v), flat(w), flat(beta), flat(g), scale, cu_seqlens)
        return o.view(B, T, HQ, v.shape[-1])
    return _fla_path_op(q, k, v, w, beta, g, scale, None)


def _fla_path_eager(q: Tensor, k: Tensor, v: Tensor, w: Tensor, beta: Tensor, g: Optional[Tensor], scale: float,
                    cu_seqlens: Optional[Tensor]) -> Tensor:
    from fla.ops.path_attn import parallel_path_attn

    cu = None if cu_seqlens is None else cu_seqlens.long()
    o, _ = parallel_path_attn(q, k, v, w.float(), beta.float(), g=None if g is None else g.float(), scale=scale,
                              cu_seqlens=cu)
    return o.contiguous()


# fla's entry point is torch.compiler.disable'd: an opaque op inside compiled models (backward recomputes the forward)
_fla_path_op = opaque_op("fla_path", _fla_path_eager, fake_attention_out)


@torch.no_grad()
def householder_update_(k_cache: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, n: int) -> None:
    """Decode step: cached keys k_i <- M_t k_i = k_i − β_t (k_i·ν_t) ν_t for i < n (in place).

    k_cache: [B, L, H, D]; w: [B, H, D] (ν_t); beta: [B, H]."""
    kc = k_cache[:, :n]
    cdt = torch.float64 if k_cache.dtype == torch.float64 else torch.float32
    nu, bt = w[:, None].to(cdt), beta[:, None, :, None].to(cdt)
    proj = (kc.to(cdt) * nu).sum(-1, keepdim=True)  # [B, n, H, 1]
    kc.sub_((bt * proj * nu).to(kc.dtype))
