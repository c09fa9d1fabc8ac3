"""What the offline tools are given: any folder of a run (the run, its checkpoint/ folder, a step folder), a run
nothing describes, a truncated shard, a generation past the trained context, and HF folders whose remote code is
not this project's. Each bad input is one line on stderr and a non-zero exit, before any work."""

import json
import os
import shutil

import pytest
import torch

from attnlab.config import parse_config
from attnlab.checkpoint.dcp import (SIDECAR, CheckpointError, build_model, config_and_architecture, load_dcp_state,
                                  model_args_from_config, save_dcp_state)
from attnlab.checkpoint.hf import save_hf
from attnlab.checkpoint.layout import resolve, save_tokenizer, write_run_files
from attnlab.tools import eval_downstream, eval_ppl, export_hf, generate
from tests.utils import make_corpus, tiny_args


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three copies of one trained-looking Parallax model (debug flavor, vocabulary 64, seq_len 16): ``config``,
    a run folder described by its config.toml only (the step folder has no attnlab.json); ``sidecar``, a run
    folder with no config.toml whose step folder carries attnlab.json; ``bare``, a run folder with neither."""
    root = tmp_path_factory.mktemp("runs")
    corpus = make_corpus(root / "corpus")
    cfg = parse_config(tiny_args(corpus, root / "config", 3, 16, 2, "--model.attention", "parallax"))
    model = build_model(model_args_from_config(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    for name in ("config", "sidecar", "bare"):
        step = root / name / "checkpoint" / "step-3"
        step.parent.mkdir(parents=True)
        save_dcp_state(model.state_dict(), step, model.model_args)
        save_tokenizer(corpus["tokenizer"], root / name / "tokenizer")
        if name != "sidecar":
            (step / SIDECAR).unlink()
    write_run_files(root / "config", cfg, corpus["tokenizer"])
    return root, corpus


def _eval(path, corpus, *extra):
    return eval_ppl.main([str(path), "--data", corpus["val"], "--batch-size", "2", "--max-rows", "2",
                          "--no-progress", *extra])


def test_every_folder_of_a_run_finds_the_run_and_its_config(runs, capsys):
    """RUN/checkpoint used to be taken for the run folder: no config.toml there, so the default config's model."""
    root, corpus = runs
    run = root / "config"
    for path in (run, run / "checkpoint", run / "checkpoint" / "step-3"):
        ckpt = resolve(path)
        assert (ckpt.path, ckpt.run, ckpt.config) == (run / "checkpoint" / "step-3", run, run / "config.toml")
    res = [_eval(path, corpus) for path in (run, run / "checkpoint")]
    assert res[0]["attention"] == res[1]["attention"] == "parallax" and res[0]["loss"] == res[1]["loss"]
    # a checkpoint folder of another name (checkpoint.folder) finds the run by its config.toml
    other = root / "renamed"
    shutil.copytree(run, other)
    (other / "checkpoint").rename(other / "ckpt")
    assert resolve(other / "ckpt").run == resolve(other / "ckpt" / "step-3").run == other
    assert generate.main([str(run / "checkpoint"), "--prompt", "5 17 3", "--tokenizer", "ids", "--greedy",
                          "--max-new-tokens", "2", "--device", "cpu"]) == 0


def test_a_run_described_only_by_its_step_sidecar_is_that_model(runs):
    root, corpus = runs
    described, sidecar = _eval(root / "config", corpus), _eval(root / "sidecar" / "checkpoint", corpus)
    assert sidecar["attention"] == "parallax" and sidecar["seq_len"] == 16 and sidecar["loss"] == described["loss"]


def test_a_run_nothing_describes_is_refused_naming_the_folder_and_the_flags(runs, capsys):
    """It used to be built as the default config's model (silently wrong, or a shape error)."""
    root, corpus = runs
    step = root / "bare" / "checkpoint" / "step-3"
    with pytest.raises(SystemExit) as e:
        _eval(root / "bare" / "checkpoint", corpus)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert f"nothing describes the model of '{step}'" in err[0] and "-- --job.config_file" in err[0]
    with pytest.raises(CheckpointError, match="has no config.toml or train_args.json"):
        config_and_architecture([], step)
    # the training flags after `--` describe it
    flags = ["--job.config_file", str(root / "config" / "config.toml")]
    assert _eval(root / "bare", corpus, "--", *flags)["attention"] == "parallax"


