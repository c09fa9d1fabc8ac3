"""Host syncs per training step (attnlab/trainer/syncs.py): the CPU counter's rules, call by call, and the count of a
real softmax training run and (slow) of context-parallel ones, so that a new sync in the training step fails here with
its file and line."""

from __future__ import annotations

import collections

import pytest
import torch

from attnlab.trainer.syncs import CpuSyncs, read_step_syncs
from tests.utils import make_corpus, run_train, tiny_args

MAX_SYNCS = {"step": 0, "log step": 1}
"""The most host syncs a softmax training step may make: none, and at a log step the one read of the logged metrics
with the non-finite guard's flag (trainer.step.log_step)."""


def _count(fn, host=()) -> list[str]:
    """What ``fn(device tensor, host tensor)`` would sync on CUDA (the device tensor is a parameter's)."""
    device, h = torch.nn.Parameter(torch.arange(4.0)), torch.tensor([1, 0, 2])
    with CpuSyncs() as counter:
        counter.mark_host(h)
        fn(device, h)
    return [s.what for s in counter.take()]


@pytest.mark.parametrize("call,expected", [
    (lambda d, h: d.sum().item(), ["Tensor.item"]),
    (lambda d, h: (d * 2).tolist(), ["Tensor.tolist"]),
    (lambda d, h: bool(d.sum() > 0), ["Tensor.__bool__"]),
    (lambda d, h: int(d.sum()), ["Tensor.__int__"]),
    (lambda d, h: d.detach().cpu(), ["Tensor.cpu"]),
    (lambda d, h: d.detach().to("cpu"), ["Tensor.to to host"]),
    (lambda d, h: d.nonzero(), ["nonzero"]),
    (lambda d, h: d[[0, 2]], ["list index"]),
    (lambda d, h: d[d > 1], ["boolean-mask index"]),
    (lambda d, h: d[h], ["host index tensor"]),
    (lambda d, h: d.new_tensor([1.0]), ["new_tensor to device"]),
    (lambda d, h: torch.tensor(3, device=d.device), ["tensor to device"]),
    (lambda d, h: h.to(d.device), ["Tensor.to blocking to device"]),
    # what does not sync: views and slices, fills from Python numbers, the host's own work, a non-blocking copy
    (lambda d, h: (d[1:3], d[0], torch.stack([d[0], d[2]]), torch.full((1,), 5, device=d.device)), []),
    (lambda d, h: (h.sum().item(), h.tolist(), h.nonzero(), int(h[0]), torch.tensor([1, 2]).tolist()), []),
    (lambda d, h: torch.zeros(2, device=h.device).nonzero(), []),
    (lambda d, h: d.detach().index_select(0, h.to(d.device, non_blocking=True)), []),
], ids=lambda v: "" if callable(v) else ",".join(v) or "none")
def test_cpu_counter_counts_what_would_sync_on_cuda(call, expected):
    assert _count(call) == expected


def test_a_host_tensor_copied_to_the_device_stays_a_host_tensor():
    """``.to(device)`` returns the tensor itself on a CPU; the counter hands back a copy, as a GPU would."""
    def fn(d, h):
        on_device = h.to(d.device, non_blocking=True)
        assert on_device is not h
        h.tolist()  # still the host's
        on_device.tolist()

    assert _count(fn) == ["Tensor.tolist"]


def test_the_backward_runs_under_the_counter():
    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            g.sum().item()
            return g * 2

    assert _count(lambda d, h: ReadsInBackward.apply(d).sum().backward()) == ["Tensor.item"]


def test_softmax_training_steps_stay_within_their_host_syncs(tmp_path, monkeypatch):
    """4 steps of the tiny softmax run, logging at steps 2 and 4, without saves or validation."""
    corpus = make_corpus(tmp_path / "corpus")
    dump = tmp_path / "run"
    args = tiny_args(corpus, dump, 4, 16, 2, "--metrics.log_freq", "2", "--checkpoint.no-enable",
                     "--validation.no-enable")
    monkeypatch.setenv("ATTNLAB_COUNT_SYNCS", "1")
    run_train(args)
    steps = read_step_syncs(dump / "syncs" / "rank0.jsonl")
    assert sorted(steps) == [1, 2, 3, 4]
    for step in (2, 3, 4):  # step 1 also builds torchtitan's meshes (lazily)
        kind = "log step" if step % 2 == 0 else "step"
        record = steps[step]
        assert record["count"] <= MAX_SYNCS[kind], f"{kind} {step}: {record['count']} host syncs: {record['syncs']}"


CP_SYNCS = {"softmax": {"attnlab/attention/ops/common.py": 16}, "gdn": {}}
"""The most host syncs a plain training step under context parallelism (CP = 2, 4 layers) may make, by file: the
segment layouts come built from the host (trainer.step), so none is the segments'; softmax's CPU reference kernel
reads its query and key counts (2 per chunk and layer), a path CUDA does not run."""


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", sorted(CP_SYNCS))
def test_context_parallel_training_steps_stay_within_their_host_syncs(mechanism, tmp_path, monkeypatch):
    """4 steps of the tiny run on 2 gloo processes (CP = 2) with documents crossing the chunks, logging at steps 2
    and 4: a plain step makes at most :data:`CP_SYNCS`, a log step also the logged metrics' one read."""
    corpus = make_corpus(tmp_path / "corpus", seq_len=6, n_train=96, n_val=16)
    dump = tmp_path / "run"
    args = tiny_args(corpus, dump, 4, 16, 2, "--metrics.log_freq", "2", "--checkpoint.no-enable",
                     "--validation.no-enable", "--model.attention", mechanism, "--model.attn_mask_type",
                     "block_causal", "--parallelism.context_parallel_degree", "2")
    monkeypatch.setenv("ATTNLAB_COUNT_SYNCS", "1")
    run_train(args, nproc=2)
    for rank in (0, 1):
        steps = read_step_syncs(dump / "syncs" / f"rank{rank}.jsonl")
        for step in (2, 3, 4):
            allowed = {**CP_SYNCS[mechanism], **({"attnlab/trainer/step.py": 1} if step % 2 == 0 else {})}
            by_file = collections.Counter()
            for where, n in steps[step]["syncs"].items():
                by_file[where.split(":")[0]] += n
            assert all(n <= allowed.get(f, 0) for f, n in by_file.items()), (rank, step, steps[step]["syncs"])


def test_the_guard_decides_nothing_per_step_and_names_the_first_bad_step_at_the_log_step():
    """``nonfinite_skips = 0``: a NaN loss at step 3 is noted on the device, the optimizer step is not held up (no
    sync), and the log step's check (``first_bad`` read with the metrics) stops the run naming step 3."""
    from attnlab.trainer.nonfinite import NonFiniteError, NonFiniteGuard

    model = torch.nn.Linear(2, 2)
    guard = NonFiniteGuard([model], None, torch.device("cpu"), 0, None)
    with CpuSyncs() as counter:
        for step, loss in ((2, 1.0), (3, float("nan")), (4, 1.0)):
            guard.note_loss(model.weight.sum() * loss)
            assert guard.step_is_finite(step)
        assert counter.take() == []
        first = guard.first_bad().tolist()
    with pytest.raises(NonFiniteError, match=r"first at step 3\).*training stopped at step 4"):
        guard.check(4, 1.0, 1.0, first_bad=first)
