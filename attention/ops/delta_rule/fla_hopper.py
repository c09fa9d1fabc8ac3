"""The "fla_hopper" path: fla-core 0.6.0's chunked delta-rule kernels with our dqkwg kernel swapped in.

fla-core 0.6.0 refuses (``chunk_bwd_dqkwg`` raises) the gated backward on Hopper with 3.4 <= Triton < 3.7.1:
one kernel, ``chunk_bwd_kernel_dqkwg``, is miscompiled there (fla issue #640). This path runs fla's forward
pieces and fla's backward sub-kernels in the order of fla's ``chunk_gated_delta_rule_bwd`` /
``chunk_delta_rule_bwd``, calling :func:`attention.ops.delta_rule.dqkwg.chunk_bwd_dqkwg` (ours, no transposed
MMA result) instead of fla's:

    forward : [GDN: chunk_local_cumsum (log2)] -> WY form (w, u, A) -> chunk_gated_delta_rule_fwd_h (h, v_new)
              -> chunk_fwd_o
    backward: recompute w, u -> fwd_h (h, v_new) -> chunk_bwd_dv_local -> chunk_gated_delta_rule_bwd_dhu
              -> OUR chunk_bwd_dqkwg -> prepare_wy_repr_bwd -> [GDN: reverse chunk-local cumsum of dg]

- g None (DeltaNet): fla's ``delta_rule`` WY kernels (fla 0.6.0 already restricts their Hopper-miscompiled
  ``prepare_wy_repr_bwd_kernel`` to num_warps=2, fla #984) with our dqkwg (same transposed-MMA pattern);
- g [B, T, H] (GDN): fla's ``gated_delta_rule`` kernels with our dqkwg;
- g [B, T, H, K] (KDA): fla's own ``chunk_kda``. Its 0.6.0 backward never calls ``chunk_bwd_dqkwg`` (it has
  its own fused ``chunk_kda_bwd_kernel_wy_dqkg_fused``, whose Hopper autotune list already drops BK=32 at
  4 warps), is not refused by fla, and contains no dot on a transposed dot result; its correctness on
  Hopper + Triton 3.6 is checked by the GPU tests, not assumed.

Chunk size 64 (fla's). Same contract as :func:`attention.ops.delta_rule.fla.fla_delta_rule`.
"""

from __future__ import annotations

import torch

from attention.ops.delta_rule.dqkwg import chunk_bwd_dqkwg

BT = 64


