"""The kernel layer. Nothing here imports from above ``attnlab/attention/ops`` (tests/attention/test_layering.py).

One folder per op, ``attnlab/attention/ops/<op>/``, with the files it has of one vocabulary:

- ``__init__.py``: the public function, which takes ``impl`` (:data:`attention.ops.common.IMPLS`) and dispatches;
- ``naive.py``: the readable reference, float64 for float64 inputs: the oracle every path is tested against;
- ``chunk.py``: chunked / blockwise PyTorch, any device, torch.compile-able;
- ``recurrent.py``: the token-by-token form or decoding step (the decode caches' update);
- ``triton/``: the op's Triton kernels, their launches and their custom ops;
- ``fla.py``: the fla-core backend.

What the ops share, at this level:

- ``common.py``: the ``impl`` vocabulary, document ids and masks of packed sequences, the fla-core gate, one-line
  fallback notices;
- ``custom_ops.py``: the one way to register an ``attnlab::`` custom op (:func:`~attention.ops.custom_ops.attnlab_op`,
  :func:`~attention.ops.custom_ops.opaque_op`) and the ops selective activation checkpointing keeps;
- ``autotune.py``: the Triton kernels' candidate lists (``ATTNLAB_AUTOTUNE``) and their parallel compilation;
- ``autotune_picks.py`` / ``autotune_picks.json``: the shipped autotune picks, used at a key's first launch;
- ``fla_launch.py``: ``FastLaunch``, the low-host-cost launcher of fla-core's kernels and ours;
- ``tiles.py``: the launch order of causal tile kernels (heaviest tiles first, in groups);
- ``outputs.py``: the Triton ops' output buffers, which the tests fill with NaN before each launch.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil


def sac_save_ops() -> list:
    """Every forward op registered with ``attnlab_op(..., keep_under_sac=True)`` (``opaque_op``'s included).

    Mechanism modules import some op modules only at their first forward, after the activation-checkpointing
    policy is built, so each module of this package is imported here first (a module whose dependency is missing,
    Triton on some platforms, declares nothing)."""
    for info in pkgutil.walk_packages(__path__, __name__ + "."):
        with contextlib.suppress(ImportError):
            importlib.import_module(info.name)
    from attnlab.attention.ops.custom_ops import SAC_SAVE

    return list(SAC_SAVE)
