"""softmax → Parallax conversion with W_R = 0: trained checkpoint → exact same loss → fine-tune; refusals write nothing."""

import dataclasses
import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab import configs
from attnlab.attention.parallax import ParallaxOptions
from attnlab.models.args import FLAVORS
from attnlab.checkpoint.dcp import build_model, load_dcp_state
from attnlab.checkpoint.load import load_checkpoint
from attnlab.tools import convert_to_parallax as conv
from attnlab.tools import export_hf
from tests.utils import make_corpus, run_train, tiny_args


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny softmax model trained 20 steps by the real trainer (DCP step folder) and its corpus."""
    root = tmp_path_factory.mktemp("conv")
    corpus = make_corpus(root / "corpus")
    run_train(tiny_args(corpus, root / "run", 20, 16, 2, "--checkpoint.interval", "20"))
    return root, corpus, root / "run" / "checkpoint" / "step-20"


def _batch(corpus, n: int = 3) -> torch.Tensor:
    """[n, 17] token ids of the first ``n`` training documents (BOS, 15 words, EOS): the trainer's first rows of 16
    inputs and 16 labels, one document each."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(corpus["tokenizer"]) / "tokenizer.json"))
    lines = Path(corpus["train"]).read_text().splitlines()[:n]
    return torch.tensor([[0] + tok.encode(json.loads(line)["text"]).ids + [1] for line in lines])


def _loss(args, sd, tokens, impl):
    model = build_model(dataclasses.replace(args, attn_impl=impl), sd)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _convert(*argv) -> int:
    """The tool's exit status: what main returns, or 2 from a bad argument (argparse's one line)."""
    try:
        return conv.main([*map(str, argv), "--no-progress"])
    except SystemExit as e:
        return e.code


def _finetune_flags(capsys) -> list[str]:
    """The trainer's flags of the fine-tune command the converter printed (after ``python -m attnlab.train``)."""
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fine-tune: "))
    argv = shlex.split(line.removeprefix("fine-tune: "))
    assert argv[:3] == ["python", "-m", "attnlab.train"], line
    return argv[3:]


def _check_finetune_command(flags, dst, tokenizer):
    """The printed command as the trainer takes it: it parses, passes the trainer's preflight, and builds exactly the
    converted architecture (what the step folder's attnlab.json records) with the run's tokenizer."""
    from attnlab.config import parse_config
    from attnlab.checkpoint.dcp import model_args_from_config
    from attnlab.checkpoint.dcp import args_to_dict, read_sidecar
    from attnlab.train import preflight
    from attnlab.checkpoint.dcp import architecture_changes

    cfg = parse_config(flags)
    preflight(cfg)
    assert cfg.job.config_file == str(configs.path("convert_finetune_parallax"))  # the shipped config, by name
    assert cfg.checkpoint.initial_load_path == str(dst) and cfg.model.hf_assets_path == str(tokenizer)
    assert architecture_changes(args_to_dict(read_sidecar(dst)), args_to_dict(model_args_from_config(cfg))) == {}
    return cfg


