import os

import pytest
import torch

# Without a GPU, Triton kernels run on the CPU through the interpreter (at tiny shapes); with one, compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Correctness needs one compiled tile per autotune key, not the fastest: without this the GPU tests spent minutes
# autotuning on a cold machine (attnlab/attention/ops/autotune.py). Benchmarks do not go through pytest.
os.environ.setdefault("ATTNLAB_AUTOTUNE", "first")
if torch.cuda.is_available():  # fla-core (where installed) imported once, its autotuners pinned the same way, before
    from attnlab.attention.ops.common import fla_importable  # any test imports an fla module of its own

    fla_importable()


GPU_TEST_TIMEOUT = {"gpu": 120, "gpu_sweep": 300}
"""Seconds a GPU test may take (pytest-timeout), by marker, compiles on a cold cache included: past it the test fails
with its name (and the suite goes on), so a stall in the GPU suite reads as a failure, not as a hang. ``gpu``: the
default check, whose cold run must fit in 10 minutes on one GPU, so one stall may cost a fifth of that; with every
autotuner pinned (``ATTNLAB_AUTOTUNE=first``) a cold test compiles one config per kernel and key. ``gpu_sweep``
compiles every candidate of a kernel in turn. A test may set its own with ``@pytest.mark.timeout(N)``."""


GPU_MARKERS = {"gpu", "gpu_sweep"}
"""The markers of tests that need CUDA, one per test: ``gpu``, the default GPU check (each kernel's default tile
against its reference, every mechanism); ``gpu_sweep``, every autotune candidate of a kernel pinned in turn (slow),
which ``-m gpu`` must not select."""


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    for item in items:
        marks = GPU_MARKERS.intersection(m.name for m in item.iter_markers())
        if not marks:
            continue
        if len(marks) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked both gpu and gpu_sweep: a sweep takes gpu_sweep only")
        if not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        elif item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT[marks.pop()]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Every Triton op's output buffers are NaN before its kernels run (attnlab/attention/ops/outputs.py), so an element
    a kernel does not write fails the test that reads it."""
    from attnlab.attention.ops import outputs

    monkeypatch.setattr(outputs, "POISON_OUTPUTS", True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The tiny word-level corpus and tokenizer of attnlab/testing/tiny_runs.py, one per test module."""
    from tests.utils import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus"))
