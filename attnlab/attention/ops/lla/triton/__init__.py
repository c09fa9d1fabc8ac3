"""Triton kernels of Local Linear Attention: training forward and backward (docs/kernels.md, "LLA").

Per query, LLA solves Σ_i ρ_i = μ_i (the kernel-weighted ridge regression of v on k − q_i, LLA paper eqs. 8-16)
by conjugate gradients; nothing of size T×T or T×D×D exists. Forward: pass (i) statistics (m, ω, μ̃, Jacobi
diagonal) and the CG start, ``cg_iters`` CG steps (one launch each), pass (iii) the output. Backward: pass A,
the adjoint solve (same CG kernel), pass B (dq, dλ) and a dk/dv kernel per key tile. The float64 oracle is
``attention.ops.lla.naive``; the blockwise PyTorch path ``attention.ops.lla.chunk`` runs the same iterates.

- :func:`lla_fwd_triton` / :func:`lla_bwd_triton`: what ``attention.ops.lla.lla_fwd`` / ``lla_bwd`` call on the
  Triton path (shapes in their docstrings).

Files: ``common.py`` (tiles, key passes, state layout), ``cg.py`` (the CG step), ``fwd.py``, ``bwd.py``,
``launch.py`` (tile lists, autotuning, launches).
"""

from __future__ import annotations

from attnlab.attention.ops.lla.triton.launch import lla_bwd_triton, lla_fwd_triton

__all__ = ["lla_fwd_triton", "lla_bwd_triton"]
