"""Higher-order Linear Attention (Zhang, Qin, Gu 2025, arXiv:2510.27258): public op.

``hla(q, k, v, g, order=2|3, variant="symmetric"|"asymmetric", normalize=...)`` — masked second-order HLA
(eq. 3, each factor decayed by its own age), AHLA (eq. 7) and the masked third order (docs/mechanisms.md, "HLA").
Implementations (``impl``):

- "reference": the token-by-token recurrence (``recurrent.py``, float64-capable; also the decode state update);
- "chunk":  two or three passes (``chunk.py``) of the chunked PyTorch gated linear attention
  (``attention.ops.linear_attn``), supports initial/final states (prefill, decode), any device;
- "triton": the same passes through that primitive's Triton kernel, forward and backward; training path;
- "auto":   "triton" on CUDA when no state goes in or out, else "chunk".

The test oracle is ``naive.py`` (the definitions as triple/quadruple sums, float64, O(T³)): too slow to be a path.
"""

from __future__ import annotations

import functools

import torch

from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.hla.chunk import compose_hla, safe_div_o
from attnlab.attention.ops.hla.recurrent import init_state, serial_hla
from attnlab.attention.ops.linear_attn import gated_linear_attention

IMPLS = ("auto", "reference", "chunk", "triton")
ORDERS = (2, 3)
VARIANTS = ("symmetric", "asymmetric")


def resolve_impl(impl: str, device: torch.device, stateful: bool = False) -> str:
    check_impl(impl, IMPLS, "hla")
    if impl == "auto":
        return "triton" if device.type == "cuda" and not stateful else "chunk"
    if impl == "triton" and stateful:
        return "chunk"  # the Triton kernels carry no state in or out; prefill/decode use the chunk path
    return impl


def hla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    order: int = 2,
    variant: str = "symmetric",
    normalize: bool = False,
    eps: float = 1e-6,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    impl: str = "auto",
    initial_state: tuple | None = None,
    output_final_state: bool = False,
):
    """Masked higher-order linear attention.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] per-token log-decay log γ_t ≤ 0 (fixed γ: ``log γ``
    broadcast) or None. No scaling or feature map is applied (scale q, k before calling).
    cu_seqlens: [N+1] int32 document offsets over the flattened B*T tokens (state resets at each start).
    initial_state / final state: the decode state of ``recurrent.py`` ((S, U) | (P, E) | (S, P, Y), fp32, with V+1
    columns when ``normalize``). Returns o [B, T, H, V] in q's dtype (and the final state).
    """
    if order not in ORDERS:
        raise ValueError(f"attention.hla.order={order!r}; choose from {list(ORDERS)}")
    if variant not in VARIANTS:
        raise ValueError(f"attention.hla.variant={variant!r}; choose from {list(VARIANTS)}")
    if variant == "asymmetric" and order != 2:
        raise ValueError(f"attention.hla.variant='asymmetric' (AHLA) is second order only, got attention.hla.order={order}")
    B, T, H, K = q.shape
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"hla: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must share [B, T, H]")
    if g is not None and g.shape != (B, T, H):
        raise ValueError(f"hla: g must be [B, T, H] = {(B, T, H)}, got {tuple(g.shape)}")
    stateful = initial_state is not None or output_final_state
    if cu_seqlens is not None and stateful:
        raise ValueError("hla: initial/final states are not supported together with cu_seqlens")
    path = resolve_impl(impl, q.device, stateful)
    if path == "reference":
        vv = torch.cat([v, torch.ones_like(v[..., :1])], -1) if normalize else v
        res = serial_hla(q, k, vv, g, order=order, variant=variant, cu_seqlens=cu_seqlens,
                         initial_state=initial_state, output_final_state=output_final_state)
        o, st = res if output_final_state else (res, None)
        if normalize:
            o = safe_div_o(o[..., :-1], o[..., -1].float() if o.dtype != torch.float64 else o[..., -1], eps)
        return (o, st) if output_final_state else o
    gla = functools.partial(gated_linear_attention, scale=1.0, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                            impl=path)
    return compose_hla(gla, q, k, v, g, order=order, variant=variant, normalize=normalize, eps=eps,
                       initial_state=initial_state, output_final_state=output_final_state)


__all__ = ["hla", "init_state", "resolve_impl", "IMPLS"]
