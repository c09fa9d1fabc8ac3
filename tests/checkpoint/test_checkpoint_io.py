"""Offline checkpoint loading (attnlab/checkpoint/dcp.py): keys on either side that do not match are errors, and a
tool loads every format through one path (checkpoint.load.load_model)."""

import pytest
import torch

from attnlab.config import DEFAULT_CONFIG, parse_config
from attnlab.checkpoint.dcp import CheckpointError, build_model, load_dcp_state, model_args_from_config, save_dcp_state
from attnlab.checkpoint.hf import save_hf
from attnlab.checkpoint.load import load_model


def _model(*flags):
    cfg = parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.vocab_size", "64", *flags])
    return build_model(model_args_from_config(cfg))


def test_checkpoint_keys_the_model_lacks_are_an_error(tmp_path):
    parallax = _model("--model.attention", "parallax")
    save_dcp_state(parallax.state_dict(), tmp_path / "px", parallax.model_args)
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['layers.0.attention."):
        build_model(_model().model_args, load_dcp_state(tmp_path / "px"))


def test_model_keys_the_checkpoint_lacks_are_an_error(tmp_path):
    softmax = _model()
    save_dcp_state(softmax.state_dict(), tmp_path / "sm", softmax.model_args)
    with pytest.raises(CheckpointError, match=r"missing \['layers.0.attention."):
        build_model(_model("--model.attention", "parallax").model_args, load_dcp_state(tmp_path / "sm"))


def test_one_path_loads_a_dcp_step_and_a_hugging_face_folder_alike(tmp_path):
    """load_model reads the run's DCP step (architecture from its record) and its HF export into equal models."""
    parallax = _model("--model.attention", "parallax")
    save_dcp_state(parallax.state_dict(), tmp_path / "run" / "checkpoint" / "step-1", parallax.model_args)
    save_hf(parallax.state_dict(), parallax.model_args, tmp_path / "hf")
    from_dcp, cfg, path = load_model(tmp_path / "run")
    from_hf, hf_cfg, _ = load_model(tmp_path / "hf")
    assert path == tmp_path / "run" / "checkpoint" / "step-1"
    assert cfg.model.attention == hf_cfg.model.attention == "parallax"
    for (k, a), (_, b) in zip(from_dcp.state_dict().items(), from_hf.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_train_flags_for_a_hugging_face_folder_without_a_config_are_refused(tmp_path):
    softmax = _model()
    save_hf(softmax.state_dict(), softmax.model_args, tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"flags after `--` \(--model.attention parallax\) have no configuration"):
        load_model(tmp_path / "hf", ["--model.attention", "parallax"])


def test_a_mechanism_not_registered_here_is_one_error_naming_the_import():
    """A record of a user's own mechanism, read where its module was not imported: one CheckpointError (the tools
    print it as one line) that says what to import, not the registry's generic refusal."""
    from attnlab.checkpoint.dcp import args_from_dict, args_to_dict

    record = args_to_dict(model_args_from_config(parse_config(["--job.config_file", DEFAULT_CONFIG])))
    record.update(attention="my_own_mechanism", layer_pattern=[], attention_options={})
    with pytest.raises(CheckpointError, match=r"'my_own_mechanism', which is not registered here: import the module"):
        args_from_dict(record)
