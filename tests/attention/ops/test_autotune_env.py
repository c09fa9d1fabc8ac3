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


KERNEL_SRC = '''
import triton


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (1, 2, 4)], key=["N"])
@triton.jit
def kernel(x, N):
    pass
'''


def _load(tmp_path, name):
    import importlib.util

    path = tmp_path / (name.replace(".", "_") + ".py")
    path.write_text(KERNEL_SRC)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.kernel


def test_first_config_for_fla_restricts_only_fla_modules(monkeypatch, tmp_path):
    import inspect

    import triton

    from attnlab.attention.ops.autotune import first_config_for_fla

    monkeypatch.setattr(triton, "autotune", triton.autotune)  # undone after the test
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "all")
    first_config_for_fla()
    assert len(_load(tmp_path, "fla.ops.fake").configs) == 3  # "all": untouched
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "first")
    first_config_for_fla()
    assert "cache_results" in inspect.signature(triton.autotune).parameters  # fla inspects it
    assert [c.num_warps for c in _load(tmp_path, "fla.ops.fake").configs] == [1]
    assert len(_load(tmp_path, "attention.ops.fake").configs) == 3


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
