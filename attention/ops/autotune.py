"""Autotune candidate lists for the project's Triton kernels.

``ATTNLAB_AUTOTUNE=first`` keeps only the first candidate of every list: correctness runs (the GPU test suite sets
it in ``tests/conftest.py``) need one compiled tile per autotune key, not the fastest one, and every candidate
costs a compile per key — on a cold machine the Parallax, LLA and delta-rule GPU tests spent minutes autotuning.
Benchmarks and training leave it unset (the default, ``all``).
"""

from __future__ import annotations

import os

MODES = ("all", "first")


def candidates(configs: list) -> list:
    """``configs`` as given, or only the first when ``ATTNLAB_AUTOTUNE=first``."""
    mode = os.environ.get("ATTNLAB_AUTOTUNE", "all")
    if mode not in MODES:
        raise ValueError(f"ATTNLAB_AUTOTUNE={mode!r}; choose from {list(MODES)}")
    return list(configs[:1]) if mode == "first" else list(configs)
