"""attnlab/tools/import_hf.py: a transformers Qwen3 folder becomes a run that train.py starts from (optionally Parallax
with W_R = 0), with equal logits."""

import os
import warnings

import pytest
import torch

from attnlab.checkpoint.dcp import build_model
from attnlab.checkpoint.load import load_checkpoint
from tests.utils import make_corpus, random_qwen3, run_train

transformers = pytest.importorskip("transformers")
pytest.importorskip("tomli_w")
from attnlab.tools import import_hf

warnings.filterwarnings("ignore", message=".*torch_dtype.*")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A random Qwen3 with the debug flavor's sizes, saved by transformers with the test tokenizer."""
    root = tmp_path_factory.mktemp("qwen3")
    corpus = make_corpus(root / "corpus")
    hf = random_qwen3(root / "hf", seed=1, jitter=0.05, vocab_size=64, hidden_size=128, intermediate_size=384,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      tie_word_embeddings=True, rope_theta=1e4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "hf" / name).write_bytes((root / "corpus" / name).read_bytes())
    return root, corpus, hf


def test_import_then_train_starts_from_the_weights(qwen3, tmp_path):
    root, corpus, hf = qwen3
    out = tmp_path / "imported"
    assert import_hf.main([str(root / "hf"), str(out)]) == 0
    assert (out / "config.toml").is_file() and (out / "tokenizer" / "tokenizer.json").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "step-0").stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    fmt, args, sd = load_checkpoint(out / "step-0")
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(build_model(args, sd)(x), hf(x).logits, rtol=1e-5, atol=1e-5)
    # the run: lr 0, so the checkpoint it saves after one step holds exactly the imported weights
    run_train(["--job.config_file", str(out / "config.toml"), "--training.dataset_path", corpus["train"],
               "--validation.no-enable", "--training.seq_len", "16", "--training.local_batch_size", "2",
               "--training.steps", "1", "--checkpoint.interval", "1", "--checkpoint.last_save_model_only",
               "--optimizer.lr", "0", "--optimizer.weight_decay", "0", "--lr_scheduler.warmup_steps", "0",
               "--metrics.no-enable-tensorboard"])
    _, args1, sd1 = load_checkpoint(out / "run" / "checkpoint" / "step-1", args)
    assert all(torch.equal(sd1[k], sd[k]) for k in sd)


