"""attention.ops.fla_launch: the FastLaunch proxy launches the same kernel with the same config, skipping the
autotuner after the first launch per key; install() swaps kernel objects in fla.ops modules (CPU, interpreter)."""

import sys
import types

import pytest
import torch
import triton
import triton.language as tl

from attnlab.attention.ops import fla_launch
from attnlab.attention.ops.fla_launch import FastLaunch


def _make_kernel():
    @triton.heuristics({"HAS_B": lambda a: a["b"] is not None})
    @triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=1)], key=["N"])
    @triton.heuristics({"SCALE": lambda a: 2.0 if a["BLOCK"] == 16 else -1.0})  # sees the autotuned BLOCK
    @triton.jit
    def kernel(a, b, out, N, HAS_B: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(a + offs, mask=m) * SCALE
        if HAS_B:
            x += tl.load(b + offs, mask=m)
        tl.store(out + offs, x, mask=m)

    return kernel


def _autotuner_calls(kernel):
    at = kernel.fn
    calls = []
    run = at.run

    def counting(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    at.run = counting
    return calls


@pytest.mark.parametrize("with_b", [False, True])
def test_fast_launch_equals_normal_path_and_skips_autotuner(with_b):
    kernel = _make_kernel()
    fast = FastLaunch(kernel)
    calls = _autotuner_calls(kernel)
    N = 37
    a, b = torch.randn(N), torch.randn(N)
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK"]),)  # noqa: E731
    want = a * 2.0 + (b if with_b else 0.0)
    for i in range(3):
        out = torch.full((N,), float("nan"))
        fast[grid](a, b if with_b else None, out, N)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert len(calls) == 1, f"launch {i}: the autotuner ran {len(calls)} times (only the first launch should)"
    # a new autotune key takes the normal path once more
    N2 = 20
    out = torch.full((N2,), float("nan"))
    fast[(2,)](a[:N2], None, out, N2)
    torch.testing.assert_close(out, a[:N2] * 2.0, rtol=0, atol=0)
    assert len(calls) == 2
    assert fast.configs and all(c.kwargs == {"BLOCK": 16} for c in fast.configs.values())
    assert fast.arg_names == kernel.arg_names  # other attributes come from the wrapped kernel


def test_install_swaps_fla_kernel_objects_and_only_for_fla_060(monkeypatch):
    kernel = _make_kernel()
    mod_a, mod_b = types.ModuleType("fla.ops.fake_a"), types.ModuleType("fla.ops.fake_b")
    mod_a.kernel = mod_b.kern = kernel
    other = types.ModuleType("somewhere.else")
    other.kernel = kernel
    for m in (mod_a, mod_b, other):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(fla_launch, "_INSTALLED", False)
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.5.0"))
    assert not fla_launch.install()
    assert mod_a.kernel is kernel
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.6.0"))
    assert fla_launch.install()
    assert isinstance(mod_a.kernel, FastLaunch) and mod_a.kernel is mod_b.kern  # one proxy per kernel object
    assert other.kernel is kernel  # outside fla.ops: untouched


def test_raw_strips_decorators():
    import functools

    def f(x):
        return x + 1

    @functools.wraps(f)
    def guarded(*a):
        return f(*a)

    assert fla_launch.raw(torch.compiler.disable(guarded)) is f


class BackendRegistry:
    """The shape of fla-core 0.6.0's ``fla.backends.BackendRegistry.dispatch`` wrapper (test double)."""

    def __init__(self, backends):
        self.backends = backends

    def _get_sorted_backends(self):
        return self.backends

    def dispatch(self, default_function):
        import functools

        @functools.wraps(default_function)
        def wrapper(*args, **kwargs):
            for backend in self._get_sorted_backends():
                if backend.is_available() and backend.is_enabled():
                    return backend.impl(*args, **kwargs)
            return default_function(*args, **kwargs)

        return torch.compiler.disable(wrapper)


class _Backend:
    def __init__(self, available, enabled=True):
        self.available, self.enabled = available, enabled

    def is_available(self):
        return self.available

    def is_enabled(self):
        return self.enabled

    def impl(self, x):
        return x - 1


@pytest.mark.parametrize("backends, unwrapped", [([], True), ([_Backend(False), _Backend(True, False)], True),
                                                 ([_Backend(False), _Backend(True)], False)])
def test_undispatched_only_where_no_backend_would_run(backends, unwrapped):
    def f(x):
        return x + 1

    wrapped = BackendRegistry(backends).dispatch(f)
    got = fla_launch.undispatched(wrapped)
    assert (got is f) == unwrapped and (got is wrapped) != unwrapped
    assert got(1) == wrapped(1)  # the same result either way
    assert fla_launch.undispatched(f) is f and fla_launch.undispatched(len) is len


def test_install_unwraps_fla_dispatch_wrappers(monkeypatch):
    def f(x):
        return x + 1

    mod = types.ModuleType("fla.ops.fake_dispatch")
    mod.f = BackendRegistry([_Backend(False)]).dispatch(f)
    mod.g = BackendRegistry([_Backend(True)]).dispatch(f)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(fla_launch, "_INSTALLED", False)
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.6.0"))
    assert fla_launch.install()
    assert mod.f is f and mod.g is not f


def _bk_bv_kernel():
    @triton.autotune(configs=[triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=2)], key=["N"])
    @triton.jit
    def kernel(a, out, N, BK: tl.constexpr, BV: tl.constexpr):
        offs = tl.program_id(0) * BK + tl.arange(0, BK)
        tl.store(out + offs, tl.load(a + offs, mask=offs < N) + BV, mask=offs < N)

    return kernel


@pytest.mark.parametrize("hopper", [False, True])
def test_install_adds_hopper_configs_to_the_listed_kernels_only(hopper, monkeypatch):
    """On Hopper, the kernels of HOPPER_EXTRA_CONFIGS autotune over fla's list plus ours (8 warps); elsewhere, and
    for every other kernel, fla's list is unchanged."""
    (name, attr), extra = next(iter(fla_launch.HOPPER_EXTRA_CONFIGS.items()))
    listed, other = _bk_bv_kernel(), _bk_bv_kernel()
    mod, mod_other = types.ModuleType(name), types.ModuleType("fla.ops.fake_other")
    setattr(mod, attr, listed)
    mod_other.kernel = other
    for m in (mod, mod_other):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(fla_launch, "_INSTALLED", False)
    monkeypatch.setattr(fla_launch, "_is_hopper", lambda: hopper)
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.6.0"))
    assert fla_launch.install()
    got = [(c.kwargs["BK"], c.kwargs["BV"], c.num_warps, c.num_stages) for c in getattr(mod, attr).autotuner.configs]
    assert got == [(64, 64, 4, 2)] + (list(extra) if hopper else [])
    assert len(other.configs) == 1
    fla_launch.add_configs(listed, extra)  # idempotent: nothing listed twice
    assert len(listed.configs) == 1 + len(extra)
    a = torch.randn(37)
    for cfg in listed.configs:  # every added config is a valid launch of the kernel
        out = torch.full_like(a, float("nan"))
        listed.fn[(triton.cdiv(37, cfg.kwargs["BK"]),)](a, out, 37, **cfg.all_kwargs())
        torch.testing.assert_close(out, a + cfg.kwargs["BV"])