def _fwd(q, k, v, beta, g, scale, h0, output_final_state, cu, ci):
    """fla forward pieces; returns (o, final state, log2 chunk cumsum of g or None, WY matrix A)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o

    kw = dict(cu_seqlens=cu, chunk_indices=ci)
    if g is None:
        from fla.ops.delta_rule.wy_fast import prepare_wy_repr_fwd

        w, u, A = prepare_wy_repr_fwd(k=k, v=v, beta=beta, chunk_size=BT, **kw)
        gc = None
    else:
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        gc = chunk_local_cumsum(g, chunk_size=BT, scale=RCP_LN2, **kw)
        w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, chunk_size=BT, **kw)
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, initial_state=h0,
                                                output_final_state=output_final_state, chunk_size=BT, **kw)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=scale, chunk_size=BT, **kw)
    return o, ht, gc, A


def _bwd(q, k, v, beta, gc, A, scale, h0, do, dht, cu, ci, g_raw=None, dqkwg=None):
    """fla backward sub-kernels with our dqkwg; returns (dq, dk, dv, dbeta, dg or None, dh0).

    With ``A=None`` the WY form (and, from ``g_raw``, the log2 chunk cumsum ``gc``) is recomputed by the
    forward's intra-chunk kernel (used by the custom op, which saves only its inputs). ``dqkwg``: the
    dqkwg implementation (default ours; the custom op's "fla" backend passes fla's).
    """
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    dqkwg = chunk_bwd_dqkwg if dqkwg is None else dqkwg
    kw = dict(cu_seqlens=cu, chunk_indices=ci)
    if A is None:
        if g_raw is None:
            from fla.ops.delta_rule.wy_fast import prepare_wy_repr_fwd

            w, u, A = prepare_wy_repr_fwd(k=k, v=v, beta=beta, chunk_size=BT, **kw)
        else:
            from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
            from fla.ops.utils import chunk_local_cumsum
            from fla.ops.utils.constant import RCP_LN2

            gc = chunk_local_cumsum(g_raw, chunk_size=BT, scale=RCP_LN2, **kw)
            w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, chunk_size=BT, **kw)
    elif gc is None:
        from fla.ops.delta_rule.wy_fast import recompute_w_u_fwd

        w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, **kw)
    else:
        from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

        w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=gc, **kw)
    if gc is None:
        from fla.ops.delta_rule.wy_fast import prepare_wy_repr_bwd
    else:
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, initial_state=h0, output_final_state=False,
                                               chunk_size=BT, **kw)
    dv = chunk_bwd_dv_local(q=q, k=k, g=gc, do=do, scale=scale, chunk_size=BT, **kw)
    dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=gc, h0=h0, dht=dht, do=do, dv=dv, scale=scale,
                                                 chunk_size=BT, **kw)
    dq, dk, dw, dg = dqkwg(q=q, k=k, v=v_new, do=do, h=h, dh=dh, w=w, g=gc, dv=dv, scale=scale, chunk_size=BT, **kw)
    if gc is None:
        dk2, dv, db = prepare_wy_repr_bwd(k=k, v=v, beta=beta, A=A, dw=dw, du=dv, **kw)
    else:
        from fla.ops.utils import chunk_local_cumsum

        dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=gc, A=A, dw=dw, du=dv, **kw)
        dg = chunk_local_cumsum(dg.add_(dg2), chunk_size=BT, reverse=True, **kw)
    dk.add_(dk2)
    return dq, dk, dv, db, dg, dh0


class _FlaHopperDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, g, scale, h0, output_final_state, cu, ci):
        o, ht, gc, A = _fwd(q, k, v, beta, g, scale, h0, output_final_state, cu, ci)
        ctx.save_for_backward(q, k, v, beta, gc, A, h0, cu, ci)
        ctx.scale, ctx.g_dtype = scale, None if g is None else g.dtype
        return o.to(q.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, gc, A, h0, cu, ci = ctx.saved_tensors
        dq, dk, dv, db, dg, dh0 = _bwd(q, k, v, beta, gc, A, ctx.scale, h0, do.contiguous(),
                                       None if dht is None else dht.contiguous(), cu, ci)
        dg = None if dg is None else dg.to(ctx.g_dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), db.to(beta.dtype), dg, dh0, None, None, None, None


@torch.compiler.disable  # a graph break under torch.compile; delta_rule() goes through ops.py's custom ops instead
def fla_hopper_delta_rule(
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

    initial_state: [N, H, K, V] (float32); cu_seqlens: [N + 1] with B == 1. scale: default K**-0.5.
    Returns (o [B, T, H, V] in q's dtype, final state [N, H, K, V] float32 or None). CUDA only.
    """
    B, T, H, K = q.shape
    if g is not None and g.dim() == 4:
        from attention.ops.delta_rule.fla import fla_delta_rule

        return fla_delta_rule(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens)
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (flattened documents), got B={B}")
    scale = K**-0.5 if scale is None else scale
    cu = ci = None
    if cu_seqlens is not None:
        from fla.ops.utils.index import prepare_chunk_indices

        cu = cu_seqlens.to(torch.int64)
        ci = prepare_chunk_indices(cu, BT)
    q, k, v = (t.contiguous() for t in (q, k, v))
    beta = beta.to(q.dtype).contiguous()
    g = None if g is None else g.float().contiguous()
    h0 = None if initial_state is None else initial_state.float().contiguous()
    return _FlaHopperDeltaRule.apply(q, k, v, beta, g, scale, h0, output_final_state, cu, ci)
