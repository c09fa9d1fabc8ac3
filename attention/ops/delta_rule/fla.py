"""fla-core 0.6.0 Triton kernels for the delta rule, behind a safety check.

- plain delta rule (``g is None``): ``fla.ops.delta_rule.chunk_delta_rule``;
- scalar gate ``g [B, T, H]`` (Gated DeltaNet): ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``;
- per-channel gate ``g [B, T, H, K]`` (KDA): ``fla.ops.kda.chunk_kda``.

Same contract as :func:`attention.ops.delta_rule.chunk.chunk_delta_rule` (fla's own: seq-first, h = S^T,
final state float32). fla is used only when it imports, the tensors are on CUDA, and — for the *gated*
kernels when a backward is needed — the GPU/Triton pair is safe: fla-core 0.6.0 miscompiles (and for GDN
refuses) the gated chunk backward on Hopper with 3.4 <= Triton < 3.7.1 (docs/kernels.md, "The delta rule").
"""

from __future__ import annotations

import torch

from attention.ops.common import fla_gated_backward_ok, fla_importable
from attention.ops.delta_rule.ops import cached_cu_seqlens


def fla_unavailable_reason(x: torch.Tensor, gated: bool, needs_grad: bool) -> str:
    """Why fla cannot run this call ("" when it can)."""
    if not x.is_cuda:
        return "inputs are not on CUDA"
    ok, why = fla_importable()
    if not ok:
        return why
    if gated and needs_grad:
        ok, why = fla_gated_backward_ok(x.device)
        if not ok:
            return why
    return ""


def fla_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; g: None | [B, T, H] | [B, T, H, K] (log, fp32).

    initial_state: [N, H, K, V] (cast to float32); cu_seqlens: [N + 1] with B == 1 (cast to int64).
    Returns (o [B, T, H, V] in q's dtype, final state [N, H, K, V] float32 or None).
    """
    cu = None if cu_seqlens is None else cached_cu_seqlens(cu_seqlens)[0]  # fla's per-batch caches hit
    h0 = None if initial_state is None else initial_state.float()
    kw = dict(scale=scale, initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu)
    beta = beta.to(q.dtype)
    if g is None:
        from fla.ops.delta_rule import chunk_delta_rule

        return chunk_delta_rule(q, k, v, beta, **kw)
    if g.dim() == 3:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(q, k, v, g.float(), beta, **kw)
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, g.float(), beta, **kw)