def test_import_as_parallax_same_logits_and_bad_inputs(qwen3, tmp_path, capsys):
    root, _, hf = qwen3
    out = tmp_path / "px"
    assert import_hf.main([str(root / "hf"), str(out), "--parallax", "--top-half", "--rho-gate"]) == 0
    import tomli

    model = tomli.loads((out / "config.toml").read_text())["model"]
    assert model["layer_pattern"] == ["softmax", "softmax", "parallax", "parallax"]
    fmt, args, sd = load_checkpoint(out / "step-0")
    assert args.layer_mechanisms() == ["softmax", "softmax", "parallax", "parallax"]
    assert args.attention_options["parallax"].rho_gate
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(build_model(args, sd)(x), hf(x).logits, rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # the argument's declared rule: a path where nothing exists yet
        import_hf.main([str(root / "hf"), str(out)])
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err
    assert import_hf.main([str(root / "hf"), str(tmp_path / "o2"), "--rho-gate"]) == 2
    assert "need --parallax" in capsys.readouterr().err
    assert import_hf.main([str(root / "corpus"), str(tmp_path / "o3")]) == 2
    assert "not a Hugging Face folder" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_import_sizes_no_flavor_has(tmp_path):
    """Sizes outside every flavor are written as ``[model]`` dimension overrides (no matching flavor needed);
    import_hf checks that the written config rebuilds exactly this architecture."""
    import tomli as tomllib

    random_qwen3(tmp_path / "hf", seed=2, vocab_size=64, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                 num_attention_heads=6, num_key_value_heads=3, head_dim=16, tie_word_embeddings=True, rope_theta=1e4)
    tok = make_corpus(tmp_path / "corpus")["tokenizer"]  # 63 tokens: fits the 64 embedding rows
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out"), "--tokenizer", tok]) == 0
    model = tomllib.loads((tmp_path / "out" / "config.toml").read_text())["model"]
    assert {k: model[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim")} == dict(
        dim=96, n_layers=3, n_heads=6, n_kv_heads=3, head_dim=16, hidden_dim=200)


def test_a_folder_without_a_fitting_tokenizer_is_refused(tmp_path, capsys):
    """Without a tokenizer the config kept the base's (the embedded 4096-token one beside 64 embedding rows): the
    run failed with a vocabulary error, and an export shipped that tokenizer. Now the import names what to pass."""
    random_qwen3(tmp_path / "hf", seed=3, vocab_size=64, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, rope_theta=1e4)
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer.json; pass --tokenizer DIR" in err  # and how to make one
    assert "attnlab train_tokenizer FILES -o DIR" in err and "attnlab fetch_tokenizer" in err
    from tokenizers import Tokenizer, models

    big = tmp_path / "big"
    big.mkdir()
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0")).save(str(big / "tokenizer.json"))
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "o2"), "--tokenizer", str(big)]) == 2
    assert "100 tokens, more than the model's 64 embedding rows" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_export_refuses_a_tokenizer_larger_than_the_embedding(qwen3, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    from attnlab.tools import export_hf

    root, _, _ = qwen3
    out = tmp_path / "imported"
    assert import_hf.main([str(root / "hf"), str(out)]) == 0
    big = tmp_path / "big"
    big.mkdir()
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0")).save(str(big / "tokenizer.json"))
    capsys.readouterr()
    assert export_hf.main([str(out / "step-0"), str(tmp_path / "hf_out"), "--tokenizer", str(big)]) == 2
    assert "100 tokens, more than the model's 64 embedding rows" in capsys.readouterr().err
    assert not (tmp_path / "hf_out").exists()


def test_a_config_field_that_changes_the_computation_is_one_line_and_writes_nothing(tmp_path, capsys):
    """RoPE scaling in transformers' current layout (rope_parameters) used to import silently, with logits that
    differed from transformers'."""
    random_qwen3(tmp_path / "hf", seed=4, vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                  "rope_theta": 1e4})
    tok = make_corpus(tmp_path / "corpus")["tokenizer"]
    capsys.readouterr()
    assert import_hf.main([str(tmp_path / "hf"), str(tmp_path / "out"), "--tokenizer", tok]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["import_hf: error: config.json rope_parameters: rope_type 'yarn' is not supported (this model has "
                   "the default RoPE, base rope_theta, only)"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", 10 ** 9, "vocab_size=1000000000 disagrees with the weights: model.embed_tokens.weight [64, 128] "
                            "gives 64"),
    ("hidden_size", None, "hidden_size=4096 disagrees with the weights: model.embed_tokens.weight [64, 128] gives 128"),
    ("num_hidden_layers", 8, "num_hidden_layers=8 disagrees with the weights: the tensors of layers 0-3 gives 4"),
    ("num_hidden_layers", 2, "num_hidden_layers=2 disagrees with the weights: the tensors of layers 0-3 gives 4"),
    ("intermediate_size", 512, "intermediate_size=512 disagrees with the weights: model.layers.0.mlp.gate_proj.weight "
                               "[384, 128] gives 384"),
    ("num_key_value_heads", 4, "num_key_value_heads=4 disagrees with the weights: model.layers.0.self_attn.k_proj."
                               "weight [64, 128] with head_dim 32 gives 2"),
], ids=["vocab_1e9", "hidden_size_missing", "layers_8_of_4", "layers_2_of_4", "intermediate", "kv_heads"])
def test_a_config_json_that_disagrees_with_the_weights_is_refused_naming_the_field(qwen3, tmp_path, capsys, field,
                                                                                    value, message):
    """Every size comes from the tensors: config.json's vocab_size 10^9 imported (training then tried to allocate
    512 GB), a missing hidden_size became transformers' 4096 beside 128-wide weights, num_hidden_layers 8 over 4
    layers of weights imported."""
    import json
    import shutil

    root, _, _ = qwen3
    hf = tmp_path / "hf"
    shutil.copytree(root / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.pop("layer_types")  # as the hub's Qwen3 config.json files: transformers derives it from num_hidden_layers
    if value is None:
        del cfg[field]
    else:
        cfg[field] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert import_hf.main([str(hf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"import_hf: error: {hf}/config.json {message}"  # after the read bar
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_the_embedded_corpus_log_does_not_claim_an_imported_run_trains_its_tokenizer(tmp_path, monkeypatch, caplog):
    """An imported run on the embedded corpus logged "training a BPE tokenizer (vocab 4096)" though it trains with
    its own tokenizer: the log now says whose tokenizer that is."""
    import logging

    from attnlab.data import embedded

    monkeypatch.setattr(embedded, "_documents", lambda: [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)])
    with caplog.at_level(logging.INFO):
        embedded.build_embedded(str(tmp_path), 300)
    text = " ".join(r.getMessage() for r in caplog.records if "Embedded corpus" in r.getMessage())
    assert "training a BPE tokenizer" not in text
    assert 'the one runs with model.hf_assets_path = "embedded" use; a run with a tokenizer of its own trains with' \
           " its own" in text
