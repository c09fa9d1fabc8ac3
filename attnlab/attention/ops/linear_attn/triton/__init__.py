"""The ``triton`` path of :func:`attention.ops.linear_attn.gated_linear_attention` (scalar or no gates, no state
in or out): ``gla.py`` holds the kernels, their launches and the op ``attnlab::gla_triton``."""

from __future__ import annotations

from attnlab.attention.ops.linear_attn.triton.gla import gla_triton

__all__ = ["gla_triton"]