def test_convert_same_loss_then_finetune(trained, capsys, monkeypatch):
    root, corpus, src = trained
    monkeypatch.chdir(root)  # the printed command runs from any folder: it names the shipped config
    dst = root / "converted" / "step-0"  # a new folder under a missing parent, as in the README's command
    assert _convert(src, dst) == 0
    flags = _finetune_flags(capsys)
    cfg = _check_finetune_command(flags, dst, src.parent.parent / "tokenizer")
    assert cfg.model.flavor == "debug" and cfg.model.vocab_size == 64  # not the recipe's 0.6B and 151936
    _, a_sm, sd_sm = load_checkpoint(src)
    _, a_px, sd_px = load_checkpoint(dst)
    assert set(a_px.layer_mechanisms()) == {"parallax"} and a_px.vocab_size == 64
    gain = ParallaxOptions().rho_norm_init  # the conversion's default gain is the module's
    assert a_px.attention_options["parallax"].rho_norm_init == gain
    for i in range(a_px.n_layers):
        assert torch.count_nonzero(sd_px[f"layers.{i}.attention.wr.weight"]) == 0
        assert torch.equal(sd_px[f"layers.{i}.attention.r_norm.weight"], torch.full((32,), gain))
    tokens = _batch(corpus)
    # the same kernel on both sides: bit-identical (ρ = RMSNorm(0) = 0 makes Parallax's weights p·(1 + 0 − 0) = p)
    assert torch.equal(_loss(a_sm, sd_sm, tokens, "reference"), _loss(a_px, sd_px, tokens, "reference"))
    # default paths (SDPA for softmax, the Parallax reference on CPU): equal to float32 rounding
    torch.testing.assert_close(_loss(a_sm, sd_sm, tokens, "auto"), _loss(a_px, sd_px, tokens, "auto"), rtol=0, atol=1e-6)

    # the printed command, run as printed from the user's folder, on this CPU: the source run's data, sizes and
    # precision (not the recipe's c4, seq 4096, batch 480, bf16, compile, selective AC), its own dump folder. The
    # only flag added stops it after step 2 as a preemption would (the schedule stays the recipe's 2000 steps).
    assert (cfg.training.dataset_path, cfg.training.seq_len, cfg.training.local_batch_size) == (corpus["train"], 16, 2)
    assert (cfg.training.mixed_precision_param, cfg.compile.enable, cfg.activation_checkpoint.mode) == \
        ("float32", False, "none")
    assert cfg.job.dump_folder == f"{dst}-finetune"
    # a second conversion of the same run gets a folder of its own and never resumes the first one's fine-tune
    dst2 = root / "converted" / "step-0-again"
    assert _convert(src, dst2) == 0
    flags2 = _finetune_flags(capsys)
    rows = _batch(corpus, 2)  # the first batch: the first two documents
    converted = _loss(a_px, sd_px, rows, "auto").item()
    for printed, ckpt in ((flags, dst), (flags2, dst2)):
        proc = run_train([*printed, "--training.stop_after_step", "2"], cwd=str(root))
        log = proc.stdout + proc.stderr
        assert "Training starts at step 1" in log and f"Loading the checkpoint from {ckpt}." in log, log[-3000:]
        ft = Path(printed[printed.index("--job.dump_folder") + 1])
        # it started from the converted weights, not from a fresh init nor another run: its step-1 loss is the
        # converted model's loss on its first batch, which differs from a fresh model's
        first = json.loads((ft / "metrics.jsonl").read_text().splitlines()[0])
        assert first["step"] == 1 and abs(first["loss"] - converted) < 1e-4, (first, converted)
        sd_ft = load_dcp_state(ft / "checkpoint" / "step-2")
        assert all(torch.count_nonzero(sd_ft[f"layers.{i}.attention.wr.weight"]) > 0 for i in range(a_px.n_layers))
    assert Path(flags2[flags2.index("--job.dump_folder") + 1]) == Path(f"{dst2}-finetune")
    fresh = build_model(a_px, None)
    assert abs(_loss(a_px, fresh.state_dict(), rows, "auto").item() - converted) > 0.1


def test_top_half_with_gate_and_hf_source(trained, capsys, monkeypatch):
    root, corpus, src = trained
    monkeypatch.chdir(root)  # the printed command runs from any folder: it names the shipped config
    tokens = _batch(corpus)
    dst = root / "top"
    assert _convert(src, dst, "--top-half", "--rho-gate", "--gate-bias", "1.5", "--no-rope-on-rho",
                    "--rho-norm-init", "1") == 0
    # the printed fine-tune command carries the layer pattern, rho_gate and rope_on_rho of this conversion
    cfg = _check_finetune_command(_finetune_flags(capsys), dst, src.parent.parent / "tokenizer")
    assert cfg.model.layer_pattern == ["softmax", "softmax", "parallax", "parallax"]
    assert (cfg.attention.parallax.rho_gate, cfg.attention.parallax.rope_on_rho) == (True, False)
    _, a_sm, sd_sm = load_checkpoint(src)
    _, a, sd = load_checkpoint(dst)
    assert a.layer_mechanisms() == ["softmax", "softmax", "parallax", "parallax"]
    o = a.attention_options["parallax"]
    assert (o.rho_gate, o.rho_gate_bias, o.rope_on_rho, o.rho_norm_init) == (True, 1.5, False, 1.0)
    assert torch.equal(sd["layers.3.attention.r_gate.bias"], torch.full((4,), 1.5))
    assert torch.equal(sd["layers.2.attention.r_norm.weight"], torch.ones(32))  # the gain; ρ is still 0
    assert "layers.1.attention.wr.weight" not in sd
    assert torch.equal(_loss(a_sm, sd_sm, tokens, "reference"), _loss(a, sd, tokens, "reference"))

    # HF Qwen3 folder in → HF folder out (with the tokenizer files), same logits as transformers' Qwen3
    hf = root / "hf"
    assert export_hf.main([str(src), str(hf), "--tokenizer", corpus["tokenizer"]]) == 0
    hf_px = root / "hf_px"
    assert _convert(hf, hf_px, "--layers", "1,3") == 0
    assert (hf_px / "tokenizer.json").is_file()
    fmt, a2, sd2 = load_checkpoint(hf_px)
    assert fmt == "hf" and a2.layer_mechanisms() == ["softmax", "parallax", "softmax", "parallax"]
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(build_model(a2, sd2)(tokens), ref(tokens).logits, rtol=1e-5, atol=1e-5)


