"""Recurrent reference of the (gated) delta rule: the oracle for ``chunk.py`` and fla's kernels.

Variants eq. 11 (DeltaNet), eq. 24 (Gated DeltaNet) and the per-channel gate of KDA (docs/mechanisms.md), in
fla's layout ``h = S^T`` ([K, V]) and with fla's ``scale`` applied to q:

    h_t = diag(exp(g_t)) h_{t-1}                       (g = None: no decay; g [H]: scalar; g [H, K]: per key channel)
    h_t = h_t + beta_t k_t (v_t - h_t^T k_t)^T        (delta-rule write with learning rate beta_t)
    o_t = h_t^T (scale * q_t)

i.e. S_t = S_{t-1} D_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t. Loops over tokens; computes in
float32, or float64 when the inputs are float64.
"""

from __future__ import annotations

import torch


def naive_recurrent_delta_rule(
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
    """Token-by-token (gated) delta rule.

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; g: None, [B, T, H] (scalar log decay, GDN) or
    [B, T, H, K] (per-channel log decay, KDA), all log-space (<= 0).
    scale: multiplies q (default K**-0.5).
    initial_state: [N, H, K, V] (N = B, or the number of documents with ``cu_seqlens``).
    cu_seqlens: [N + 1] document offsets over the T tokens (requires B == 1); the state restarts at each
    document from ``initial_state[n]`` (or zeros).
    Returns o: [B, T, H, V] in v's dtype, and the final state [N, H, K, V] (float32/float64) or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = v.dtype
    q, k, v, beta = (t.to(acc) for t in (q, k, v, beta))
    g = None if g is None else g.to(acc)
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1 (flattened documents), got B={B}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
    else:
        bounds = None
    N = B if bounds is None else len(bounds) - 1
    o = torch.zeros(B, T, H, V, dtype=acc, device=q.device)
    finals = []
    for n in range(N):
        b, (s, e) = (n, (0, T)) if bounds is None else (0, (bounds[n], bounds[n + 1]))
        h = torch.zeros(H, K, V, dtype=acc, device=q.device)
        if initial_state is not None:
            h = h + initial_state[n].to(acc)
        for t in range(s, e):
            if g is not None:
                decay = g[b, t].exp()  # [H] or [H, K]
                h = h * (decay[:, None, None] if decay.dim() == 1 else decay[:, :, None])
            kt = k[b, t]  # [H, K]
            pred = torch.einsum("hk,hkv->hv", kt, h)  # h^T k: what the memory recalls for k_t
            h = h + torch.einsum("hk,hv->hkv", beta[b, t, :, None] * kt, v[b, t] - pred)
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, h)
        finals.append(h)
    final = torch.stack(finals) if output_final_state else None
    return o.to(out_dtype), final
