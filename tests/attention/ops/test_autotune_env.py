"""ATTNLAB_AUTOTUNE: the candidate lists the Triton kernels autotune over."""

import pytest

from attention.ops.autotune import candidates


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

    from attention.ops.autotune import first_config_for_fla

    monkeypatch.setattr(triton, "autotune", triton.autotune)  # undone after the test
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "all")
    first_config_for_fla()
    assert len(_load(tmp_path, "fla.ops.fake").configs) == 3  # "all": untouched
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "first")
    first_config_for_fla()
    assert "cache_results" in inspect.signature(triton.autotune).parameters  # fla inspects it
    assert [c.num_warps for c in _load(tmp_path, "fla.ops.fake").configs] == [1]
    assert len(_load(tmp_path, "attention.ops.fake").configs) == 3
