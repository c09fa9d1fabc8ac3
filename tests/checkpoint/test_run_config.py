"""A run's config.toml as the tools read it (attnlab/checkpoint/load.py, the one loader): one that does not parse is
one line naming the file (a 50-line TOMLDecodeError before), and one that describes another model than the step's
``attnlab.json`` record (a hand-edited ``rope_theta`` silently changed the model every tool built) is refused naming
each field and both values."""

import importlib

import pytest
import torch

from attnlab import configs
from attnlab.checkpoint.dcp import CheckpointError, build_model, model_args_from_config, save_dcp_state
from attnlab.checkpoint.layout import write_run_files
from attnlab.checkpoint.load import job_config, load_model


@pytest.fixture
def run(tmp_path):
    """A run folder as the trainer leaves one: config.toml and a step with its attnlab.json."""
    run = tmp_path / "run"
    cfg = job_config(configs.path("debug_cpu"))
    write_run_files(run, cfg)
    args = model_args_from_config(cfg)
    save_dcp_state(build_model(args).state_dict(), run / "checkpoint" / "step-2", args)
    return run


def _tool(tool, argv, capsys):
    try:
        rc = importlib.import_module(f"attnlab.tools.{tool}").main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc not in (0, None) and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("tool,argv", [("eval_ppl", ["--data", "x.jsonl"]), ("generate", ["--prompt", "w1"]),
                                       ("export_hf", ["{out}"]), ("passkey", [])])
def test_a_corrupt_config_toml_is_one_line_naming_the_file(run, tmp_path, tool, argv, capsys):
    (run / "config.toml").write_text((run / "config.toml").read_text() + "\n[model\n")
    line = _tool(tool, [str(run), *(a.format(out=tmp_path / "out") for a in argv)], capsys)
    assert f"{run / 'config.toml'}: not valid TOML (" in line


def test_a_config_toml_edited_after_training_is_named_field_by_field(run, capsys):
    load_model(run)  # as the run wrote it: it loads
    text = (run / "config.toml").read_text()
    assert "rope_theta = 0.0" in text  # the flavor's (1e6)
    (run / "config.toml").write_text(text.replace("rope_theta = 0.0", "rope_theta = 5000.0"))
    with pytest.raises(CheckpointError, match=r"config.toml describes another model than .*step-2/attnlab.json, the "
                                              r"record the checkpoint was saved with: rope_theta: 1000000.0 in the "
                                              r"record, 5000.0 in config.toml\. Was it edited after training\?"):
        load_model(run)
    line = _tool("eval_ppl", [str(run), "--data", "x.jsonl"], capsys)
    assert "rope_theta: 1000000.0 in the record, 5000.0 in config.toml" in line
    (run / "config.toml").write_text(text)
    model, _, _ = load_model(run, ["--model.rope_theta", "5000"])  # a change on purpose, after `--`
    assert torch.isfinite(next(model.parameters())).all()
