"""Context parallelism (attention/cp.py) on CPU: the layout, then every mechanism that declares it trained on
2 gloo processes (CP = 2) against one process on the same rows, with documents that cross the shards, and a CP run
resumed on one process. Without the key/value all-gather a shard's queries would miss the other rank's keys,
without the delta rule's state passing or the short convolution's history a chunk would start from nothing, and
without the gradients summed back to the ranks that hold the tokens the second step would differ."""

from __future__ import annotations

import shutil

import pytest
import torch

from attention.cp import ContextParallel, documents
from attention.ops.common import visibility_mask
from attention.registry import REGISTRY
from config import DEFAULT_CONFIG, parse_config, validate_config
from scripts.tiny_runs import losses, make_corpus, read_metrics, tiny_args
from tests.utils import run_train

NAMES = sorted(n for n, e in REGISTRY.items() if getattr(e.cls, "context_parallel", False))


def cells(default: tuple[str, ...]) -> list:
    """Every CP mechanism; those not in ``default`` run with -m slow (CI time)."""
    return [pytest.param(n, marks=() if n in default else pytest.mark.slow) for n in NAMES]


CP_MECHANISMS = cells(("softmax", "parallax", "gdn"))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_shards_put_back_together_in_order(n):
    x = torch.arange(2 * 12 * n).view(2, 12 * n)
    ranks = [ContextParallel(None, n, r) for r in range(n)]
    parts = [cp.shard(x) for cp in ranks]
    assert all(p.shape == (2, 12) for p in parts)
    for cp, p in zip(ranks, parts):
        assert torch.equal(p[0], cp.global_index(12, "cpu"))  # x[0] counts positions
        assert torch.equal(cp.assemble(parts, 1), x)
    # the load balance: rank r's two chunks see (r + 1) + (2n - r) = 2n + 1 chunks of keys under a causal mask
    assert {sum(i + 1 for i in cp.chunks()) for cp in ranks} == {2 * n + 1}


def test_visibility_is_the_full_mask_at_each_shards_rows():
    """Causal and document masks, with and without a window: a shard's rows of the one-process mask."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])
    B, T = positions.shape
    starts = (positions.reshape(-1) == 0).nonzero().flatten()
    cu = torch.cat([starts, torch.tensor([B * T])]).to(torch.int32)
    for window in (None, 3):
        full = visibility_mask(B, T, "cpu", cu, window).expand(B, 1, T, T)
        for r in range(3):
            cp = ContextParallel(None, 3, r)
            rows = full[:, :, cp.global_index(T // 3, "cpu")]
            assert torch.equal(cp.visibility(documents(positions), window), rows)


def _cfg(*flags):
    return parse_config(["--job.config_file", DEFAULT_CONFIG, "--parallelism.context_parallel_degree", "2", *flags])


@pytest.mark.parametrize("flags,message", [
    (["--model.attention", "hla"], "mechanism 'hla' does not run under context parallelism yet; supported: "),
    (["--model.layer_pattern", "softmax,lla"], "mechanism 'lla' does not run under context parallelism yet"),
    (["--training.seq_len", "30"], "training.seq_len=30: must be a multiple of 2 x parallelism.context_parallel_degree"),
    (["--attention.impl", "triton"], "attention.impl='triton' with parallelism.context_parallel_degree=2"),
    (["--compile.enable"], "compile.enable with parallelism.context_parallel_degree=2"),
])
def test_what_context_parallelism_cannot_run_fails_naming_the_key(flags, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate_config(_cfg(*flags))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    # documents of 5 words + BOS/EOS = 7 tokens packed into rows of 16 + 1: document boundaries fall inside and
    # across the four chunks of each row
    return make_corpus(tmp_path_factory.mktemp("cp_corpus"), seq_len=6, n_train=96, n_val=16)


def _train(corpus, dump, attention, nproc, *extra):
    flags = tiny_args(corpus, dump, 4, 16, 2, "--model.attention", attention, "--model.attn_mask_type", "block_causal",
                      "--optimizer.name", "adamw", "--checkpoint.enable", "--checkpoint.interval", "2",
                      "--validation.freq", "2", *extra)
    if nproc > 1:
        flags += ["--parallelism.context_parallel_degree", str(nproc)]
    run_train(flags, nproc=nproc)
    return losses(dump)


@pytest.fixture(scope="module", params=CP_MECHANISMS)
def runs(request, corpus, tmp_path_factory):
    """(mechanism, one-process losses, CP = 2 losses, the CP run's folder), both runs from one seed checkpoint
    (sharded and unsharded initialisation draw different numbers)."""
    root = tmp_path_factory.mktemp(f"cp_{request.param}")
    _train(corpus, root / "seed", request.param, 1, "--checkpoint.create_seed_checkpoint")
    seed = ["--checkpoint.initial_load_path", str(root / "seed" / "checkpoint" / "step-0")]
    one = _train(corpus, root / "one", request.param, 1, *seed)
    two = _train(corpus, root / "cp2", request.param, 2, *seed)
    return request.param, one, two, root


def test_two_context_ranks_train_and_validate_as_one_process(runs):
    _, one, two, root = runs
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for s in one:
        assert abs(one[s] - two[s]) <= 1e-4, (s, one[s], two[s])
    val_one, val_two = ({r["step"]: r["val_loss"] for r in read_metrics(root / d) if "val_loss" in r}
                        for d in ("one", "cp2"))
    assert 4 in val_one and sorted(val_one) == sorted(val_two)
    for s in val_one:
        assert abs(val_one[s] - val_two[s]) <= 1e-4, (s, val_one[s], val_two[s])


@pytest.mark.parametrize("runs", cells(("gdn",)), indirect=True)
def test_a_context_parallel_checkpoint_resumes_on_one_process(runs, corpus, tmp_path):
    attention, _, two, root = runs
    resumed = tmp_path / "resumed"
    shutil.copytree(root / "cp2" / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    got = _train(corpus, resumed, attention, 1)
    assert sorted(got) == [3, 4]
    for s in got:
        assert abs(got[s] - two[s]) <= 1e-4, (s, got[s], two[s])


@pytest.mark.slow
def test_four_context_ranks_train_a_hybrid_as_one_process(corpus, tmp_path):
    """CP = 4 (8 chunks of 4 tokens, each holding a short convolution's 3 inputs of history) on the GDN + Parallax
    layer pattern of the hybrid config, against one process."""
    flags = ("--model.layer_pattern", "gdn,parallax", "--training.seq_len", "32", "--validation.seq_len", "32")
    _train(corpus, tmp_path / "seed", "gdn", 1, "--checkpoint.create_seed_checkpoint", *flags)
    seed = ("--checkpoint.initial_load_path", str(tmp_path / "seed" / "checkpoint" / "step-0"))
    one = _train(corpus, tmp_path / "one", "gdn", 1, *seed, *flags)
    four = _train(corpus, tmp_path / "cp4", "gdn", 4, *seed, *flags)
    assert sorted(one) == sorted(four) == [1, 2, 3, 4]
    for s in one:
        assert abs(one[s] - four[s]) <= 1e-4, (s, one[s], four[s])
