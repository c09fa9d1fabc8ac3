"""The metrics processor: TensorBoard names and metrics.jsonl keys from a training run, and the wandb run's project,
name and folder from the config (a fake ``wandb`` module)."""

import math
import sys
import types

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from attnlab import config
from tests.utils import losses, read_metrics, run_train, tiny_args


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")
    fake.run = None
    fake.init = lambda **kw: calls.append(kw)
    fake.log = lambda metrics, step: None
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return calls


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("extra,project,name", [
    ([], "attnlab", "myrun"),
    (["--metrics.wandb_project", "p1", "--metrics.wandb_run_name", "r1"], "p1", "r1"),
])
def test_wandb_project_name_and_folder_come_from_the_config(fake_wandb, one_process_group, tmp_path, extra, project,
                                                            name):
    from torchtitan.distributed import ParallelDims

    from attnlab.trainer.cpu import install_cpu_shim
    from attnlab.trainer.metrics import build_metrics

    install_cpu_shim()
    dump = tmp_path / "myrun"
    cfg = config.parse_config(["--job.config_file", config.DEFAULT_CONFIG, "--job.dump_folder", str(dump),
                               "--metrics.enable_wandb", *extra])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    build_metrics(cfg, dims)
    assert len(fake_wandb) == 1, fake_wandb  # one run, not torchtitan's as well
    kw = fake_wandb[0]
    assert (kw["project"], kw["name"], kw["dir"]) == (project, name, str(dump))
    assert kw["config"]["model"]["attention"] == "softmax"



def test_tensorboard_tags_are_torchtitans_and_metrics_jsonl_keeps_its_keys(corpus, tmp_path):
    """TensorBoard (and wandb, which is given the same metrics) names them as torchtitan does, with perplexity,
    progress and each group's lr/wd passed through its ``extra_metrics``; metrics.jsonl keeps the short keys the tools
    read. On a CPU, MFU is NaN (null in metrics.jsonl), not a fraction of an A100's peak."""
    dump = tmp_path / "run"
    run_train(tiny_args(corpus, dump, 2, 16, 2, "--metrics.enable-tensorboard", "--checkpoint.no-enable"))
    (events,) = (dump / "tb").rglob("events.out.tfevents.*")
    tb = EventAccumulator(str(events))
    tb.Reload()
    tags = set(tb.Tags()["scalars"])
    assert {"loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "loss_metrics/perplexity", "grad_norm",
            "throughput(tps)", "tflops", "mfu(%)", "time_metrics/end_to_end(s)", "time_metrics/data_loading(s)",
            "time_metrics/elapsed(s)", "time_metrics/eta(s)", "memory/max_reserved(GiB)", "n_tokens_seen", "lr",
            "validation_metrics/loss", "validation_metrics/perplexity", "validation_metrics/throughput(tps)"} <= tags
    assert any(t.startswith("lr/") for t in tags) and any(t.startswith("wd/") for t in tags)
    assert not tags & {"loss", "ppl", "max_loss", "tps", "mfu", "memory_gib", "elapsed_s", "eta_s", "val_loss",
                       "val_ppl"}
    loss = {e.step: e.value for e in tb.Scalars("loss_metrics/global_avg_loss")}
    assert loss == pytest.approx(losses(dump), rel=1e-6)
    assert [e.step for e in tb.Scalars("validation_metrics/loss")] == [1, 2]
    mfu = [e.value for e in tb.Scalars("mfu(%)")]
    assert all(math.isnan(v) for v in mfu) == (not torch.cuda.is_available())
    records = read_metrics(dump)
    assert {"loss", "ppl", "tps", "mfu", "memory_gib", "elapsed_s", "eta_s"} <= set(records[0])
    assert {"val_loss", "val_ppl"} <= set(next(r for r in records if "val_loss" in r))


def test_document_flops_count_each_documents_own_attention():
    """Under ``block_causal`` a step's FLOPs are the sum over its documents (a query attends within its own
    document), so a row of short documents counts less attention than one row-long sequence."""
    from attnlab.config import DEFAULT_CONFIG, parse_config
    from attnlab.data.loader import document_lengths
    from attnlab.checkpoint.dcp import build_model, model_args_from_config
    from attnlab.trainer.metrics import DocumentFlops

    args = model_args_from_config(parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.attention", "softmax"]))
    model = build_model(args)
    counter = DocumentFlops(lambda n: args.training_flops(model, [n]))
    # two rows of 8 tokens: documents of 3, 5 | 2, 4, 2 (positions restart at 0 at every document)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 0, 1]])
    assert document_lengths(positions) == [3, 5, 2, 4, 2]
    counter.add(positions)
    counter.add(positions[:1])  # a second microbatch before the log step
    expected = args.training_flops(model, [3, 5, 2, 4, 2, 3, 5])
    assert counter.per_token(24) == pytest.approx(expected / 24)
    assert counter.total == 0  # the next interval starts from zero
    whole_rows = args.get_nparams_and_flops(model, 8)[1]  # torchtitan's count: every row one 8-token sequence
    counter.add(positions)
    assert counter.per_token(16) < whole_rows


def test_block_causal_run_logs_the_document_count(corpus, tmp_path):
    """A ``block_causal`` run's tflops / tokens per second is its documents' count per token: less than a whole-row
    sequence's, more than the weight matmuls alone."""
    from attnlab.config import parse_config
    from attnlab.checkpoint.dcp import build_model, model_args_from_config

    argv = tiny_args(corpus, tmp_path / "run", 2, 64, 2, "--checkpoint.no-enable")  # rows of several documents
    run_train(argv)
    args = model_args_from_config(parse_config(argv))
    model = build_model(args)
    whole_rows = args.get_nparams_and_flops(model, 64)[1]
    dense_only = args.training_flops(model, [1])  # a 1-token document attends to itself only
    for r in read_metrics(tmp_path / "run"):
        if "tflops" in r:
            per_token = r["tflops"] * 1e12 / r["tps"]
            assert dense_only < per_token < whole_rows, (per_token, dense_only, whole_rows)
