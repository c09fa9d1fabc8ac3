"""tests/conftest.py gives every GPU test pytest-timeout's limit for its marker, so a stalled GPU test fails with its
name inside the suite's budget instead of looking like a hang; without CUDA the GPU tests are skipped."""

import pytest
import torch

from tests import conftest


class FakeItem:
    """The part of a pytest item that ``pytest_collection_modifyitems`` reads and writes."""

    def __init__(self, *decorators):
        self.nodeid = "tests/test_x.py::test_x"
        self.marks = [d.mark for d in decorators]

    def iter_markers(self, name=None):
        return (m for m in self.marks if name is None or m.name == name)

    def get_closest_marker(self, name):
        return next(self.iter_markers(name), None)

    def add_marker(self, decorator):
        self.marks.append(decorator.mark)


def _limits(items):
    return [[m.args[0] for m in item.iter_markers("timeout")] for item in items]


def test_gpu_tests_get_the_limit_of_their_marker(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    items = [FakeItem(pytest.mark.gpu), FakeItem(pytest.mark.gpu_sweep), FakeItem(pytest.mark.gpu,
                                                                                   pytest.mark.timeout(7)), FakeItem()]
    conftest.pytest_collection_modifyitems(None, items)
    assert _limits(items) == [[conftest.GPU_TEST_TIMEOUT["gpu"]], [conftest.GPU_TEST_TIMEOUT["gpu_sweep"]], [7], []]
    assert conftest.GPU_TEST_TIMEOUT["gpu"] <= 600 / 4  # a stall costs at most a quarter of the 10-minute cold suite
    assert not any(item.get_closest_marker("skip") for item in items)


def test_gpu_tests_are_skipped_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    items = [FakeItem(pytest.mark.gpu), FakeItem(pytest.mark.gpu_sweep), FakeItem()]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.get_closest_marker("skip") is not None for item in items] == [True, True, False]
    assert _limits(items) == [[], [], []]


def test_a_test_marked_both_gpu_and_gpu_sweep_is_refused(monkeypatch):
    with pytest.raises(pytest.UsageError, match="marked both gpu and gpu_sweep"):
        conftest.pytest_collection_modifyitems(None, [FakeItem(pytest.mark.gpu, pytest.mark.gpu_sweep)])
