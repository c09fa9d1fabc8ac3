"""Autotune candidate lists for the project's Triton kernels, and their compilation in parallel.

``ATTNLAB_AUTOTUNE=first`` keeps only the first candidate of every list (:func:`candidates`), and makes fla-core's
autotuners run the first config their prune keeps at each key, untimed (:func:`pin_fla_autotuners`): correctness
runs (the GPU test suite sets it in ``tests/conftest.py``) need one compiled tile per autotune key, not the fastest
one, and every candidate costs a compile per key — on a cold machine the Parallax, LLA and delta-rule GPU tests
spent minutes autotuning. Benchmarks and training leave it unset (the default, ``all``).
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


def mode() -> str:
    """``ATTNLAB_AUTOTUNE`` (default ``all``), checked against :data:`MODES`."""
    mode = os.environ.get("ATTNLAB_AUTOTUNE", "all")
    if mode not in MODES:
        raise ValueError(f"ATTNLAB_AUTOTUNE={mode!r}; choose from {list(MODES)}")
    return mode


def candidates(configs: list) -> list:
    """``configs`` as given, or only the first when ``ATTNLAB_AUTOTUNE=first``."""
    return list(configs[:1]) if mode() == "first" else list(configs)


def _compile_errors() -> tuple:
    """The errors for which Triton's own search skips a config (times it as infinite): out of shared memory or
    registers, ptxas, a failed ``tl.static_assert``."""
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import OutOfResources, PTXASError

    return OutOfResources, CompileTimeAssertionFailure, PTXASError


def pin_first(autotuner) -> None:
    """Make ``autotuner`` (a Triton ``Autotuner``) run, at each autotune key it has not seen, the first config its
    ``prune_configs`` keeps for the launch's arguments, without timing any; where that config does not compile for
    them (:func:`_compile_errors`, the configs Triton's search would skip), the next one. A key already in the
    autotuner's cache (a shipped pick that ``FastLaunch`` put there) runs that config.

    Why per key and not a one-config list: a kernel's ``early_config_prune`` removes configs that are wrong or do
    not fit at some shapes (fla-core 0.6.0's GLA backward drops a tile that ptxas miscompiles on Hopper), and a list
    of one is never pruned. Why the cache and not the prune alone: Triton < 3.7 still times a single pruned config.
    The key is Triton's (:func:`attention.ops.autotune_picks.autotune_key`), so its later launches hit the cache as
    after a search. Idempotent."""
    if getattr(autotuner, "pinned_first", False):
        return
    from attnlab.attention.ops.autotune_picks import autotune_key

    run = autotuner.run  # the class's (fla's CachedAutotuner.run, or Triton's Autotuner.run)

    def pinned_run(*args, **kwargs):
        if len(autotuner.configs) < 2:  # never searched
            return run(*args, **kwargs)
        nargs = dict(zip(autotuner.arg_names, args))
        key = autotune_key(autotuner, {**nargs, **kwargs})
        if key in autotuner.cache:
            return run(*args, **kwargs)
        autotuner.nargs = nargs  # what prune_configs reads, as Autotuner.run sets it
        kept = autotuner.prune_configs(kwargs)
        for i, config in enumerate(kept):
            autotuner.cache[key] = config
            try:
                return run(*args, **kwargs)
            except _compile_errors():
                del autotuner.cache[key]
                if i == len(kept) - 1:
                    raise
        return run(*args, **kwargs)  # the prune kept nothing: Triton's own error

    autotuner.run = pinned_run
    autotuner.pinned_first = True


def pin_fla_autotuners() -> int:
    """Under ``ATTNLAB_AUTOTUNE=first``, :func:`pin_first` every autotuner of fla-core's loaded modules (``fla`` and
    ``fla.*``, behind their ``@triton.heuristics``); returns how many. A no-op (0) under ``all``.

    fla-core autotunes each kernel over its whole list at every new key, through ``triton.autotune`` and through
    its own ``fla_cache_autotune`` (a Triton ``Autotuner`` subclass), so a cold GPU test of GDN / KDA / GLA spent
    one to two minutes per shape in fla's search. Call after ``import fla.ops`` (which loads every fla op module):
    :func:`attention.ops.common.fla_importable` does, the gate of every fla path, which ``tests/conftest.py`` calls
    on a GPU machine. Our own kernels go through :func:`candidates` instead."""
    if mode() != "first":
        return 0
    import sys

    from triton.runtime.autotuner import Autotuner, Heuristics

    pinned = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for obj in list(vars(module).values()):
            while isinstance(obj, (Heuristics, Autotuner)):
                if isinstance(obj, Autotuner) and id(obj) not in pinned:
                    pin_first(obj)
                    pinned.add(id(obj))
                obj = obj.fn
    return len(pinned)


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
