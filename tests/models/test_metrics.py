"""The metrics processor's wandb run: project, name and folder from the config (a fake ``wandb`` module)."""

import sys
import types

import pytest
import torch.distributed as dist

import config


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

    from models.cpu import install_cpu_shim
    from models.metrics import build_metrics

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

