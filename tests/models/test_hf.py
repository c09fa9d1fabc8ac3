"""Hugging Face interop: softmax ⇄ transformers' Qwen3 with equal logits, exact round trips for other mechanisms."""

import json
import warnings

import pytest
import torch

import attention
from models.args import ModelArgs
from models.hf import args_to_dict, build_model, load_checkpoint, save_hf, to_hf
from tests.utils import random_qwen3

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore", message=".*torch_dtype.*")


def _args(pattern, tied=True, **opts):
    mechs = sorted(set(pattern))
    return ModelArgs(dim=64, n_layers=len(pattern), n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                     vocab_size=67, max_seq_len=64, enable_weight_tying=tied, rope_theta=1e4, norm_eps=1e-5,
                     attention=pattern[0], layer_pattern=list(pattern) if len(mechs) > 1 else [],
                     attention_options={m: attention.get_mechanism(m).options(**opts.get(m, {})) for m in mechs})


def _model(args, seed=0):
    torch.manual_seed(seed)
    model = build_model(args)
    with torch.no_grad():  # norms and zero-initialised tensors non-trivial, so a swapped key would show
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_softmax_export_loads_in_transformers_with_equal_logits(tmp_path, tied):
    args = _args(["softmax"] * 3, tied=tied)
    model = _model(args)
    save_hf(model.state_dict(), args, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["tie_word_embeddings"] == tied
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    x = torch.randint(0, 67, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-5, atol=1e-5)
        # and back: the HF folder imports exactly
        _, args2, sd2 = load_checkpoint(tmp_path / "hf")
        torch.testing.assert_close(build_model(args2, sd2)(x), model(x), rtol=0, atol=0)


def test_import_of_transformers_saved_qwen3(tmp_path):
    """A folder written by transformers itself (its names, its config) imports with equal logits."""
    hf = random_qwen3(tmp_path / "q", seed=1, jitter=0.05, vocab_size=71, hidden_size=48, intermediate_size=80,
                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                      tie_word_embeddings=False)
    fmt, args, sd = load_checkpoint(tmp_path / "q")
    assert fmt == "hf" and (args.n_heads, args.n_kv_heads, args.head_dim, args.enable_weight_tying) == (6, 2, 8, False)
    x = torch.randint(0, 71, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(build_model(args, sd)(x), hf(x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern,opts", [
    (["parallax"] * 2, {"parallax": {"rho_gate": True, "rope_on_rho": False}}),
    (["softmax", "parallax", "gdn"], {"softmax": {"window_size": 5}}),
])
def test_round_trip_exact_for_parallax_and_others(tmp_path, pattern, opts):
    args = _args(pattern, tied=False, **opts)
    model = _model(args, seed=3)
    sd = model.state_dict()
    hf_keys = to_hf(sd, args)
    assert "model.layers.1.self_attn.r_proj.weight" in hf_keys and "model.layers.1.self_attn.r_norm.weight" in hf_keys
    save_hf(sd, args, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "attnlab"  # transformers must not load it as a plain Qwen3 and drop r_proj
    with pytest.raises((ValueError, KeyError)):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    fmt, args2, sd2 = load_checkpoint(tmp_path / "hf")
    assert args_to_dict(args2) == args_to_dict(args)
    assert sd2.keys() == sd.keys() and all(torch.equal(sd2[k], sd[k]) for k in sd)
    x = torch.randint(0, 67, (2, 11))
    with torch.no_grad():
        assert torch.equal(build_model(args2, sd2)(x), model(x))


def test_bfloat16_export(tmp_path):
    args = _args(["parallax"])
    sd = _model(args).state_dict()
    save_hf(sd, args, tmp_path / "hf", dtype=torch.bfloat16)
    _, _, sd2 = load_checkpoint(tmp_path / "hf")
    assert all(sd2[k].dtype == torch.bfloat16 and torch.equal(sd2[k], sd[k].bfloat16()) for k in sd)