def _fails(capsys, *argv, match: str, dst: Path):
    assert _convert(*argv, dst) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1, err  # one clear line
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}.*"))  # nothing written, no temp left


def test_bad_inputs_fail_clearly_and_write_nothing(trained, tmp_path, capsys, monkeypatch):
    root, corpus, src = trained
    # corrupt DCP: truncated data file
    bad = tmp_path / "corrupt"
    shutil.copytree(src, bad)
    data = next(bad.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])
    _fails(capsys, bad, match="corrupt", dst=tmp_path / "o1")
    # not a checkpoint at all
    (tmp_path / "empty").mkdir()
    _fails(capsys, tmp_path / "empty", match="not a checkpoint folder", dst=tmp_path / "o2")
    # already Parallax: nothing to convert
    px = tmp_path / "px"
    assert _convert(src, px) == 0
    _fails(capsys, px, match="not softmax attention", dst=tmp_path / "o3")
    # layer range outside the model, existing destination
    _fails(capsys, src, "--layers", "2-9", match="outside 0-3", dst=tmp_path / "o4")
    _fails(capsys, src, "--rho-norm-init", "-1", match="argument --rho-norm-init: '-1': must be a number >= 0",
           dst=tmp_path / "o6")
    assert _convert(src, px) == 2 and "already exists" in capsys.readouterr().err
    # HF: unsupported architecture, tensors that do not fit config.json, corrupt safetensors
    hf = tmp_path / "hf"
    assert export_hf.main([str(src), str(hf)]) == 0
    capsys.readouterr()
    cfg = json.loads((hf / "config.json").read_text())
    cfg.pop("attnlab")  # as a Qwen3 folder from elsewhere
    for name, change, match in [("llama", {"model_type": "llama"}, "only Qwen3"),
                                ("mismatch", {"num_attention_heads": 8},
                                 "config.json num_attention_heads=8 disagrees with the weights")]:
        d = tmp_path / name
        shutil.copytree(hf, d)
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        _fails(capsys, d, match=match, dst=tmp_path / f"o_{name}")
    d = tmp_path / "badst"
    shutil.copytree(hf, d)
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000])
    _fails(capsys, d, match="corrupt or unreadable safetensors", dst=tmp_path / "o5")
    # the logit check: a conversion that changes the function is refused
    from attnlab.checkpoint import convert as convert_module

    real = convert_module.convert_state

    def broken(*a, **k):
        args, sd = real(*a, **k)
        sd["layers.1.attention.wr.weight"] = torch.full_like(sd["layers.1.attention.wr.weight"], 0.1)
        return args, sd

    monkeypatch.setattr(convert_module, "convert_state", broken)
    _fails(capsys, src, match="disagrees with the source", dst=tmp_path / "o6")


def test_a_model_no_flavor_fits_converts_and_says_why_there_is_no_command(tmp_path, capsys):
    """No model.flavor has an RMSNorm eps of 1e-5 and no config key sets it: the conversion is written, and instead of
    a command that would rebuild another model the tool says why there is none."""
    from attnlab.checkpoint.dcp import save_dcp_state
    from tests.checkpoint.test_hf import _args, _model

    args = _args(["softmax"] * 2)
    assert args.norm_eps == 1e-5
    save_dcp_state(_model(args).state_dict(), tmp_path / "step-1", args)
    assert _convert(tmp_path / "step-1", tmp_path / "px") == 0
    out = capsys.readouterr().out.splitlines()
    flavors = ", ".join(f"{n} {a.norm_eps}" for n, a in FLAVORS.items())
    assert out[-1] == ("fine-tune: no train.py command rebuilds this model (no model.flavor has this checkpoint's "
                       f"RMSNorm eps 1e-05; flavors: {flavors})")
    assert (tmp_path / "px" / ".metadata").is_file()
