"""ATTNLAB_AUTOTUNE: the candidate lists the Triton kernels autotune over; their parallel compilation."""

from types import SimpleNamespace

import pytest
import torch

from attnlab.attention.ops import autotune
from attnlab.attention.ops.autotune import candidates


def test_all_first_and_bad_value(monkeypatch):
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "all")
    assert candidates([3, 1, 2]) == [3, 1, 2]
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "first")
    assert candidates([3, 1, 2]) == [3]
    monkeypatch.delenv("ATTNLAB_AUTOTUNE")
    assert candidates([3, 1, 2]) == [3, 1, 2]
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "fastest")
    with pytest.raises(ValueError, match="ATTNLAB_AUTOTUNE='fastest'"):
        candidates([1])


PIN_SRC = '''
import triton
import triton.language as tl


def drop_small_tile_above_64(configs, named_args, **kwargs):
    return [c for c in configs if named_args["N"] <= 64 or c.kwargs["BLOCK"] > 16]


@triton.heuristics({"HAS_X": lambda a: a["x"] is not None})
@triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=1) for b in (16, 32, 64)], key=["N"],
                 prune_configs_by={"early_config_prune": drop_small_tile_above_64})
@triton.jit
def kernel(x, out, N, HAS_X: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, tl.zeros([BLOCK], tl.int32) + BLOCK, mask=offs < N)
'''
"""A kernel that writes its BLOCK into every output element, autotuned over BLOCK 16, 32, 64; its prune drops 16
above N = 64."""


def _load(tmp_path, name, monkeypatch):
    """``PIN_SRC`` as the module ``name`` (in ``sys.modules``, where the walk looks); its heuristics-wrapped kernel."""
    import importlib.util
    import sys

    path = tmp_path / (name.replace(".", "_") + ".py")
    path.write_text(PIN_SRC)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod.kernel


def _block(kernel, N):
    """The BLOCK the launch at N ran with (every element written)."""
    import triton

    out = torch.full((N,), -1, dtype=torch.int32)
    kernel[lambda meta: (triton.cdiv(N, meta["BLOCK"]),)](None, out, N)
    assert (out == out[0]).all()
    return int(out[0])


def test_pin_fla_autotuners_runs_first_kept_config_untimed(monkeypatch, tmp_path):
    """Under ``first``: every autotuner in an fla module runs, per key, the first config its prune keeps, without
    timing (here ``_bench`` fails the test); later launches at a key reuse the cache; other modules' autotuners and
    the ``all`` mode are untouched."""
    fla_kernel = _load(tmp_path, "fla.ops.fake_pin", monkeypatch)
    ours = _load(tmp_path, "attnlab.fake_pin", monkeypatch)
    at = fla_kernel.fn
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "all")
    assert autotune.pin_fla_autotuners() == 0 and not hasattr(at, "pinned_first")
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "first")
    assert autotune.pin_fla_autotuners() >= 1 and at.pinned_first and not hasattr(ours.fn, "pinned_first")
    run = at.run
    autotune.pin_fla_autotuners()
    assert at.run is run  # idempotent: not wrapped twice
    monkeypatch.setattr(at, "_bench", lambda *a, **kw: pytest.fail("a pinned autotuner timed a config"))
    prunes = []
    prune = at.early_config_prune
    monkeypatch.setattr(at, "early_config_prune", lambda *a, **kw: prunes.append(1) or prune(*a, **kw))
    assert _block(fla_kernel, 40) == 16
    assert _block(fla_kernel, 100) == 32  # the prune drops 16 here: its first kept config
    assert _block(fla_kernel, 40) == 16 and len(prunes) == 2  # a seen key: the cache, no prune
    assert {k[0]: c.kwargs["BLOCK"] for k, c in at.cache.items()} == {40: 16, 100: 32}


