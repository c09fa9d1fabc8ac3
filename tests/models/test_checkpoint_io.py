"""Offline checkpoint loading (models/checkpoint_io.py): keys on either side that do not match are errors."""

import pytest

from config import DEFAULT_CONFIG, parse_config
from models.checkpoint_io import build_model, load_weights, model_args_from_config, save_dcp_state


def _model(*flags):
    cfg = parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.vocab_size", "64", *flags])
    return build_model(model_args_from_config(cfg))


def test_checkpoint_keys_the_model_lacks_are_an_error(tmp_path):
    parallax = _model("--model.attention", "parallax")
    save_dcp_state(parallax.state_dict(), tmp_path / "px", parallax.model_args)
    with pytest.raises(ValueError, match=r"not in the model \['layers.0.attention.r_norm.weight'"):
        load_weights(_model(), tmp_path / "px")
    softmax = _model()
    assert load_weights(softmax, tmp_path / "px", strict=False) == []  # on purpose: the common keys


def test_model_keys_the_checkpoint_lacks_are_an_error(tmp_path):
    softmax = _model()
    save_dcp_state(softmax.state_dict(), tmp_path / "sm", softmax.model_args)
    with pytest.raises(ValueError, match=r"missing \['layers.0.attention.wr.weight', 'layers.0.attention.r_norm.weight'"):
        load_weights(_model("--model.attention", "parallax"), tmp_path / "sm")
