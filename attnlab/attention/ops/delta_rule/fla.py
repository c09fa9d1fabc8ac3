"""fla-core 0.6.0 Triton kernels for the delta rule, behind a safety check.

- plain delta rule (``g is None``): ``fla.ops.delta_rule.chunk_delta_rule``;
- scalar gate ``g [B, T, H]`` (Gated DeltaNet): ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``;
- per-channel gate ``g [B, T, H, K]`` (KDA): ``fla.ops.kda.chunk_kda``.

Same contract as :func:`attention.ops.delta_rule.chunk.chunk_delta_rule` (fla's own: seq-first, h = S^T,
final state float32). fla is used only when it imports, the tensors are on CUDA, and — for the *gated*
kernels when a backward is needed — the GPU/Triton pair is safe: fla-core 0.6.0 miscompiles (and for GDN
refuses) the gated chunk backward on Hopper with 3.4 <= Triton < 3.7.1 (docs/kernels.md, "The delta rule").

Also what every fla path of the delta rule shares: the range check of KDA's ``gate_lower_bound`` (fla's
``safe_gate`` range) and :func:`cached_cu_seqlens`, which keeps fla's per-batch caches hitting.
"""

from __future__ import annotations

import weakref

import torch

from attnlab.attention.ops.common import fla_gated_backward_ok, fla_importable


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


def is_kda(g: torch.Tensor | None) -> bool:
    """Whether ``g`` is KDA's per-channel gate [B, T, H, K] (not None, nor a per-head [B, T, H])."""
    return g is not None and g.dim() == 4


def check_gate_lower_bound(g: torch.Tensor | None, gate_lower_bound: float | None) -> None:
    """``gate_lower_bound`` is KDA's (a per-channel g [B, T, H, K]) and lies in fla's safe_gate range [-5, 0)."""
    if gate_lower_bound is None:
        return
    if not is_kda(g):
        got = "None" if g is None else list(g.shape)
        raise ValueError(f"delta_rule: gate_lower_bound={gate_lower_bound} is for KDA's per-channel gate "
                         f"g [B, T, H, K]; got g {got} (DeltaNet / Gated DeltaNet take gate_lower_bound=None)")
    check_lower_bound_range(gate_lower_bound, "delta_rule: gate_lower_bound")


def check_lower_bound_range(lb: float, key: str) -> None:
    """fla's safe_gate kernels take a lower bound in [-5, 0); ``key`` names the setting in the message."""
    if not -5.0 <= lb < 0.0:
        raise ValueError(f"{key}={lb} must be in [-5, 0) (fla's safe_gate range), or unset")


_CU_CACHE: list = []  # [weakref to the caller's cu_seqlens, its _version, int64 copy, chunk indices], newest first


def cached_cu_seqlens(cu_seqlens: torch.Tensor, make_indices=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(int64 copy of ``cu_seqlens``, ``make_indices(copy)`` or None), computed once per tensor object.

    Every layer of a packed batch (forward and backward) gets the same ``cu_seqlens`` tensor. fla caches its
    per-batch helpers (``prepare_chunk_indices``: the lengths read back to the host, a device sync, and one
    ``arange`` per document; chunk offsets) by the identity of the int64 tensor it is given, so a fresh
    ``.to(torch.int64)`` per call recomputed them 2 × layers times per step. Keyed by identity (a weak reference)
    and the version counter, never by address, so a later batch's tensor cannot hit a stale entry.
    """
    for entry in _CU_CACHE:
        ref, version, cu, ci = entry
        if ref() is cu_seqlens and version == cu_seqlens._version:
            if ci is None and make_indices is not None:
                entry[3] = ci = make_indices(cu)
            return cu, ci
    cu = cu_seqlens.to(torch.int64)
    ci = None if make_indices is None else make_indices(cu)
    _CU_CACHE.insert(0, [weakref.ref(cu_seqlens), cu_seqlens._version, cu, ci])
    del _CU_CACHE[4:]
    return cu, ci
