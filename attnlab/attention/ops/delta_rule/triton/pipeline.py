"""The ``triton`` path (the custom op's backend "fla_hopper"): fla-core 0.6.0's chunked delta-rule kernels with
our dqkwg kernel swapped in.

fla-core 0.6.0 refuses (``chunk_bwd_dqkwg`` raises) the gated backward on Hopper with 3.4 <= Triton < 3.7.1:
one kernel, ``chunk_bwd_kernel_dqkwg``, is miscompiled there (docs/kernels.md). This path runs fla's forward
pieces and fla's backward sub-kernels in the order of fla's ``chunk_gated_delta_rule_bwd`` /
``chunk_delta_rule_bwd``, calling :func:`attention.ops.delta_rule.triton.dqkwg.chunk_bwd_dqkwg` (ours, no
transposed MMA result) instead of fla's:

    forward : [GDN: chunk_local_cumsum (log2)] -> WY form (w, u, A) -> chunk_gated_delta_rule_fwd_h (h, v_new)
              -> chunk_fwd_o
    backward: recompute the WY form -> fwd_h (h, v_new) -> chunk_bwd_dv_local -> chunk_gated_delta_rule_bwd_dhu
              -> OUR chunk_bwd_dqkwg -> prepare_wy_repr_bwd -> [GDN: reverse chunk-local cumsum of dg]

- g None (DeltaNet): fla's ``delta_rule`` WY kernels (fla 0.6.0 already restricts their Hopper-miscompiled
  ``prepare_wy_repr_bwd_kernel`` to num_warps=2) with our dqkwg (same transposed-MMA pattern);
- g [B, T, H] (GDN): fla's ``gated_delta_rule`` kernels with our dqkwg;
- g [B, T, H, K] (KDA): fla's own KDA forward (``chunk_kda_fwd``, called by ``ops.py`` as fla's
  ``ChunkKDAFunction`` does) and fla's backward pipeline (:func:`kda_bwd`, the order of ``chunk_kda_bwd``) with
  our intra-chunk kernel (:mod:`attention.ops.delta_rule.triton.kda_intra`: tensor-core diagonal blocks for any
  gate, where fla's runs a 16-step loop unless the gate has a lower bound). fla's 0.6.0 KDA backward never calls
  ``chunk_bwd_dqkwg`` (it has its own fused ``chunk_kda_bwd_kernel_wy_dqkg_fused``, whose Hopper autotune list
  already drops BK=32 at 4 warps and to which :mod:`attention.ops.fla_launch` adds 8-warp configs), is not
  refused by fla, and contains no dot on a transposed dot result; its correctness on Hopper + Triton 3.6 is
  checked by the GPU tests, not assumed.

Chunk size 64 (fla's). Same contract as :func:`attention.ops.delta_rule.fla.fla_delta_rule`.
"""

from __future__ import annotations

import functools
import types

import torch

from attnlab.attention.ops.delta_rule.triton.dqkwg import chunk_bwd_dqkwg
from attnlab.attention.ops.delta_rule.triton.kda_intra import chunk_kda_bwd_intra

BT = 64


