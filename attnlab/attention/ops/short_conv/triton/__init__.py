"""The ``triton`` path of :func:`attention.ops.short_conv.short_conv`: ``conv.py`` holds the kernels, their launches
and the op pair ``attnlab::short_conv_fwd`` / ``short_conv_bwd``."""

from __future__ import annotations

from attnlab.attention.ops.short_conv.triton.conv import short_conv_bwd, short_conv_fwd

__all__ = ["short_conv_fwd", "short_conv_bwd"]
