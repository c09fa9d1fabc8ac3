"""Hugging Face interop: softmax ⇄ transformers' Qwen3 with equal logits, exact round trips for other mechanisms;
config.json read and written through transformers' config classes (every layout, unsupported fields refused);
exported tokenizers encode as training does."""

import dataclasses
import json
import shutil
import warnings

import pytest
import torch

from attnlab import attention
from attnlab.models.args import ModelArgs
from attnlab.checkpoint.dcp import args_to_dict, build_model, CheckpointError
from attnlab.checkpoint.hf import save_hf, to_hf
from attnlab.checkpoint.load import load_checkpoint
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


# ------------------------------------------------------------------------------ config.json through transformers

SIZES = dict(vocab_size=71, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)


def _legacy_layout(folder):
    """Rewrite ``folder``'s config.json into the layout transformers 4.x wrote (and hub checkpoints such as
    Qwen/Qwen3-0.6B still carry): ``rope_theta`` and ``rope_scaling`` (null, or the scaling with ``type`` and
    ``rope_type``) at the top level instead of transformers 5's ``rope_parameters``."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else {**rope, "type": rope["rope_type"]}
    path.write_text(json.dumps(cfg))


ROPES = {"default": None,
         "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
         "linear": {"rope_type": "linear", "factor": 2.0},
         "dynamic": {"rope_type": "dynamic", "factor": 2.0}}


@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_qwen3_config_in_both_rope_layouts(tmp_path, layout, rope):
    """Folders transformers writes (5.x: ``rope_parameters``; 4.x: ``rope_theta`` + ``rope_scaling``): the default
    RoPE at a non-default base imports with transformers' logits; any RoPE scaling is refused naming the key the
    file uses (the newer layout used to import silently and differ from transformers' logits)."""
    params = {"rope_theta": 100.0, **(ROPES[rope] or {"rope_type": "default"})}
    random_qwen3(tmp_path / "q", seed=4, jitter=0.05, rope_parameters=params, **SIZES)
    if layout == "rope_scaling":
        _legacy_layout(tmp_path / "q")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).eval()
    assert {k: v for k, v in hf.config.rope_parameters.items() if k != "type"} == params  # as transformers reads it
    if rope != "default":
        with pytest.raises(CheckpointError, match=rf"^config.json {layout}: rope_type '{rope}' is not supported"):
            load_checkpoint(tmp_path / "q")
        return
    _, args, sd = load_checkpoint(tmp_path / "q")
    assert args.rope_theta == 100.0
    x = torch.randint(0, 71, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(build_model(args, sd)(x), hf(x).logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3") / "q"
    random_qwen3(folder, seed=5, jitter=0.05, **SIZES)
    return folder


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


@pytest.mark.parametrize("changes,message", [
    ({"hidden_act": "gelu"}, "config.json hidden_act='gelu': not supported"),
    ({"attention_bias": True}, "config.json attention_bias=True: not supported"),
    ({"attention_dropout": 0.1}, "config.json attention_dropout=0.1: not supported"),
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, "layer_types": None},
     "config.json use_sliding_window: layers [1] are 'sliding_attention'"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4, "use_sliding_window": True},
     "config.json layer_types: layers [0] are 'sliding_attention'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "config.json quantization_config: quantized checkpoints"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "config.json: transformers cannot read it"),
    ({"model_type": "llama"}, "config.json model_type='llama': only Qwen3"),
])
def test_fields_that_change_the_computation_are_refused_naming_the_key(qwen3_folder, tmp_path, changes, message):
    with pytest.raises(CheckpointError, match="^" + message.replace("[", r"\[").replace("]", r"\]")) as e:
        load_checkpoint(_edited(qwen3_folder, tmp_path / "q", **changes))
    assert "\n" not in str(e.value)


