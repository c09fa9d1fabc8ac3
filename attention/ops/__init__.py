"""The kernel layer: one folder per op (a float64 ``naive.py`` reference, chunked PyTorch, Triton kernels), and
what every op shares (:mod:`attention.ops.common`). Nothing here imports from above ``attention/ops``."""

from __future__ import annotations

import contextlib
import importlib
import pkgutil


def sac_save_ops() -> list:
    """Every forward op declared with :func:`attention.ops.common.keep_under_sac`.

    Mechanism modules import some op modules only at their first forward, after the activation-checkpointing
    policy is built, so each module of this package is imported here first (a module whose dependency is missing,
    Triton on some platforms, declares nothing)."""
    for info in pkgutil.walk_packages(__path__, __name__ + "."):
        with contextlib.suppress(ImportError):
            importlib.import_module(info.name)
    from attention.ops.common import SAC_SAVE

    return list(SAC_SAVE)