def test_a_truncated_shard_is_one_line_naming_the_step_folder(runs, tmp_path, capsys):
    """It was a 51-line traceback ending in EOFError that never named the path."""
    root, corpus = runs
    run = tmp_path / "run"
    shutil.copytree(root / "sidecar", run)
    step = run / "checkpoint" / "step-3"
    shard = step / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    with pytest.raises(SystemExit) as e:
        _eval(run, corpus)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert f"{step}: corrupt or truncated checkpoint shard (__0_0.distcp has {size // 2} of " in err[0]
    assert export_hf.main([str(step), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{step}: corrupt or truncated checkpoint shard" in err[0]
    with pytest.raises(CheckpointError, match="corrupt or truncated checkpoint shard"):
        load_dcp_state(step)


def test_generating_past_the_trained_context_warns_once(runs, capsys):
    root, _ = runs
    argv = [str(root / "sidecar"), "--prompt", "5 17 3", "--tokenizer", "ids", "--greedy", "--device", "cpu"]
    assert generate.main([*argv, "--max-new-tokens", "13"]) == 0  # 3 + 13 = 16 = training.seq_len
    assert capsys.readouterr().err == ""
    assert generate.main([*argv, "--max-new-tokens", "20"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "generate: warning: the prompt (3 tokens) + --max-new-tokens 20 = 23 tokens goes past " \
                             "the trained context of 16 tokens" in err[0]


@pytest.fixture
def exports(tmp_path):
    """A Parallax export (this project's remote code) and a softmax one (plain Qwen3, no remote code), each with the
    tokenizer lm-eval needs."""
    from attnlab import attention
    from attnlab.models.args import ModelArgs
    from attnlab.checkpoint.dcp import build_model as build

    out = {}
    for mech in ("parallax", "softmax"):
        opts = {mech: attention.get_mechanism(mech).options()}
        args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, hidden_dim=64, vocab_size=64,
                         max_seq_len=32, attention=mech, attention_options=opts)
        save_hf(build(args).state_dict(), args, tmp_path / mech, tokenizer_dir=make_corpus(tmp_path / "c")["tokenizer"])
        out[mech] = tmp_path / mech
    return out


def _edit_json(path, **kw):
    path.write_text(json.dumps({**(json.loads(path.read_text()) if path.is_file() else {}), **kw}))


def test_remote_code_is_trusted_only_for_our_exports_or_with_the_flag(exports):
    """Every HF folder used to go to lm-eval with trust_remote_code=True: any auto_map module ran."""
    ours, plain = exports["parallax"], exports["softmax"]
    assert eval_downstream.trust_remote_code(ours, False) is True
    assert eval_downstream.trust_remote_code(plain, False) is False  # no remote code: nothing to trust
    (ours / "modeling_attnlab.py").write_text((ours / "modeling_attnlab.py").read_text() + "import os\n")
    with pytest.raises(CheckpointError, match=r"auto_map runs its own code \(configuration_attnlab, "
                                              r"modeling_attnlab\), .*pass --trust-remote-code"):
        eval_downstream.trust_remote_code(ours, False)
    assert eval_downstream.trust_remote_code(ours, True) is True
    (plain / "modeling_mine.py").write_text("print('ran')\n")
    _edit_json(plain / "config.json", auto_map={"AutoModelForCausalLM": "modeling_mine.Model"})
    with pytest.raises(CheckpointError, match=r"\(modeling_mine\)"):
        eval_downstream.trust_remote_code(plain, False)
    _edit_json(plain / "config.json", auto_map={}, model_type="attnlab")  # a tokenizer's auto_map runs code too
    _edit_json(plain / "tokenizer_config.json", auto_map={"AutoTokenizer": ["tokenization_mine.Tok", None]})
    with pytest.raises(CheckpointError, match=r"\(tokenization_mine\)"):
        eval_downstream.trust_remote_code(plain, False)


@pytest.mark.slow  # CI time: 20-30 s on 2 cores
def test_eval_downstream_refuses_foreign_remote_code_before_evaluating(exports, monkeypatch, capsys):
    lm_eval = pytest.importorskip("lm_eval")
    calls = []
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: calls.append(kw["model_args"]) or {"results": {}})
    ours = exports["parallax"]
    assert eval_downstream.main([str(ours), "--tasks", "x", "--device", "cpu"]) == {"results": {}}
    assert calls[-1]["trust_remote_code"] is True
    (ours / "modeling_attnlab.py").write_text("import os\n")
    assert eval_downstream.main([str(ours), "--tasks", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(calls) == 1 and len(err) == 1 and "--trust-remote-code" in err[0]
    eval_downstream.main([str(ours), "--tasks", "x", "--device", "cpu", "--trust-remote-code"])
    assert calls[-1]["trust_remote_code"] is True
