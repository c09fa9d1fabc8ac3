"""Lower host cost for fla-core's Triton kernels: launch with the autotuner's chosen config, skip the wrapper layers.

Why: a GDN fwd+bwd at the training shapes enqueues its fla kernels more slowly than the GPU runs them, and most of
each launch's host time is not the ``JITFunction`` launch itself but fla's ``@dispatch`` (a ``torch.compiler.disable``
wrapper and a backend scan), ``@input_guard`` (``.contiguous()`` on every argument, a device context), fla's
autotune-key builder, Triton's ``Autotuner.run`` and ``Heuristics.run``. In a GDN model that host time is per layer
and independent of the batch size.

- :func:`install` (called by :func:`attention.ops.common.fla_importable`, the gate of every fla path, after
  importing ``fla.ops``, which loads all of fla's ops) replaces every ``@triton.heuristics`` /
  ``@triton.autotune`` kernel object in the loaded ``fla.ops`` modules by a :class:`FastLaunch` proxy: the first
  launch per autotune key takes the normal path (autotuning included), later launches call the ``JITFunction``
  directly with the config that was chosen and the heuristics computed here — the same kernel, config and
  arguments, so results are bitwise those of the normal path.
- :func:`install` also replaces fla's ``@dispatch`` wrappers (a ``torch.compiler.disable`` layer and a scan of
  alternative backends: TileLang, Ascend, FlashKDA, ...) by the function they wrap, where none of the wrapper's
  backends is available and enabled here, so the wrapper would call that function anyway. fla's KDA pipeline
  (``chunk_kda_fwd`` / ``chunk_kda_bwd``, which our op calls) reaches ~8 such wrappers per fwd+bwd.
- :func:`install` also widens the autotune lists of the kernels in :data:`HOPPER_EXTRA_CONFIGS` on Hopper, where
  fla-core 0.6.0 leaves out 8 warps (``NUM_WARPS = [2, 4] if IS_NVIDIA_HOPPER``): KDA's fused backward kernel
  ``chunk_kda_bwd_kernel_wy_dqkg_fused`` ran much faster at 8 warps at the training shapes, with equal outputs;
  the autotuner still chooses, now among both lists.
- At the first launch of a key, :class:`FastLaunch` puts the shipped autotune pick for it, if there is one
  (:mod:`attention.ops.autotune_picks`: the config the autotuner chose at that key on this GPU, Triton and
  fla-core), into the autotuner's cache: the autotuner then compiles only that config and times nothing. Without a
  pick it searches, and ``ATTNLAB_RECORD_PICKS`` records its choice; an autotuner pinned by
  ``ATTNLAB_AUTOTUNE=first`` (:func:`attention.ops.autotune.pin_first`) runs its first config instead, not recorded.
- :class:`FastLaunch` itself is generic (any heuristics/autotune/jit chain): our KDA intra-chunk backward kernel
  (:mod:`attention.ops.delta_rule.triton.kda_intra`) and the softmax/Parallax kernels
  (:mod:`attention.ops.parallax.triton.ops`) launch through it too.
- :func:`raw` strips fla's entry-point decorators (``inspect.unwrap``); callers pass contiguous tensors on the
  current CUDA device, which the delta rule's ``triton`` path (``delta_rule/triton/pipeline.py``) guarantees.

Only fla-core 0.6.0 is patched (the version whose wrappers were read); another version keeps fla's own path.
"""

from __future__ import annotations

import inspect
import sys

from attnlab.attention.ops import autotune_picks
from attnlab.attention.ops.autotune_picks import autotune_key

_INSTALLED = False

HOPPER_EXTRA_CONFIGS: dict[tuple[str, str], list[tuple[int, int, int, int]]] = {
    ("fla.ops.kda.chunk_bwd", "chunk_kda_bwd_kernel_wy_dqkg_fused"):
        [(64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 2), (32, 64, 8, 2)],
}
"""(module, kernel): (BK, BV, num_warps, num_stages) configs added to fla's autotune list on Hopper (measured in
the module docstring; each ran within 1.2e-6 of fla's pick)."""


