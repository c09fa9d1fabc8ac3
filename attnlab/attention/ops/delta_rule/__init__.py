"""The delta rule (DeltaNet), scalar-gated (Gated DeltaNet) and channel-gated (KDA), three compute paths.

``delta_rule(..., impl=)`` is the public entry:

- "reference": :func:`naive.naive_recurrent_delta_rule`, token loop, float64-capable (the oracle);
- "chunk": :func:`chunk.chunk_delta_rule`, chunked WY/UT form in PyTorch (CPU, any GPU, torch.compile-able);
- "fla": fla-core 0.6.0 Triton kernels (:mod:`fla`); raises if they cannot run here;
- "triton": fla-core's kernels with our Triton replacement of the one backward kernel that Triton
  3.4 <= v < 3.7.1 miscompiles on Hopper (``triton/dqkwg.py``, run in fla's order by ``triton/pipeline.py``), and
  for KDA our intra-chunk backward kernel (``triton/kda_intra.py``: tensor-core diagonal blocks for any gate;
  fla's loops over them unless the gate is bounded); any CUDA GPU where fla imports. The op calls this backend
  "fla_hopper";
- "auto": "fla" when it can run this call safely (CUDA, importable, gated backward safe); "triton" when
  only fla's gated-backward check fails (Hopper + Triton < 3.7.1); else "chunk", with a one-line log message
  saying why. The same choice is made inside ``torch.compile``.

"fla" and "triton" run through the custom ops ``attnlab::delta_rule_fwd`` / ``attnlab::delta_rule_bwd``
(``triton/ops.py``): opaque to torch.compile, so torchtitan's ``fullgraph=True`` block compile has no graph break.
KDA's ``gate_lower_bound`` (every g >= it, in [-5, 0)) runs fla's KDA kernels with ``safe_gate``; "reference" and
"chunk" are exact for any g and ignore it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from attnlab.attention.ops.common import check_impl, fla_gated_backward_ok, log_once
from attnlab.attention.ops.custom_ops import fake_packed_state, opaque_op, pack_state, unpack_state
from attnlab.attention.ops.delta_rule.chunk import chunk_delta_rule
from attnlab.attention.ops.delta_rule.fla import (check_gate_lower_bound, check_lower_bound_range, fla_delta_rule,
                                          fla_unavailable_reason)
from attnlab.attention.ops.delta_rule.naive import naive_recurrent_delta_rule
from attnlab.attention.ops.delta_rule.triton import delta_rule_op

__all__ = ["delta_rule", "chunk_delta_rule", "naive_recurrent_delta_rule", "fla_delta_rule", "delta_rule_op",
           "select_impl", "check_lower_bound_range"]

DELTA_RULE_IMPLS = ("auto", "reference", "chunk", "triton", "fla")


def select_impl(impl: str, x: torch.Tensor, gated: bool, needs_grad: bool, who: str = "delta_rule") -> str:
    """The path that runs this call: "reference", "chunk", "fla" or "fla_hopper" (impl "triton"); "auto" resolved
    per call, explicit names validated."""
    check_impl(impl, DELTA_RULE_IMPLS, who)
    if impl in ("reference", "chunk"):
        return impl
    return _resolve(impl, x.device.type, x.device.index, gated, needs_grad, who)


@torch.compiler.assume_constant_result  # under torch.compile: evaluated once at trace time, a constant
def _resolve(impl: str, device_type: str, device_index: int | None, gated: bool, needs_grad: bool, who: str) -> str:
    dev = torch.device(device_type) if device_index is None else torch.device(device_type, device_index)
    x = SimpleNamespace(is_cuda=device_type == "cuda", device=dev)  # all fla_unavailable_reason reads
    if impl == "triton":
        why = fla_unavailable_reason(x, gated, needs_grad=False)  # the gated backward is ours: no Hopper check
        if why:
            raise RuntimeError(f"attention.impl='triton' cannot run {who} here: {why}; use 'auto' or 'chunk'")
        return "fla_hopper"
    why = fla_unavailable_reason(x, gated, needs_grad)
    if impl == "fla":
        if why:
            raise RuntimeError(f"attention.impl='fla' cannot run {who} here: {why}; "
                               "use 'auto', 'triton' or 'chunk'")
        return "fla"
    if why and not fla_unavailable_reason(x, gated, needs_grad=False):
        # only fla's gated-backward check failed (Hopper + Triton < 3.7.1): swap in our dqkwg kernel
        log_once(f"{who}: {fla_gated_backward_ok(x.device)[1]}; using fla-core with our dqkwg kernel (impl 'triton')")
        return "fla_hopper"
    if why:
        if x.is_cuda:
            log_once(f"{who}: fla-core not used ({why}); using the PyTorch chunk path")
        return "chunk"
    return "fla"


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    impl: str = "auto",
    gate_lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Gated) delta rule, ``o_t = h_t^T (scale q_t)`` with ``h_t = D_t h_{t-1} + beta_t k_t (v_t - (D_t h_{t-1})^T k_t)^T``.

    q, k: [B, T, H, K] (callers L2-normalise them); v: [B, T, H, V]; beta: [B, T, H];
    g: None (DeltaNet), [B, T, H] (GDN) or [B, T, H, K] (KDA), log-space decay <= 0.
    scale: default K**-0.5. initial_state: [N, H, K, V]; cu_seqlens: [N + 1] over T with B == 1.
    gate_lower_bound: KDA only (g [B, T, H, K]), in [-5, 0), with every g >= it (KDA's bounded gate): fla's
    ``safe_gate`` kernels on the fla paths; ignored by "reference" and "chunk".
    Returns (o [B, T, H, V] in v's dtype, final state [N, H, K, V] float32 or None).
    """
    check_gate_lower_bound(g, gate_lower_bound)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, beta, g, initial_state))
    path = select_impl(impl, q, g is not None, needs_grad)
    args = (q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens)
    if path == "reference":
        return naive_recurrent_delta_rule(*args)
    if path in ("fla", "fla_hopper"):  # custom ops: no graph break under torch.compile
        return delta_rule_op(*args, backend=path, chunk_size=chunk_size, gate_lower_bound=gate_lower_bound)
    if cu_seqlens is not None and (initial_state is not None or output_final_state):
        # one state per document in and out (context parallelism's chunks): a Python loop over the documents, an
        # opaque op inside compiled models
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        o, final = unpack_state(_chunk_delta_varlen_state_op(q, k, v, beta, g, scale, initial_state, cu_seqlens,
                                                             chunk_size), q, v)
        return o.to(v.dtype), (final if output_final_state else None)
    return chunk_delta_rule(*args, chunk_size=chunk_size)


def _chunk_delta_varlen_state_eager(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor],
                                    scale: float, initial_state: Optional[Tensor], cu_seqlens: Tensor,
                                    chunk_size: int) -> Tensor:
    return pack_state(*chunk_delta_rule(q, k, v, beta, g, scale, initial_state, True, cu_seqlens,
                                        chunk_size=chunk_size))


_chunk_delta_varlen_state_op = opaque_op("chunk_delta_varlen_state", _chunk_delta_varlen_state_eager,
                                         fake_packed_state)
