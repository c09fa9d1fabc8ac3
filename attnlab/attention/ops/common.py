"""What every op shares: the ``impl`` vocabulary, the geometry of packed documents, the fla-core gate, and
one-line fallback notices.

Packed documents follow fla's varlen convention: ``cu_seqlens`` [N + 1] int32 offsets of the N documents in the
flattened ``B*T`` token stream (every batch row boundary is also a document boundary), or None when every row is
one causal sequence. Nothing here imports from above ``attnlab/attention/ops`` (tests/attention/test_layering.py).
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)

IMPLS = ("auto", "reference", "chunk", "triton", "fla")
"""``[attention] impl``, one vocabulary for every mechanism (each accepts a subset, in this order):

- "auto": the fastest path that can run the call on its device (each op says what it picks and logs a fallback);
- "reference": the readable PyTorch path (token loop or explicit O(T²) form), float64-capable;
- "chunk": chunked / blockwise PyTorch, any device, torch.compile-able;
- "triton": the project's Triton kernels (for FoX: FlexAttention's generated Triton kernels; for the delta rule:
  fla-core's kernels with ours in place of those Triton < 3.7.1 miscompiles on Hopper);
- "fla": fla-core's Triton kernels (``pip install -e ".[fla]"``).
"""


def check_impl(impl: str, valid: tuple[str, ...], who: str) -> str:
    """``impl`` if ``who`` accepts it (``valid``: a subset of :data:`IMPLS`), else a ValueError naming the key."""
    if impl not in valid:
        raise ValueError(f"attention.impl={impl!r} is not valid for {who}; choose from {list(valid)}")
    return impl


def cuda_device_of(t: torch.Tensor):
    """Context that makes ``t``'s GPU current (Triton launches on the current device); a no-op off CUDA."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------- packed documents