class FastLaunch:
    """``kernel[grid](*args, **kwargs)`` for a heuristics/autotune/jit chain, with the config cached per key."""

    def __init__(self, kernel) -> None:
        from triton.runtime.autotuner import Autotuner, Heuristics

        self.kernel = kernel
        self.outer, self.inner, self.autotuner = [], [], None  # heuristics outside / inside the autotuner
        obj = kernel
        while isinstance(obj, (Heuristics, Autotuner)):
            if isinstance(obj, Autotuner):
                if self.autotuner is not None:
                    raise TypeError("FastLaunch: two autotuners in one kernel chain")
                self.autotuner = obj
            else:
                (self.inner if self.autotuner is not None else self.outer).append(obj.values)
            obj = obj.fn
        self.jit = obj
        self.name = f"{obj.fn.__module__}.{obj.fn.__qualname__}"  # the kernel's name in the shipped autotune picks
        self.arg_names = list(kernel.arg_names)
        self.configs: dict[tuple, object] = {}

    def __getattr__(self, name):  # everything else (fn, configs, cache, ...) is the wrapped kernel's
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, **kwargs)

    def run(self, *args, grid, first_launch=None, **kwargs):
        """``first_launch``: called before the autotuner searches a new key (``attention.ops.parallax.triton.ops``
        compiles the candidates there, in parallel); not called where a shipped pick stands in for the search."""
        kw = dict(zip(self.arg_names, args))
        kw.update(kwargs)
        for values in self.outer:
            for name, fn in values.items():
                kw[name] = fn(kw)
        at = self.autotuner
        if at is not None:
            key = (tuple(kw.get(k) for k in at.keys),
                   tuple(str(v.dtype) for v in kw.values() if hasattr(v, "dtype")))
            cfg = self.configs.get(key)
            if cfg is None or cfg.pre_hook is not None:  # first launch at this key: the normal path (autotunes)
                tkey = autotune_key(at, kw) if cfg is None else None  # Triton's own cache key
                searched = (tkey is not None and not self._seed(at, tkey, args, kw)
                            and not getattr(at, "pinned_first", False))  # pinned: one config, untimed
                if searched and first_launch is not None:
                    first_launch()
                out = self.kernel[grid](*args, **kwargs)
                if searched and len(at.configs) > 1:
                    autotune_picks.record(self.name, tkey, at.best_config)
                self.configs[key] = at.best_config
                return out
            kw.update(cfg.all_kwargs())
        for values in self.inner:
            for name, fn in values.items():
                kw[name] = fn(kw)
        return self.jit[grid](**kw)

    def _seed(self, at, key: tuple, args, kw) -> bool:
        """Put the shipped pick for this launch's key (:mod:`attention.ops.autotune_picks`) into the autotuner's
        cache, where Triton's ``Autotuner.run`` finds it and does not search. Returns whether the cache now holds
        the key (that pick, or an earlier choice): False where the autotuner will search. ``key``: Triton's cache
        key (:func:`autotune_key`); ``kw``: the launch's arguments by name, with the values of the heuristics
        outside the autotuner."""
        if len(at.configs) < 2:  # a single config is not searched (nor looked up in the cache)
            return False
        prune = None
        if at.early_config_prune is not None:  # called as Autotuner.prune_configs calls it
            nargs = dict(zip(at.arg_names, args))
            rest = {k: v for k, v in kw.items() if k not in nargs}
            prune = lambda configs: at.early_config_prune(configs, nargs, **rest)  # noqa: E731
        cfg = at.cache.get(key) or autotune_picks.pick(self.name, key, at.configs, prune)
        if cfg is not None:
            at.cache[key] = cfg
        return cfg is not None


def install() -> bool:
    """Put :class:`FastLaunch` proxies in place of fla-core 0.6.0's kernel objects (idempotent).

    Returns whether the proxies are installed. Every loaded ``fla.ops`` module's references to a kernel object
    are replaced by one shared proxy; modules imported later keep fla's own objects.
    """
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import fla
        from triton.runtime.autotuner import Autotuner, Heuristics
    except ImportError:
        return False
    if getattr(fla, "__version__", None) != "0.6.0":
        return False
    proxies: dict[int, FastLaunch] = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.ops") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            if isinstance(obj, (Heuristics, Autotuner)):
                if id(obj) not in proxies:
                    proxies[id(obj)] = FastLaunch(obj)
                setattr(mod, attr, proxies[id(obj)])
            elif callable(obj) and (inner := undispatched(obj)) is not obj:
                setattr(mod, attr, inner)
    if _is_hopper():
        for (name, attr), extra in HOPPER_EXTRA_CONFIGS.items():
            kernel = getattr(sys.modules.get(name), attr, None)
            if isinstance(kernel, FastLaunch) and kernel.autotuner is not None:
                add_configs(kernel.autotuner, extra)
    _INSTALLED = True
    return True


def _is_hopper() -> bool:
    try:
        from fla.utils import IS_NVIDIA_HOPPER  # fla's own test, the one that shortened its lists
    except ImportError:
        return False
    return bool(IS_NVIDIA_HOPPER)


def add_configs(autotuner, extra) -> None:
    """Append (BK, BV, num_warps, num_stages) configs to ``autotuner``'s list, skipping ones already in it."""
    import triton

    have = {(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) for c in autotuner.configs}
    for bk, bv, warps, stages in extra:
        if ((("BK", bk), ("BV", bv)), warps, stages) not in have:
            autotuner.configs.append(triton.Config({"BK": bk, "BV": bv}, num_warps=warps, num_stages=stages))


def undispatched(fn):
    """The function under fla's ``@dispatch`` wrapper ``fn`` when none of its backends is available and enabled
    (the wrapper would fall through to it); otherwise, or for anything else, ``fn`` itself.

    The wrapper is ``torch.compiler.disable(wrapper)`` with ``wrapper`` a closure of ``BackendRegistry.dispatch``
    over the registry (``self``) and made with ``functools.wraps(default_function)``."""
    wrapper = getattr(fn, "__wrapped__", None)
    code = getattr(wrapper, "__code__", None)  # functools.wraps copied f's __qualname__; the code keeps its own
    if not getattr(code, "co_qualname", "").endswith("BackendRegistry.dispatch.<locals>.wrapper"):
        return fn
    try:
        registry = inspect.getclosurevars(wrapper).nonlocals["self"]
        if any(b.is_available() and b.is_enabled() for b in registry._get_sorted_backends()):
            return fn
        return wrapper.__wrapped__
    except Exception:  # a layout other than fla-core 0.6.0's: keep fla's own path
        return fn


def raw(fn):
    """fla entry point ``fn`` without its decorators (``@dispatch``, ``@input_guard``): inputs must already be
    contiguous and on the current CUDA device."""
    return inspect.unwrap(fn)