@functools.cache
def _fla() -> types.SimpleNamespace:
    """fla's entry points without their decorators (host time: :mod:`attention.ops.fla_launch`, whose launch
    proxies ``fla_importable`` installs). Callers run inside ``torch.cuda.device(q.device)`` with contiguous
    inputs (:func:`attention.ops.delta_rule.triton.ops._fla_prep`)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local, chunk_fwd_o
    from fla.ops.delta_rule import wy_fast as dr_wy
    from fla.ops.gated_delta_rule import wy_fast as gdr_wy
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
    from fla.ops.kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from attnlab.attention.ops.common import fla_importable
    from attnlab.attention.ops.fla_launch import raw

    fla_importable()
    return types.SimpleNamespace(
        fwd_h=raw(chunk_gated_delta_rule_fwd_h), bwd_dhu=raw(chunk_gated_delta_rule_bwd_dhu),
        fwd_o=raw(chunk_fwd_o), dv_local=raw(chunk_bwd_dv_local), cumsum=raw(chunk_local_cumsum),
        gated_intra=raw(chunk_gated_delta_rule_fwd_intra), gated_wy_bwd=raw(gdr_wy.prepare_wy_repr_bwd),
        wy_fwd=raw(dr_wy.prepare_wy_repr_fwd), wy_bwd=raw(dr_wy.prepare_wy_repr_bwd), RCP_LN2=RCP_LN2,
        kda_w_u=raw(recompute_w_u_fwd), kda_dAv=raw(chunk_kda_bwd_dAv), kda_wy_dqkg=raw(chunk_kda_bwd_wy_dqkg_fused),
    )


def _wy(k, v, beta, g, kw):
    """WY form of the chunk: (w, u, A, gc) with gc the log2 chunk-local cumsum of g (None without a gate)."""
    F = _fla()
    if g is None:
        return (*F.wy_fwd(k=k, v=v, beta=beta, chunk_size=BT, **kw), None)
    gc = F.cumsum(g, chunk_size=BT, scale=F.RCP_LN2, **kw)
    return (*F.gated_intra(k=k, v=v, g=gc, beta=beta, chunk_size=BT, **kw), gc)


def _fwd(q, k, v, beta, g, scale, h0, output_final_state, cu, ci):
    """fla forward pieces; returns (o, final state or None)."""
    F = _fla()
    kw = dict(cu_seqlens=cu, chunk_indices=ci)
    with torch.cuda.device(q.device):
        w, u, _, gc = _wy(k, v, beta, g, kw)
        h, v_new, ht = F.fwd_h(k=k, w=w, u=u, g=gc, initial_state=h0, output_final_state=output_final_state,
                               chunk_size=BT, **kw)
        return F.fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=scale, chunk_size=BT, **kw), ht


def _bwd(q, k, v, beta, g, scale, h0, do, dht, cu, ci, dqkwg=None):
    """fla backward sub-kernels with our dqkwg; returns (dq, dk, dv, dbeta, dg or None, dh0).

    The forward saves only its inputs, so the WY form (and the log2 chunk cumsum of g) is recomputed here by the
    forward's intra-chunk kernel. ``dqkwg``: the dqkwg implementation (default ours; the custom op's "fla"
    backend passes fla's).
    """
    F = _fla()
    dqkwg = chunk_bwd_dqkwg if dqkwg is None else dqkwg
    kw = dict(cu_seqlens=cu, chunk_indices=ci)
    with torch.cuda.device(q.device):
        w, u, A, gc = _wy(k, v, beta, g, kw)
        h, v_new, _ = F.fwd_h(k=k, w=w, u=u, g=gc, initial_state=h0, output_final_state=False, chunk_size=BT, **kw)
        dv = F.dv_local(q=q, k=k, g=gc, do=do, scale=scale, chunk_size=BT, **kw)
        dh, dh0, dv = F.bwd_dhu(q=q, k=k, w=w, g=gc, h0=h0, dht=dht, do=do, dv=dv, scale=scale, chunk_size=BT, **kw)
        dq, dk, dw, dg = dqkwg(q=q, k=k, v=v_new, do=do, h=h, dh=dh, w=w, g=gc, dv=dv, scale=scale, chunk_size=BT,
                               **kw)
        if gc is None:
            dk2, dv, db = F.wy_bwd(k=k, v=v, beta=beta, A=A, dw=dw, du=dv, **kw)
        else:
            dk2, dv, db, dg2 = F.gated_wy_bwd(k=k, v=v, beta=beta, g=gc, A=A, dw=dw, du=dv, **kw)
            dg = F.cumsum(dg.add_(dg2), chunk_size=BT, reverse=True, **kw)
        dk.add_(dk2)
    return dq, dk, dv, db, dg, dh0


def kda_bwd(*, q, k, v, beta, Aqk, Akk, scale, initial_state, do, dht, g, cu_seqlens=None, chunk_indices=None):
    """fla-core 0.6.0's ``chunk_kda_bwd`` (its argument names; ``H == HV``, no context parallelism, gate outside
    the kernel, ``disable_recompute=False``) with our intra-chunk kernel: (dq, dk, dv, dbeta, dg, dh0).

    g, Aqk, Akk: what ``chunk_kda_fwd`` returned (g: the chunk-local log2 cumsum of the gate). w, u, qg, kg, h
    and v_new are recomputed here, as fla's backward does. Run inside the inputs' device context (on CUDA,
    ``torch.cuda.device``), with contiguous inputs.
    """
    F = _fla()
    kw = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    w, u, qg, kg = F.kda_w_u(q=q, k=k, v=v, beta=beta, A=Akk, gk=g, **kw)
    h, v_new, _ = F.fwd_h(k=kg, w=w, u=u, gk=g, initial_state=initial_state, output_final_state=False,
                          chunk_size=BT, **kw)
    dAqk, dv = F.kda_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, chunk_size=BT, **kw)
    dh, dh0, dv = F.bwd_dhu(q=qg, k=kg, w=w, gk=g, h0=initial_state, dht=dht, do=do, dv=dv, scale=scale,
                            chunk_size=BT, **kw)
    dq, dk, dv, db, dg, dAkk = F.kda_wy_dqkg(q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=Akk, h=h, do=do,
                                             dh=dh, dv=dv, scale=scale, chunk_size=BT, **kw)
    dq, dk, db, dg = chunk_kda_bwd_intra(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, chunk_size=BT,
                                         dq_dtype=q.dtype, dk_dtype=k.dtype, **kw)
    dg = F.cumsum(dg, chunk_size=BT, reverse=True, **kw)
    return dq, dk, dv, db, dg, dh0
