"""The Hugging Face round trip a user runs: a Qwen3 folder written by transformers (with its tokenizer, or without
one and ``--tokenizer DIR``) is imported as a run (``attnlab.tools.import_hf``), trained a few steps by train.py,
exported (``attnlab.tools.export_hf``) and loaded back by transformers, which gives our logits and tokenizes text as
training does."""

import json
import warnings

import pytest
import torch

from attnlab.checkpoint.dcp import build_model
from attnlab.checkpoint.load import load_checkpoint
from tests.utils import make_corpus, random_qwen3, run_train

transformers = pytest.importorskip("transformers")
pytest.importorskip("tomli_w")
from attnlab.tools import export_hf, import_hf

warnings.filterwarnings("ignore", message=".*torch_dtype.*")

TEXT = "w7 w8 w9 w10 w40 w41 w42"


@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["tokenizer_in_folder", "tokenizer_flag_parallax"])
def test_transformers_qwen3_imports_trains_and_exports_back(tmp_path, with_tokenizer):
    corpus = make_corpus(tmp_path / "corpus")
    hf_in = tmp_path / "qwen3"
    random_qwen3(hf_in, seed=7, jitter=0.05, vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                 bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=0.05)
    source = json.loads((hf_in / "config.json").read_text())
    (hf_in / "config.json").write_text(json.dumps({**source, "max_position_embeddings": 1024}))
    if with_tokenizer:  # the folder carries the tokenizer its weights go with
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (hf_in / name).write_bytes((tmp_path / "corpus" / name).read_bytes())
        extra = []
    else:  # weights only: the tokenizer is named, and the import converts to Parallax (W_R = 0, remote-code export)
        extra = ["--tokenizer", corpus["tokenizer"], "--parallax", "--top-half", "--rho-gate"]
    out = tmp_path / "imported"
    assert import_hf.main([str(hf_in), str(out), *extra]) == 0

    run_train(["--job.config_file", str(out / "config.toml"), "--training.dataset_path", corpus["train"],
               "--validation.no-enable", "--training.seq_len", "16", "--training.local_batch_size", "2",
               "--training.steps", "2", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only",
               "--lr_scheduler.warmup_steps", "0", "--metrics.no-enable-tensorboard"])
    _, args, trained = load_checkpoint(out / "run" / "checkpoint" / "step-2")
    _, _, imported = load_checkpoint(out / "step-0")
    assert not torch.equal(trained["layers.0.attention.wq.weight"], imported["layers.0.attention.wq.weight"])

    hf_out = tmp_path / "exported"
    assert export_hf.main([str(out / "run"), str(hf_out)]) == 0
    # every config.json field transformers reads comes back (the run trained at seq_len 16; the ids are the
    # tokenizer's, <|bos|> 0 and <|eos|> 1), except those naming the format: remote-code class, dtype, version
    source, exported = (json.loads((d / "config.json").read_text()) for d in (hf_in, hf_out))
    naming = {"dtype", "transformers_version"} | (set() if with_tokenizer else {"model_type", "architectures"})
    assert {k: exported.get(k, "missing") for k in source if k not in naming} == \
        {k: v for k, v in source.items() if k not in naming}
    assert (exported["max_position_embeddings"], exported["bos_token_id"], exported["eos_token_id"]) == (1024, 0, 1)
    # the tokenizer needs no remote code: with trust_remote_code=False (README) AutoTokenizer asks nothing, runs
    # nothing (transformers 5 asks about the model config's remote code otherwise)
    import builtins

    asked = []
    real_input, builtins.input = builtins.input, lambda prompt="": asked.append(prompt) or "n"
    try:
        tok = transformers.AutoTokenizer.from_pretrained(hf_out, trust_remote_code=False)
    finally:
        builtins.input = real_input
    assert asked == []
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32,
                                                              trust_remote_code=not with_tokenizer).eval()
    assert type(model).__name__ == ("Qwen3ForCausalLM" if with_tokenizer else "AttnLabForCausalLM")
    # tokenization: training's (the run's tokenizer through the data path's encode: BOS + text, before the EOS)
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    ids = tok(TEXT)["input_ids"]
    assert ids == HuggingFaceTokenizer(str(out / "run" / "tokenizer")).encode(TEXT, add_bos=True, add_eos=False)
    assert ids[0] == tok.bos_token_id
    with torch.no_grad():
        x = torch.tensor([ids])
        torch.testing.assert_close(model(x).logits, build_model(args, trained)(x), rtol=1e-5, atol=1e-5)
    # transformers' generate stops at the export's EOS: with a head that always predicts <|eos|> (id 1), one new token
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size)
    torch.nn.init.zeros_(head.weight)
    head.bias.data = torch.nn.functional.one_hot(torch.tensor(1), model.config.vocab_size).float() * 10
    model.lm_head = head
    out_ids = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert out_ids[0, len(ids):].tolist() == [1]