def test_fields_that_do_not_change_the_computation_import(qwen3_folder, tmp_path):
    """Sliding-window settings that leave every layer full attention (as transformers derives layer_types), token
    ids, init range and extra keys transformers' Qwen3 does not read: imported, transformers' logits."""
    q = _edited(qwen3_folder, tmp_path / "q", use_sliding_window=True, sliding_window=4, max_window_layers=28,
                layer_types=None, bos_token_id=1, eos_token_id=[2, 3], initializer_range=0.5, some_future_key=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(q, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["full_attention"] * 2
    _, args, sd = load_checkpoint(q)
    x = torch.randint(0, 71, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(build_model(args, sd)(x), hf(x).logits, rtol=1e-5, atol=1e-5)


def test_a_qwen3_field_this_importer_does_not_know_is_refused_when_set(qwen3_folder, tmp_path, monkeypatch):
    """A field a newer transformers adds to Qwen3Config arrives through the library's field list: set away from its
    default it is refused by name (here initializer_range stands in for such a field)."""
    from attnlab.checkpoint import hf as hf_module

    q = _edited(qwen3_folder, tmp_path / "q", initializer_range=0.5)
    monkeypatch.setattr(hf_module, "QWEN3_INERT", tuple(k for k in hf_module.QWEN3_INERT if k != "initializer_range"))
    with pytest.raises(CheckpointError, match="^config.json initializer_range=0.5: a Qwen3 setting this importer "
                                              "does not know"):
        load_checkpoint(q)
    load_checkpoint(_edited(qwen3_folder, tmp_path / "q2"))  # at the default it is accepted


@pytest.mark.parametrize("pattern", [["softmax"] * 2, ["parallax"] * 2])
def test_export_config_is_written_by_transformers(tmp_path, pattern):
    """config.json comes from transformers' config classes (Qwen3Config, or the remote-code AttnLabConfig with the
    same values): the RoPE in the installed library's layout (rope_parameters); a Qwen3 folder carries every field
    the library's Qwen3Config adds, an attnlab folder the sizes tools such as lm-eval read."""
    args = _args(pattern)
    save_hf(_model(args).state_dict(), args, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e4} and "rope_theta" not in cfg
    assert cfg["max_position_embeddings"] == 64 and cfg["num_hidden_layers"] == 2
    if pattern[0] == "parallax":
        assert cfg["model_type"] == "attnlab" and cfg["attnlab"] == args_to_dict(args)
        return
    assert cfg["model_type"] == "qwen3"
    qwen3_fields = set(transformers.Qwen3Config().to_dict()) - set(transformers.PretrainedConfig().to_dict())
    assert qwen3_fields <= set(cfg), qwen3_fields - set(cfg)


# ------------------------------------------------------------------------------------- exported tokenizers

def _training_stream(tokenizer_dir, text: str, copies: int = 3) -> list[int]:
    """The token stream the training data path packs from ``copies`` documents of ``text``: the tokenizer
    data.loader.build_tokenizer builds for ``model.hf_assets_path = tokenizer_dir`` and the packed rows of
    data.loader.PackedTextDataset (each row's inputs, plus its last label), concatenated."""
    from datasets import Dataset

    from attnlab.config import parse_config
    from attnlab.data.loader import PackedTextDataset, build_tokenizer

    tok = build_tokenizer(parse_config(["--model.hf_assets_path", str(tokenizer_dir)]))
    ds = PackedTextDataset(Dataset.from_dict({"text": [text] * copies}), "text", "t", tok, seq_len=2, dp_rank=0,
                           dp_world_size=1, infinite=False)
    return [t for batch, labels in ds for t in batch["input"].tolist() + labels[-1:].tolist()]


def _tokenizers(root):
    """{kind: tokenizer folder}: the tiny word-level one of the tests (BOS/EOS in tokenizer_config.json), a byte-level
    BPE as attnlab/tools/train_tokenizer.py and the embedded default train, and one without a BOS (as Qwen3's)."""
    from attnlab.data.embedded import train_bpe
    from tests.utils import make_corpus

    word = make_corpus(root / "word")["tokenizer"]
    texts = ["The quick brown fox jumps over the lazy dog.", "Packed documents, spaces  and\nnew lines."] * 20
    bpe = train_bpe(texts, 300, root / "bpe", show_progress=False)
    no_bos = shutil.copytree(bpe, root / "no_bos")
    (no_bos / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|eos|>"}))
    return {"word": word, "bpe": bpe, "no_bos": no_bos}


TEXTS = {"word": "w3 w4 w5 w59 w0", "bpe": "The lazy fox,  spaces\nand new lines.", "no_bos": "The quick dog."}


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_exported_tokenizer_encodes_as_training_does(tmp_path, kind):
    """transformers' AutoTokenizer of an export gives the ids the training data path gives a document up to its
    closing EOS: BOS first when training prepends one (the exported tokenizer used to add none), nothing when the
    tokenizer has no BOS; the export, imported again for training, packs the same stream (no second BOS)."""
    tok_dir = _tokenizers(tmp_path)[kind]
    args = dataclasses.replace(_args(["softmax"]), vocab_size=320)
    save_hf(_model(args).state_dict(), args, tmp_path / "hf", tokenizer_dir=tok_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = TEXTS[kind]
    ids = hf_tok(text)["input_ids"]
    stream = _training_stream(tok_dir, text)
    eos = hf_tok.convert_tokens_to_ids("<|eos|>")
    assert stream == ((ids + [eos]) * 3)[:len(stream)] and len(stream) >= len(ids) + 1
    assert (ids[0] == hf_tok.convert_tokens_to_ids("<|bos|>")) == (kind != "no_bos")
    assert hf_tok.decode(ids, skip_special_tokens=True) == text
    assert _training_stream(tmp_path / "hf", text) == stream
