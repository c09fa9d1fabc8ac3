"""Recurrent reference (the oracle) for the gated linear-attention family.

One recurrence covers plain, scalar-gated and column-gated (GLA) linear attention (Variants eqs. 3, 18, 21), in
fla's state layout ``h = S^T`` ([K, V]):

    h_t = diag(exp(gk_t)) · exp(g_t) · h_{t-1} + k_t v_t^T,      o_t = h_t^T (scale · q_t)

with log-space gates ``g`` (one per head, RetNet/Mamba2/"simple GLA") and/or ``gk`` (one per key channel,
GLA); both None gives plain linear attention. Float64 inputs are computed in float64, everything else in
float32; the output is cast back to q's dtype, the final state stays in the compute dtype.
"""

from __future__ import annotations

import torch


def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated linear attention.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log decay (<= 0) or None; gk: [B, T, H, K] or None.
    scale: multiplies q (default K**-0.5). initial_state: [N, H, K, V] (N = B, or the number of documents
    when ``cu_seqlens`` [N+1] is given; then B must be 1). Returns (o [B, T, H, V], final_state [N, H, K, V]
    or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1 (flattened documents), got B={B}")
        cu = cu_seqlens.tolist()
        bounds = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros(B, T, H, V, dtype=cdt, device=q.device)
    finals = []
    for n, (b, s, e) in enumerate(bounds):
        h = torch.zeros(H, K, V, dtype=cdt, device=q.device)
        if initial_state is not None:
            h = initial_state[n].to(cdt).clone()
        for t in range(s, e):
            if g is not None:
                h = h * g[b, t].to(cdt).exp()[:, None, None]
            if gk is not None:
                h = h * gk[b, t].to(cdt).exp()[:, :, None]
            h = h + k[b, t].to(cdt)[:, :, None] * v[b, t].to(cdt)[:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t].to(cdt) * scale, h)
        finals.append(h)
    final = torch.stack(finals) if output_final_state else None
    return o.to(q.dtype), final
