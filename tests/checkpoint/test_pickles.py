"""Checkpoints from elsewhere run nothing (attnlab/checkpoint/dcp.py ``check_pickles``): every pickle of a DCP step
folder (``.metadata``, the non-tensor items of the shards, the data loader's state inside them) is read with an
allow-list before torch or torchtitan unpickles anything, and a crafted one is refused naming the file. Each crafted
pickle would create a marker file when unpickled; the marker must not exist afterwards. Training resume:
tests/test_run_safety.py."""

import builtins
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from attnlab import configs
from attnlab.checkpoint.dcp import CheckpointError, UnsafeCheckpointError, check_pickles, load_dcp_state
from attnlab.checkpoint.layout import resolve
from attnlab.checkpoint.load import load_checkpoint, load_model, load_tool_checkpoint


class Marker:
    """Unpickling it opens (creates) ``path``: what a crafted checkpoint's code would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return builtins.open, (self.path, "w")


def _step(folder, dataloader_state=None, extra=None):
    """A DCP step folder as the trainer writes one: model tensors, train state, the data loader's pickled state."""
    state = {"tok_embeddings.weight": torch.randn(8, 4), "norm.weight": torch.ones(4),
             "train_state": {"step": 3, "ntokens_seen": 96},
             "optimizer": {"param_groups": {"norm.weight": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "norm"}}},
             "dataloader": {"dp_rank_0": pickle.dumps(dataloader_state or {"dataset_state": {"sample_idx": 4}}),
                            "world_size": 1}, **(extra or {})}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


@pytest.fixture(autouse=True)
def _no_dist_warning():
    import warnings

    warnings.filterwarnings("ignore", "torch.distributed is disabled")


def test_a_checkpoint_as_written_passes_and_each_crafted_pickle_is_refused_naming_it(tmp_path):
    marker = tmp_path / "marker"
    good = _step(tmp_path / "good")
    meta = check_pickles(good)
    assert "train_state.step" in meta.state_dict_metadata
    assert set(load_dcp_state(good)) == {"tok_embeddings.weight", "norm.weight"}

    crafted_metadata = shutil.copytree(good, tmp_path / "metadata")
    (crafted_metadata / ".metadata").write_bytes(pickle.dumps(Marker(marker)))
    crafted_item = _step(tmp_path / "item", extra={"train_state": {"step": Marker(marker)}})
    crafted_loader = _step(tmp_path / "loader", dataloader_state=Marker(marker))
    cases = [(crafted_metadata, r"metadata: refused, it names io\.open"),
             (crafted_item, r"__0_0\.distcp \(item train_state\.step\): refused by torch's restricted unpickler"),
             (crafted_loader, r"__0_0\.distcp \(item dataloader\.dp_rank_0\): refused, it names io\.open")]
    for folder, message in cases:
        with pytest.raises(UnsafeCheckpointError, match=message):
            check_pickles(folder)
        with pytest.raises(UnsafeCheckpointError, match=message):
            load_dcp_state(folder)
        assert not marker.exists(), folder
    # the crafted files are live: torch's own reader runs the .metadata's code
    dcp.FileSystemReader(str(crafted_metadata)).read_metadata()
    assert marker.exists()


def test_a_truncated_or_foreign_pickle_is_one_error_naming_the_file(tmp_path):
    folder = _step(tmp_path / "step-3")
    (folder / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointError, match=r"step-3/\.metadata: holds a dict, not DCP metadata"):
        check_pickles(folder)
    (folder / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=r"step-3/\.metadata: not a readable pickle"):
        check_pickles(folder)


def _crafted_run(tmp_path):
    """A run folder (config.toml) whose newest step's .metadata would create ``marker``."""
    run = tmp_path / "run"
    step = _step(run / "checkpoint" / "step-3")
    (step / ".metadata").write_bytes(pickle.dumps(Marker(tmp_path / "marker")))
    shutil.copy(configs.path("debug_cpu"), run / "config.toml")
    return run, tmp_path / "marker"


def test_the_one_loader_refuses_a_crafted_step_for_every_entry(tmp_path):
    run, marker = _crafted_run(tmp_path)
    step = run / "checkpoint" / "step-3"
    for load in (lambda: load_model(run), lambda: load_tool_checkpoint(resolve(run)),
                 lambda: load_checkpoint(step)):
        with pytest.raises(UnsafeCheckpointError, match=r"step-3/\.metadata: refused"):
            load()
    assert not marker.exists()


@pytest.mark.parametrize("tool,argv", [
    ("eval_ppl", ["--data", "{data}"]),
    ("analyze", ["--data", "{data}"]),
    ("passkey", []),
    ("generate", ["--prompt", "w1 w2"]),
    ("export_hf", ["{out}"]),
    ("convert_to_parallax", ["{out}"]),
])
def test_every_tool_that_loads_a_step_refuses_a_crafted_one(tmp_path, tool, argv, capsys):
    import importlib

    run, marker = _crafted_run(tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "w1 w2 w3"}\n')
    argv = [a.format(data=data, out=tmp_path / "out") for a in argv]
    try:
        rc = importlib.import_module(f"attnlab.tools.{tool}").main([str(run), *argv])
    except SystemExit as e:
        rc = e.code
    assert rc not in (0, None)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step-3/.metadata: refused, it names io.open" in err[0], err
    assert not marker.exists() and not (tmp_path / "out").exists()