def test_pinned_autotuner_skips_a_config_that_does_not_compile(monkeypatch, tmp_path):
    """A config out of shared memory (or registers, or a static assert) at a key is skipped as Triton's search skips
    it; the next kept one runs. Where none compiles, the last error is raised."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "first")
    kernel = _load(tmp_path, "fla.ops.fake_pin", monkeypatch)
    at = kernel.fn
    autotune.pin_fla_autotuners()
    real = at.fn.run
    too_big = {16}

    def run(*args, **kwargs):
        if kwargs["BLOCK"] in too_big:
            raise OutOfResources(kwargs["BLOCK"] * 4096, 65536, "shared memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(at.fn, "run", run)
    assert _block(kernel, 50) == 32 and at.cache[(50, "torch.int32")].kwargs["BLOCK"] == 32
    too_big.update((32, 64))
    with pytest.raises(OutOfResources):
        _block(kernel, 51)
    assert (51, "torch.int32") not in at.cache


def test_fast_launch_does_not_record_a_pinned_config(monkeypatch, tmp_path):
    """A pinned autotuner did not search: FastLaunch records no pick for it (ATTNLAB_RECORD_PICKS stays the
    autotuner's choices only), and later launches run the pinned config on the bare kernel."""
    from attnlab.attention.ops import autotune_picks
    from attnlab.attention.ops.fla_launch import FastLaunch

    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "first")
    kernel = _load(tmp_path, "fla.ops.fake_pin", monkeypatch)
    autotune.pin_fla_autotuners()
    recorded = []
    monkeypatch.setattr(autotune_picks, "record", lambda *a: recorded.append(a))
    fast = FastLaunch(kernel)
    assert [_block(fast, 100) for _ in range(2)] == [32, 32]
    assert recorded == []


def test_compile_candidates_once_per_key(monkeypatch):
    """At a new autotune key every candidate the prune keeps is compiled (``warmup``) before the autotuner runs,
    through Triton's thread-pool compile mode, together with the candidates of the jobs passed with it; a key seen
    before compiles nothing, and a single candidate alone is left to the autotuner."""
    from triton import Config

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(autotune, "PRECOMPILE", True)
    monkeypatch.setattr(autotune, "_COMPILED", set())
    calls = []

    class FakeKernel:
        arg_names = ["Q", "T"]

        def __init__(self, n):
            self.configs = [Config({"BM": 16 * (i + 1)}, num_warps=4) for i in range(n)]
            self.fn = SimpleNamespace(__name__=f"k{n}", warmup=lambda *a, grid, **kw: calls.append((n, a, kw)))

        def prune_configs(self, meta):
            assert self.nargs == {"Q": q, "T": 8}
            return self.configs[:-1]  # the prune drops one

    q = torch.zeros(2, dtype=torch.bfloat16)
    three = FakeKernel(3)
    autotune.compile_candidates((three, None, (q, 8), {"D": 64}))
    assert sorted(kw["BM"] for _, _, kw in calls) == [16, 32] and all(kw["D"] == 64 for _, _, kw in calls)
    autotune.compile_candidates((three, None, (q, 8), {"D": 64}))
    assert len(calls) == 2
    autotune.compile_candidates((three, None, (q, 8), {"D": 128}))  # a new key
    assert len(calls) == 4
    autotune.compile_candidates((FakeKernel(2), None, (q, 8), {"D": 64}))  # one candidate alone: left as it is
    assert len(calls) == 4
    # the jobs that follow (a forward's backward) join the pool at a new key only; their seen keys are skipped
    follow = lambda: [(three, None, (q, 8), {"D": 64}), (FakeKernel(4), None, (q, 8), {"D": 64})]  # noqa: E731
    autotune.compile_candidates((three, None, (q, 8), {"D": 64}), follow)
    assert len(calls) == 4
    autotune.compile_candidates((FakeKernel(2), None, (q, 8), {"D": 32}), follow)
    assert [(n, kw["BM"]) for n, _, kw in calls[4:]] == [(2, 16), (4, 16), (4, 32), (4, 48)]