def document_ids(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[B, T] int64 document index of every token, from ``cu_seqlens`` over ``B*T`` tokens.
    A cumulative sum of document starts (inductor cannot lower ``searchsorted`` on these views)."""
    starts = torch.zeros(B * T, dtype=torch.int64, device=cu_seqlens.device)
    starts[cu_seqlens[1:-1].to(torch.int64)] = 1
    return starts.cumsum(0).view(B, T)


def position_in_doc(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    """[B, T] int64 index of each token inside its document; without documents ``arange(T)`` per row."""
    if cu_seqlens is None:
        return torch.arange(T, device=device).expand(B, T)
    return torch.arange(T, device=device) - doc_bounds(cu_seqlens, B, T, device)[0].long()


def doc_bounds(cu_seqlens: torch.Tensor | None, B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """doc_start, doc_end: [B, T] int32, the first visible key of each query and the end (exclusive) of
    its document, as positions inside the row."""
    if cu_seqlens is None:
        return (torch.zeros(B, T, dtype=torch.int32, device=device),
                torch.full((B, T), T, dtype=torch.int32, device=device))
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    doc = document_ids(cu, B, T)  # [B, T]
    row0 = (torch.arange(B, device=device) * T)[:, None]
    return (cu[doc] - row0).to(torch.int32), (cu[doc + 1] - row0).to(torch.int32)


def visibility_mask(
    B: int, T: int, device, cu_seqlens: torch.Tensor | None = None, window_size: int | None = None
) -> torch.Tensor:
    """[B, 1, T, T] bool (``[1, 1, T, T]`` without documents): key j is visible from query i (causal, same
    document, inside the window of ``window_size`` most recent keys)."""
    i = torch.arange(T, device=device)
    mask = (i[:, None] >= i[None, :])[None, None]  # [1, 1, T, T]
    if window_size is not None and window_size > 0:
        mask = mask & ((i[:, None] - i[None, :]) < window_size)[None, None]
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, B, T)  # [B, T]
        mask = mask & (doc[:, :, None] == doc[:, None, :])[:, None]
    return mask


def offset_visibility_mask(cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           window_size: int | None = None) -> torch.Tensor:
    """[1, 1, Nq, Nk] bool for query offsets (context parallelism): segment s holds the queries cu_seqlens[s] ..
    cu_seqlens[s+1] (Lq) and the keys cu_seqlens_k[s] .. cu_seqlens_k[s+1] (Lk >= Lq), aligned bottom-right
    (flash-attention's Tq != Tk causal): its query j sits at key position Lk - Lq + j and sees the keys n of its
    segment with n <= Lk - Lq + j (and Lk - Lq + j - n < window_size). Nq, Nk: the last offsets."""
    cu_q, cu_k = cu_seqlens.to(torch.int64), cu_seqlens_k.to(device=cu_seqlens.device, dtype=torch.int64)
    # segment of each token; searchsorted, unlike document_ids, takes empty segments (repeated offsets)
    t_q, t_k = torch.arange(int(cu_q[-1]), device=cu_q.device), torch.arange(int(cu_k[-1]), device=cu_q.device)
    seg_q = torch.searchsorted(cu_q[1:], t_q, right=True)  # [Nq]
    seg_k = torch.searchsorted(cu_k[1:], t_k, right=True)  # [Nk]
    pos_q = t_q - cu_q[seg_q] + (cu_k[seg_q + 1] - cu_k[seg_q]) - (cu_q[seg_q + 1] - cu_q[seg_q])  # key position
    pos_k = t_k - cu_k[seg_k]  # key index inside its segment
    mask = (seg_q[:, None] == seg_k[None, :]) & (pos_q[:, None] >= pos_k[None, :])  # [Nq, Nk]
    if window_size is not None and window_size > 0:
        mask = mask & (pos_q[:, None] - pos_k[None, :] < window_size)
    return mask[None, None]


# ----------------------------------------------------------------------------------------------- fla-core, logging
_LOGGED: set[str] = set()


def log_once(msg: str) -> None:
    """One-line log message, printed once per distinct text (fallback notices). Not from code that
    ``torch.compile`` traces, which cannot log: a compiled model's fla state is logged before compiling
    (``models.parallelize``), and the eager paths (tools, tests, validation without compile) log here."""
    if torch.compiler.is_compiling():
        return
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.warning(msg)


def fla_gated_backward_ok(device: torch.device) -> tuple[bool, str]:
    """Whether fla-core's *gated* chunk backward (GDN, KDA, GLA, simple GLA, ...) is safe on ``device``.

    fla-core 0.6.0 raises in ``chunk_bwd_dqkwg`` on Hopper (sm_90) with 3.4.0 <= Triton < 3.7.1 (a Triton
    miscompile; docs/kernels.md, "The delta rule", has the upstream reference). Returns (ok, reason).
    """
    if device.type != "cuda":
        return False, "not a CUDA device"
    import triton
    from packaging.version import Version

    tv = Version(triton.__version__.split("+")[0])
    major, _ = torch.cuda.get_device_capability(device)
    if major == 9 and Version("3.4.0") <= tv < Version("3.7.1"):
        return False, f"Triton {triton.__version__} on Hopper (sm_90) miscompiles fla's gated backward (needs >= 3.7.1)"
    return True, ""


_FLA: tuple[bool, str] | None = None  # fla_importable's answer, once asked


def fla_importable() -> tuple[bool, str]:
    """Whether ``fla`` (fla-core) imports; (ok, reason). Every fla path asks this first, so this is also where
    fla's kernels get their low-host-cost launchers (:func:`attention.ops.fla_launch.install`, idempotent):
    every fla op in the process launches the same way, whichever mechanism ran first. Under
    ``ATTNLAB_AUTOTUNE=first`` fla's autotuners run one config per key, untimed
    (:func:`attention.ops.autotune.pin_fla_autotuners`), in training and tools as in the tests.

    The answer is kept: later calls only read it, which ``torch.compile`` traces. The first call imports and patches
    modules, which it cannot, so a compiled model asks before compiling (``models.parallelize``)."""
    global _FLA
    if _FLA is not None:
        return _FLA
    try:
        import fla.ops  # noqa: F401  (imports all of fla's ops, so install() sees every kernel)
    except Exception as e:  # ImportError, or a Triton/driver error at import time
        _FLA = False, f"fla-core not importable ({type(e).__name__}: {e})"
        return _FLA
    from attnlab.attention.ops.autotune import pin_fla_autotuners
    from attnlab.attention.ops.fla_launch import install

    pin_fla_autotuners()
    install()
    _FLA = True, ""
    return _FLA
