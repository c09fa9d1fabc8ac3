"""attnlab/tools/multigpu_check.py on CPU processes (gloo): 1 vs 2 processes at the same global batch (gradient
accumulation vs FSDP, Muon's distributed path vs single-process), and a 2-process checkpoint resumed on 1
process; plus the data loader's resharding rule and its refusal for streaming data."""

import math
import pickle
from types import SimpleNamespace

import pytest
from datasets import Dataset, IterableDataset

from attnlab.data.loader import ReshardableDataloader
from attnlab.tools import multigpu_check


@pytest.mark.slow  # the same comparisons run in tests/test_train.py and tests/test_conformance.py
def test_one_vs_two_processes_and_resume_two_to_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    rc = multigpu_check.main(["--device", "cpu", "--nprocs", "1,2", "--resume", "2:1", "--steps", "4",
                              "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "3/3 passed" in out and "FAIL" not in out
    assert "resharded from 2 to 1 ranks" in (tmp_path / "resume_2to1.log").read_text()


def _fake_loader(data, world, rank):
    fake = SimpleNamespace(dataset=SimpleNamespace(_data=data, _sample_idx=0, _token_buffer=[7]),
                           dp_world_size=world, dp_rank=rank, checkpoint_path="runs/x/checkpoint/step-6")
    fake.check_reshardable = lambda old: ReshardableDataloader.check_reshardable(fake, old)
    return fake


@pytest.mark.parametrize("old_done,new_world", [([5, 4], 1), ([5, 4], 3), ([3, 3, 2, 3], 2), ([0, 0], 4)])
def test_reshard_rule_skips_exactly_the_documents_every_old_rank_read(old_done, new_world):
    W = len(old_done)
    read = {r + k * W for r, n in enumerate(old_done) for k in range(n)}
    n_global = next(g for g in range(10**6) if g not in read)  # first document some old rank has not read
    state = {f"dp_rank_{r}": pickle.dumps({"dataset_state": {"sample_idx": n, "token_buffer": [1, 2]}})
             for r, n in enumerate(old_done)} | {"world_size": W}
    data = Dataset.from_dict({"text": ["a"] * 64})
    for r in range(new_world):
        fake = _fake_loader(data, new_world, r)
        ReshardableDataloader.load_state_dict(fake, state)
        skipped = {r + k * new_world for k in range(fake.dataset._sample_idx)}
        assert fake.dataset._token_buffer == []
        # everything skipped was read before, and the next document of this rank is the first unread one on
        assert skipped <= read and all(g < n_global for g in skipped)
        assert r + fake.dataset._sample_idx * new_world >= n_global
        assert math.ceil((n_global - r) / new_world) == max(0, fake.dataset._sample_idx)


def test_streaming_data_cannot_reshard_and_says_why():
    stream = IterableDataset.from_generator(lambda: iter([{"text": "a"}]))
    fake = _fake_loader(stream, 1, 0)
    with pytest.raises(ValueError, match=r"runs/x/checkpoint/step-6.*written by 2 data-parallel ranks.*has 1"):
        fake.check_reshardable(2)
    fake.check_reshardable(1)  # same world size: fine


@pytest.mark.parametrize("replicate,k,expected", [(1, 4, []), (2, 2, []), (2, 3, []), (2, 4, ["2", "2"]),
                                                   (2, 8, ["2", "4"])])
def test_replicate_makes_hsdp_of_runs_it_divides(replicate, k, expected):
    """``--replicate R``: R replicas of k/R shards where R divides k and k > R; other runs stay plain FSDP."""
    flags = multigpu_check.layout(SimpleNamespace(replicate=replicate, context_parallel=False), k)
    assert flags[1::2] == expected
    assert flags[0::2] == (["--parallelism.data_parallel_replicate_degree", "--parallelism.data_parallel_shard_degree"]
                           if expected else [])


def test_context_parallel_runs_split_sequences_over_all_their_processes():
    """``--context-parallel``: a K-process run is one data-parallel rank with CP degree K and the whole batch."""
    args = SimpleNamespace(replicate=1, context_parallel=True, global_batch=16)
    assert multigpu_check.layout(args, 1) == []
    assert multigpu_check.layout(args, 4) == ["--parallelism.context_parallel_degree", "4",
                                              "--training.local_batch_size", "16"]
