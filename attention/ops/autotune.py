"""Autotune candidate lists for the project's Triton kernels, and their compilation in parallel.

``ATTNLAB_AUTOTUNE=first`` keeps only the first candidate of every list: correctness runs (the GPU test suite sets
it in ``tests/conftest.py``) need one compiled tile per autotune key, not the fastest one, and every candidate
costs a compile per key — on a cold machine the Parallax, LLA and delta-rule GPU tests spent minutes autotuning.
Benchmarks and training leave it unset (the default, ``all``).
"""

from __future__ import annotations

import os

MODES = ("all", "first")
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

    fla autotunes every kernel over its full list at every new key (a cold GDN fwd+bwd spent ~100 s on an H100;
    the delta-rule GPU tests, with several head dims and varlen, ran out of a 300 s limit). Call before fla is
    imported (``tests/conftest.py`` does). Our own kernels go through :func:`candidates` instead.
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


def compile_candidates(autotuner, grid, args: tuple, meta: dict) -> None:
    """Before ``autotuner`` (a ``triton.autotune`` kernel) first runs at a new key, compile every candidate its
    prune keeps in a pool of threads (Triton's ``AsyncCompileMode``); the autotuner then only times them. It
    compiles each on first use, one after another: for the Parallax kernels at D = 128 on an H100 (cold cache) the
    first fwd+bwd took 46.1 s that way and 18.8 s this way (softmax 34.0 -> 12.8 s; benchmarks/RESULTS.md,
    session 21). A no-op under the interpreter and where Triton lacks ``AsyncCompileMode``."""
    dtypes = tuple(str(a.dtype) for a in args if hasattr(a, "dtype"))
    key = (autotuner.fn.__name__, tuple(sorted(meta.items())), dtypes)
    if not PRECOMPILE or os.environ.get("TRITON_INTERPRET", "0") == "1" or key in _COMPILED:
        return
    _COMPILED.add(key)
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    autotuner.nargs = dict(zip(autotuner.arg_names, args))  # what prune_configs reads (Autotuner.run sets it too)
    configs = autotuner.prune_configs(meta)
    if len(configs) < 2:
        return
    with ThreadPoolExecutor(min(8, len(configs))) as pool, AsyncCompileMode(pool):
        for c in configs:
            autotuner.fn.warmup(*args, grid=grid, **meta, **c.all_kwargs())
