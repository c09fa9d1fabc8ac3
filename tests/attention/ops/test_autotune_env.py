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
