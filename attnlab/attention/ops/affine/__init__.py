"""Public entry for the affine family (value averaging, affine linear attention, MesaNet, affine MesaNet).

``affine_attention(mechanism, q, k, v, lam=None, ...)`` with ``impl`` "chunk" (what "auto" runs;
chunked PyTorch, any device) or "reference" (:func:`naive_affine`, explicit d×d matrices). Equations in
``naive.py``; Parallax paper §3.2, eqs. 9-13.
"""

from __future__ import annotations

from typing import Optional

import torch

from attnlab.attention.ops.affine.chunk import affine_chunked, causal_linear, segment_mean  # noqa: F401
from attnlab.attention.ops.affine.naive import MECHANISMS, naive_affine
from attnlab.attention.ops.common import check_impl, doc_bounds
from attnlab.attention.ops.custom_ops import fake_attention_out, opaque_op

Tensor = torch.Tensor

IMPLS = ("auto", "reference", "chunk")


def _affine_eager(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], cu_seqlens: Optional[Tensor],
                  mechanism: str, cg_iters: int, jacobi: bool, rtol: float, chunk: int) -> Tensor:
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    ds, _ = doc_bounds(cu_seqlens, B, T, q.device)
    qh = q.to(ct).transpose(1, 2)  # [B, HQ, T, D]
    kh = k.to(ct).transpose(1, 2).repeat_interleave(G, 1)
    vh = v.to(ct).transpose(1, 2).repeat_interleave(G, 1)
    lh = None
    if lam is not None:
        lh = (lam.view(1, 1, HQ) if lam.dim() == 1 else lam).expand(B, T, HQ).permute(0, 2, 1).to(ct)  # [B, HQ, T]
    o = affine_chunked(mechanism, qh, kh, vh, lh, ds, cg_iters, jacobi, rtol, chunk)
    return o.transpose(1, 2).to(q.dtype).contiguous()


# data-dependent tile ranges and Python loops: an opaque op inside compiled models (backward recomputes the forward)
_affine_op = opaque_op("affine", _affine_eager, fake_attention_out)


def affine_attention(
    mechanism: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam=None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cg_iters: int = 16,
    jacobi: bool = False,
    rtol: float = 1e-6,
    chunk: int = 64,
    impl: str = "auto",
) -> torch.Tensor:
    """
    mechanism: "value_avg" | "affine_linear" | "mesa" | "affine_mesa".
    q: [B, T, HQ, D] (query; the learned probe ρ for affine_linear); k, v: [B, T, HKV, D] (GQA).
    lam: ridge λ for mesa/affine_mesa: float, [HQ] or [B, T, HQ]; differentiable.
    cu_seqlens: [N+1] int32 document offsets over the flattened B*T tokens (states reset per document).
    Computes in fp32 (float64 for float64 inputs); returns [B, T, HQ, D] in q's dtype.
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"model.attention={mechanism!r} is not an affine mechanism; choose from {list(MECHANISMS)}")
    check_impl(impl, IMPLS, mechanism)
    if mechanism in ("mesa", "affine_mesa") and lam is None:
        raise ValueError(f"{mechanism} needs a ridge lam")
    if impl == "reference":
        return naive_affine(mechanism, q, k, v, lam, cu_seqlens)
    if lam is not None and not isinstance(lam, Tensor):
        lam = torch.tensor(float(lam), device=q.device)  # a float λ: a 0-d tensor, one value for every head
    return _affine_op(q, k, v, lam, cu_seqlens, mechanism, int(cg_iters), bool(jacobi), float(rtol), int(chunk))


from attnlab.attention.ops.affine.recurrent import AffineState, affine_step  # noqa: E402,F401
