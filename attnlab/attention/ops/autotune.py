"""Autotune candidate lists for the project's Triton kernels, and their compilation in parallel.

``ATTNLAB_AUTOTUNE=first`` keeps only the first candidate of every list: correctness runs (the GPU test suite sets
it in ``tests/conftest.py``) need one compiled tile per autotune key, not the fastest one, and every candidate
costs a compile per key — on a cold machine the Parallax, LLA and delta-rule GPU tests spent minutes autotuning.
Benchmarks and training leave it unset (the default, ``all``).
"""

from __future__ import annotations

import os
from typing import Callable

MODES = ("all", "first")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Triton runs on the CPU interpreter (``TRITON_INTERPRET=1``, the CPU tests), as set when the ops were imported."""
PRECOMPILE = os.environ.get("ATTNLAB_PRECOMPILE", "1") == "1"
"""``compile_candidates`` on (the default) or off (``ATTNLAB_PRECOMPILE=0``)."""
_COMPILED: set = set()


def candidates(configs: list) -> list:
    """``configs`` as given, or only the first when ``ATTNLAB_AUTOTUNE=first``."""
    mode = os.environ.get("ATTNLAB_AUTOTUNE", "all")
    if mode not in MODES:
        raise ValueError(f"ATTNLAB_AUTOTUNE={mode!r}; choose from {list(MODES)}")
    return list(configs[:1]) if mode == "first" else list(configs)


def first_config_for_fla() -> None:
    """Under ``ATTNLAB_AUTOTUNE=first``, fla-core kernels decorated after this call keep only their first config.

    fla autotunes every kernel over its full list at every new key (a cold GDN fwd+bwd spends minutes on it).
    Call before fla is imported: :func:`attention.ops.common.fla_importable`, which every fla path asks first, and
    ``tests/conftest.py`` (tests that import fla directly) do. Our own kernels go through :func:`candidates` instead.
    """
    import functools
    import sys

    import triton

    if os.environ.get("ATTNLAB_AUTOTUNE", "all") != "first" or getattr(triton.autotune, "_attnlab_first", False):
        return
    original = triton.autotune

    @functools.wraps(original)  # keeps the signature fla inspects (cache_results support)
    def autotune(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] == "fla":
            if args:
                args = (list(args[0])[:1], *args[1:])
            elif "configs" in kwargs:
                kwargs["configs"] = list(kwargs["configs"])[:1]
        return original(*args, **kwargs)

    autotune._attnlab_first = True
    triton.autotune = autotune


def _new_key(job: tuple) -> bool:
    """Whether the autotune key of ``job`` = (autotuner, grid, args, meta) is new (and mark it seen)."""
    autotuner, _, args, meta = job
    key = (autotuner.fn.__name__, tuple(sorted(meta.items())), tuple(str(a.dtype) for a in args if hasattr(a, "dtype")))
    if key in _COMPILED:
        return False
    _COMPILED.add(key)
    return True


def compile_candidates(job: tuple, follow: Callable[[], list] | None = None) -> None:
    """Before an autotuned kernel first runs at a new key, compile every candidate its prune keeps, in one pool of
    threads (Triton's ``AsyncCompileMode``); the autotuner then only times them. ``job``: (autotuner, grid, args,
    meta) of the launch about to run. ``follow``, called only at a new key of ``job``: the jobs of launches that will
    follow it (a forward passes its backward's, with stand-in buffers); their new keys compile in the same pool.

    Triton's autotuner compiles each candidate on first use, one after another; one pool per kernel takes the
    first fwd+bwd of a cold cache to well under half that time. A no-op under the interpreter and where Triton lacks
    ``AsyncCompileMode``; a single candidate alone is left to the autotuner."""
    if not PRECOMPILE or os.environ.get("TRITON_INTERPRET", "0") == "1" or not _new_key(job):
        return
    work = []
    for i, (autotuner, grid, args, meta) in enumerate([job, *(follow() if follow else ())]):
        if i == 0 or _new_key((autotuner, grid, args, meta)):
            autotuner.nargs = dict(zip(autotuner.arg_names, args))  # what prune_configs reads (as Autotuner.run)
            work += [(autotuner.fn, grid, args, {**meta, **c.all_kwargs()}) for c in autotuner.prune_configs(meta)]
    if len(work) < 2:
        return
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    with ThreadPoolExecutor(min(len(work), os.cpu_count() or 1)) as pool, AsyncCompileMode(pool):
        for fn, grid, args, kwargs in work:
            fn.warmup(*args, grid=grid, **kwargs)
