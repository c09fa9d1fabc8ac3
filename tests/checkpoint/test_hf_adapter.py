"""torchtitan's state-dict adapter path: ``--checkpoint.initial_load_in_hf`` and ``--checkpoint.last_save_in_hf``
work through the TrainSpec's adapter for every mechanism."""

import pytest
import torch

from attnlab import attention
from attnlab.checkpoint.dcp import build_model
from attnlab.checkpoint.hf import AttnLabStateDictAdapter, save_hf
from attnlab.checkpoint.load import args_from_job_config, load_checkpoint
from tests.checkpoint.test_hf import _args, _model
from tests.utils import make_corpus, run_train, tiny_args

pytest.importorskip("safetensors")


@pytest.mark.parametrize("mech", sorted(attention.REGISTRY))
def test_adapter_round_trip_every_mechanism(mech):
    from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

    pattern = ["softmax", mech] if mech != "softmax" else ["softmax"]
    args = _args(pattern, tied=False)
    sd = build_model(args).state_dict()
    adapter = AttnLabStateDictAdapter(args, None)
    assert isinstance(adapter, BaseStateDictAdapter)
    hf = adapter.to_hf(sd)
    assert all(k.startswith(("model.", "lm_head.")) for k in hf)
    back = adapter.from_hf(hf)
    assert back.keys() == sd.keys() and all(back[k] is sd[k] for k in sd)


def test_trainer_loads_and_saves_hf_through_the_adapter(tmp_path):
    """A run starts from an HF folder (initial_load_in_hf) and, with lr 0, saves the same weights as safetensors
    at its last step (last_save_in_hf); both need the TrainSpec's adapter ("sd_adapter is not provided")."""
    corpus = make_corpus(tmp_path / "corpus")
    flags = tiny_args(corpus, tmp_path / "run", 1, 16, 2, "--model.layer_pattern", "parallax,softmax,gla,parallax",
                      "--attention.parallax.rho_gate")
    args = args_from_job_config(flags[1], flags[2:])
    model = _model(args)
    save_hf(model.state_dict(), args, tmp_path / "hf")
    run_train(flags + ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf",
                       "--checkpoint.initial_load_model_only", "--checkpoint.last_save_in_hf",
                       "--checkpoint.last_save_model_only", "--optimizer.lr", "0", "--optimizer.weight_decay", "0"])
    step = tmp_path / "run" / "checkpoint" / "step-1"
    assert list(step.glob("*.safetensors"))
    fmt, _, sd = load_checkpoint(step, args)
    ref = model.state_dict()
    assert fmt == "hf" and sd.keys() == ref.keys()
    assert all(torch.equal(sd[k], ref[k]) for k in ref), "saved weights differ from the HF weights loaded"
