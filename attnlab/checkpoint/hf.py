"""Hugging Face folders: the key maps between the model's names and Hugging Face's (:func:`to_hf`,
:func:`from_hf`), config.json written and read (:func:`hf_config`, :func:`args_from_hf_config`), safetensors
folders written and read (:func:`save_hf`, :func:`load_hf_state`), and torchtitan's ``StateDictAdapter`` of the
model (:class:`AttnLabStateDictAdapter`). Tools load either format through :mod:`checkpoint.load`; the DCP side is
:mod:`checkpoint.dcp`, which this module builds on.

A **Hugging Face folder** is ``config.json`` + ``model.safetensors`` (or a sharded index). A model whose every
layer is Qwen3 softmax attention (q/k-norm, no window) is written as a plain ``Qwen3ForCausalLM`` that
``transformers.AutoModelForCausalLM`` loads with equal logits. Any other mechanism keeps the Qwen3 keys and
adds its own under ``self_attn.`` (Parallax: ``r_proj``, ``r_norm``, ``r_gate``); such a folder has
``model_type = "attnlab"`` so transformers never loads it as a Qwen3 (silently dropping weights). Every exported
``config.json`` carries the full architecture under ``"attnlab"`` (import is exact). When every layer is
softmax (any options) or Parallax, the folder also holds a standalone remote-code model
(``attnlab/checkpoint/hf_remote``: configuration + modeling files, ``auto_map`` in config.json), so
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` loads it. config.json is written and read
through transformers' config classes; the tokenizer is saved with transformers and encodes as the training data
path does (:func:`save_hf_tokenizer`).

The Qwen3 key table is torchtitan's :class:`Qwen3StateDictAdapter` ``from_hf_map`` (dense entries).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from attnlab import attention
from attnlab.models.args import ModelArgs
from attnlab.checkpoint.dcp import CheckpointError, args_from_dict, args_to_dict, progress_bar
from attnlab.checkpoint.layout import HF_SOURCE_CONFIG, new_folder

ATTN_PARAM_TO_HF = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "wr": "r_proj"}
"""Attention submodule renames (torchtitan → HF) of the Qwen3-named mechanisms below; the attention parameters
of every other mechanism keep their own names under ``self_attn.``."""
QWEN3_NAMED = ("softmax", "parallax")


def _attn_renames(args: ModelArgs, i: int) -> dict[str, str]:
    return ATTN_PARAM_TO_HF if args.layer_mechanisms()[int(i)] in QWEN3_NAMED else {}


def _qwen3_map() -> dict[str, str]:
    """torchtitan's Qwen3 HF→torchtitan table, dense entries only (``{}`` = layer index)."""
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    table = Qwen3StateDictAdapter(Qwen3ModelArgs(), None).from_hf_map
    return {hf: tt for hf, tt in table.items() if tt is not None and "moe" not in tt}


def to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """torchtitan names → HF names. Attention parameters go under ``self_attn.`` (renamed per
    ``ATTN_PARAM_TO_HF``); a tied head is not written (``tie_word_embeddings``)."""
    fixed = {tt: hf for hf, tt in _qwen3_map().items() if "{}" not in tt}
    layer = {tt: hf for hf, tt in _qwen3_map().items() if "{}" in tt and ".attention." not in tt}
    out = {}
    for k, v in sd.items():
        if k == "output.weight" and args.enable_weight_tying:
            continue
        if k in fixed:
            out[fixed[k]] = v
            continue
        m = re.match(r"layers\.(\d+)\.(.+)$", k)
        if m is None:
            raise CheckpointError(f"no Hugging Face name for parameter {k!r}")
        i, rest = m.groups()
        generic = f"layers.{{}}.{rest}"
        if int(i) >= args.n_layers:
            raise CheckpointError(f"parameter {k!r}: the model has {args.n_layers} layers")
        if generic in layer:
            out[layer[generic].format(i)] = v
        elif rest.startswith("attention."):
            sub, _, tail = rest[len("attention."):].partition(".")
            out[f"model.layers.{i}.self_attn.{_attn_renames(args, i).get(sub, sub)}" + (f".{tail}" if tail else "")] = v
        else:
            raise CheckpointError(f"no Hugging Face name for parameter {k!r}")
    return out


def from_hf(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names → torchtitan names (inverse of :func:`to_hf`); ``rotary_emb.inv_freq`` buffers are dropped."""
    fixed = {hf_: tt for hf_, tt in _qwen3_map().items() if "{}" not in tt}
    layer = {hf_: tt for hf_, tt in _qwen3_map().items() if "{}" in tt and ".attention." not in tt}
    out = {}
    for k, v in hf.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if k in fixed:
            out[fixed[k]] = v
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", k)
        if m is None:
            raise CheckpointError(f"unexpected Hugging Face tensor {k!r}")
        i, rest = m.groups()
        generic = f"model.layers.{{}}.{rest}"
        if int(i) >= args.n_layers:
            raise CheckpointError(f"tensor {k!r}: config.json has {args.n_layers} layers")
        if generic in layer:
            out[layer[generic].format(i)] = v
        elif rest.startswith("self_attn."):
            sub, _, tail = rest[len("self_attn."):].partition(".")
            from_attn = {v: k for k, v in _attn_renames(args, i).items()}
            out[f"layers.{i}.attention.{from_attn.get(sub, sub)}" + (f".{tail}" if tail else "")] = v
        else:
            raise CheckpointError(f"unexpected Hugging Face tensor {k!r}")
    if args.enable_weight_tying:
        out.setdefault("output.weight", out.get("tok_embeddings.weight"))
    return out


def is_plain_qwen3(args: ModelArgs) -> bool:
    """Every layer is softmax attention with q/k-norm and no window: loadable by transformers' Qwen3."""
    if set(args.layer_mechanisms()) != {"softmax"}:
        return False
    o = args.attention_options.get("softmax")
    return o is None or (o.qk_norm and not o.window_size)


REMOTE_CODE_DIR = Path(__file__).parent / "hf_remote"
REMOTE_CODE_FILES = ("configuration_attnlab.py", "modeling_attnlab.py")
REMOTE_CODE_MECHANISMS = ("softmax", "parallax")
"""Mechanisms the standalone remote-code model (``attnlab/checkpoint/hf_remote``) implements."""


def has_remote_code(args: ModelArgs) -> bool:
    """Not a plain Qwen3, and every layer is one the remote-code model implements."""
    return not is_plain_qwen3(args) and set(args.layer_mechanisms()) <= set(REMOTE_CODE_MECHANISMS)


QWEN3_TO_ARGS = {"vocab_size": "vocab_size", "hidden_size": "dim", "intermediate_size": "hidden_dim",
                 "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
                 "rms_norm_eps": "norm_eps", "max_position_embeddings": "max_seq_len",
                 "tie_word_embeddings": "enable_weight_tying"}
"""``Qwen3Config`` fields that are :class:`ModelArgs` fields as they are (``head_dim`` and the RoPE base of
``rope_parameters`` are read with transformers' fallbacks in :func:`args_from_hf_config`)."""

QWEN3_FIXED = {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0}
"""``Qwen3Config`` fields this model has one value of: any other value changes the computation (the activation, a
bias on q/k/v/o, dropout while training), so a config.json with it is refused."""

QWEN3_INERT = ("initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "use_sliding_window",
               "sliding_window", "max_window_layers", "_name_or_path", "architectures", "chunk_size_feed_forward",
               "dtype", "id2label", "label2id", "is_encoder_decoder", "model_type", "output_attentions",
               "output_hidden_states", "problem_type", "return_dict", "transformers_version")
"""``Qwen3Config`` fields that do not change the logits of weights already trained: initialisation, caching, token
ids, output options, storage dtype. The sliding-window fields act only through ``layer_types`` (transformers
derives it from them), which is checked instead."""


HF_KEPT = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
           "use_sliding_window", "sliding_window", "max_window_layers")
"""config.json fields transformers reads that do not follow from the weights: an export keeps them from an imported
model's config.json, which travels beside its tokenizer (``<run>/tokenizer/hf_source_config.json``), so an import →
export round trip keeps them. Otherwise ``max_position_embeddings`` is the training context."""


def hf_metadata(tokenizer_dir) -> dict[str, Any]:
    """The :data:`HF_KEPT` fields of an imported model's config.json beside the tokenizer of ``tokenizer_dir`` (its
    ``hf_source_config.json``, when it has one), then the BOS and EOS ids of its tokenizer as training encodes with
    them (torchtitan's ``HuggingFaceTokenizer``: tokenizer.json + tokenizer_config.json), so transformers'
    ``generate`` stops at the EOS every training document ends with."""
    if tokenizer_dir is None:
        return {}
    folder = Path(tokenizer_dir)
    out: dict[str, Any] = {}
    if (folder / HF_SOURCE_CONFIG).is_file():
        try:
            source = json.loads((folder / HF_SOURCE_CONFIG).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{folder / HF_SOURCE_CONFIG} cannot be read: {e}") from e
        out = {k: source[k] for k in HF_KEPT if k in source}
    if (folder / "tokenizer.json").is_file():
        from torchtitan.components.tokenizer import HuggingFaceTokenizer

        tok = HuggingFaceTokenizer(str(folder))
        out.update({k: v for k, v in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id)) if v is not None})
    return out


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32, metadata: dict[str, Any] | None = None):
    """config.json as a transformers config object (``save_pretrained`` writes it), with the full architecture under
    ``"attnlab"`` (read back exactly by :func:`args_from_hf_config`): a ``Qwen3Config`` for a plain Qwen3 model
    (transformers ignores the extra key); otherwise the remote-code ``AttnLabConfig`` (``model_type = "attnlab"``)
    with the same Qwen3 fields for tools that read them, and ``auto_map`` to the remote-code model when it implements
    every layer. ``metadata``: :data:`HF_KEPT` fields (:func:`hf_metadata`) on top; ``max_position_embeddings`` is
    the larger of theirs and the training context."""
    from transformers import Qwen3Config

    metadata = dict(metadata or {})
    max_len = max(args.max_seq_len, metadata.pop("max_position_embeddings", 0) or 0)
    qwen3 = dict(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
                 num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                 head_dim=args.head_dim, max_position_embeddings=max_len, rms_norm_eps=args.norm_eps,
                 rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                 tie_word_embeddings=args.enable_weight_tying, dtype=dtype, attnlab=args_to_dict(args),
                 **metadata)
    if is_plain_qwen3(args):
        return Qwen3Config(architectures=["Qwen3ForCausalLM"], **qwen3)
    from transformers import PretrainedConfig

    from attnlab.checkpoint.hf_remote.configuration_attnlab import AttnLabConfig

    # every Qwen3 field, as a Qwen3 folder of these sizes has them (activation, bias, layer types, cache, ...)
    full = Qwen3Config(**qwen3).to_dict()
    qwen3.update({k: full[k] for k in set(full) - set(PretrainedConfig().to_dict())})
    cfg = AttnLabConfig(architectures=["AttnLabForCausalLM"], **qwen3)
    for k in set(qwen3) - set(cfg.to_dict()):  # use_cache, which PretrainedConfig takes for a generation option
        setattr(cfg, k, qwen3[k])
    if has_remote_code(args):
        cfg.auto_map = {"AutoConfig": "configuration_attnlab.AttnLabConfig",
                        "AutoModelForCausalLM": "modeling_attnlab.AttnLabForCausalLM"}
    return cfg


def args_from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """The architecture of a config.json (``cfg``, as parsed): an export's ``"attnlab"`` record, or a Qwen3 config read
    by transformers' own ``Qwen3Config`` (its defaults, and both RoPE layouts it reads: ``rope_theta`` +
    ``rope_scaling`` of older files, ``rope_parameters`` of newer ones). Every field that would change the
    computation away from this model's is refused, naming the key: non-default RoPE types (yarn, linear, dynamic,
    …), sliding-window layers, another activation, attention bias or dropout, quantization, and any ``Qwen3Config``
    field not classified here (:data:`QWEN3_TO_ARGS`, :data:`QWEN3_FIXED`, :data:`QWEN3_INERT`) that is set away
    from its default, as new library versions may add."""
    if "attnlab" in cfg:
        return args_from_dict(cfg["attnlab"])
    if cfg.get("model_type") != "qwen3":
        raise CheckpointError(f"config.json model_type={cfg.get('model_type')!r}: only Qwen3 (dense) Hugging Face "
                              "checkpoints and folders exported by attnlab/tools/export_hf.py are supported")
    from transformers import Qwen3Config

    if cfg.get("quantization_config") is not None:
        raise CheckpointError("config.json quantization_config: quantized checkpoints are not supported; use the "
                              "unquantized weights")
    try:
        qc = Qwen3Config.from_dict(cfg)
    except Exception as e:  # transformers' validation: missing RoPE keys, wrong types
        raise CheckpointError(f"config.json: transformers cannot read it ({' '.join(str(e).split())})") from e
    rope = qc.rope_parameters
    if rope.get("rope_type", "default") != "default":
        key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        raise CheckpointError(f"config.json {key}: rope_type {rope['rope_type']!r} is not supported (this model has "
                              "the default RoPE, base rope_theta, only)")
    for key, value in QWEN3_FIXED.items():
        if getattr(qc, key) != value:
            raise CheckpointError(f"config.json {key}={getattr(qc, key)!r}: not supported (this model has {value!r})")
    sliding = [i for i, t in enumerate(qc.layer_types) if t != "full_attention"]
    if sliding:
        key = "layer_types" if cfg.get("layer_types") is not None else "use_sliding_window"
        raise CheckpointError(f"config.json {key}: layers {sliding} are {qc.layer_types[sliding[0]]!r}, which this "
                              "model lacks (full attention only)")
    default = Qwen3Config()
    known = set(QWEN3_TO_ARGS) | set(QWEN3_FIXED) | set(QWEN3_INERT) | {"head_dim", "rope_parameters", "layer_types"}
    unknown = [k for k in default.to_dict() if k not in known and getattr(qc, k) != getattr(default, k)]
    if unknown:
        raise CheckpointError(f"config.json {unknown[0]}={getattr(qc, unknown[0])!r}: a Qwen3 setting this importer "
                              "does not know, which may change the computation; not supported")
    return ModelArgs(**{a: getattr(qc, k) for k, a in QWEN3_TO_ARGS.items()},
                     head_dim=qc.head_dim or qc.hidden_size // qc.num_attention_heads,  # transformers' fallback
                     rope_theta=float(rope["rope_theta"]), attention="softmax",
                     attention_options={"softmax": attention.get_mechanism("softmax").options()})


def check_config_fits_weights(args: ModelArgs, hf: dict[str, torch.Tensor]) -> None:
    """Every size config.json gives (``args``, as read from it) against the Hugging Face tensors ``hf`` it
    describes: the vocabulary and width of ``embed_tokens``, the number of ``model.layers.<i>``, the MLP width of
    ``gate_proj``, and the heads of ``q_proj``/``k_proj``/``q_norm`` where the layers have them. A config.json that
    disagrees (a vocabulary of 10^9 beside 64 rows, a missing ``hidden_size`` read as transformers' default 4096, 8
    layers over 4 layers of weights) would import and fail later, or allocate the wrong model: a CheckpointError
    naming the field and both values."""
    def refuse(field, value, actual, where):
        raise CheckpointError(f"config.json {field}={value!r} disagrees with the weights: {where} gives {actual}")

    emb = hf.get("model.embed_tokens.weight")
    if emb is None:
        raise CheckpointError("no model.embed_tokens.weight among the safetensors tensors: not a Qwen3-style model")
    if emb.shape[0] != args.vocab_size:
        refuse("vocab_size", args.vocab_size, emb.shape[0], f"model.embed_tokens.weight {list(emb.shape)}")
    if emb.shape[1] != args.dim:
        refuse("hidden_size", args.dim, emb.shape[1], f"model.embed_tokens.weight {list(emb.shape)}")
    layers = {int(m.group(1)) for k in hf if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if layers != set(range(args.n_layers)):
        refuse("num_hidden_layers", args.n_layers, len(layers), f"the tensors of layers {min(layers, default=0)}-"
               f"{max(layers, default=-1)}" if layers else "no model.layers.* tensor")
    shapes = {k.removeprefix("model.layers.0."): v.shape for k, v in hf.items() if k.startswith("model.layers.0.")}
    checks = [("intermediate_size", args.hidden_dim, "mlp.gate_proj.weight", 0, 1)]
    if args.layer_mechanisms()[0] in QWEN3_NAMED:
        checks += [("head_dim", args.head_dim, "self_attn.q_norm.weight", 0, 1),
                   ("num_attention_heads", args.n_heads, "self_attn.q_proj.weight", 0, args.head_dim),
                   ("num_key_value_heads", args.n_kv_heads, "self_attn.k_proj.weight", 0, args.head_dim)]
    for field, value, name, dim, per in checks:
        if name in shapes and shapes[name][dim] != value * per:
            actual = shapes[name][dim] / per
            refuse(field, value, int(actual) if actual == int(actual) else actual,
                   f"model.layers.0.{name} {list(shapes[name])}" + (f" with head_dim {per}" if per != 1 else ""))


def load_hf_state(folder, progress: bool = False,
                  args: ModelArgs | None = None) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(architecture, torchtitan-named state dict) of a Hugging Face folder; the architecture is ``args`` when
    given (a trainer's ``last_save_in_hf`` step folder has safetensors but no config.json), else config.json's."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    from_config = args is None
    if from_config:
        try:
            cfg = json.loads((folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{folder}/config.json cannot be read: {e}") from e
        args = args_from_hf_config(cfg)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else sorted(p.name for p in folder.glob("*.safetensors"))
    hf = {}
    for name in progress_bar(files, "read", progress):
        try:
            hf.update(load_file(str(folder / name)))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{folder / name}: corrupt or unreadable safetensors file ({e})") from e
    if from_config:
        try:
            check_config_fits_weights(args, hf)
        except CheckpointError as e:
            raise CheckpointError(f"{folder}/{e}") from None
    return args, from_hf(hf, args)


def save_hf_tokenizer(src, dst) -> None:
    """Write the tokenizer of folder ``src`` (tokenizer.json [+ tokenizer_config.json], as ``model.hf_assets_path``
    names) into ``dst`` with transformers' ``PreTrainedTokenizerFast.save_pretrained``, encoding as the training data
    path does.

    The tokenizer saved is the one training builds (torchtitan's ``HuggingFaceTokenizer``, as
    :func:`data.loader.build_tokenizer`: tokenizer.json plus the special tokens of tokenizer_config.json). Training
    encodes every document as BOS + text + EOS, adding the BOS (when the config names one) unless the tokenizer's own
    post-processor already does; the saved tokenizer then gets a post-processor that prepends it, so
    ``AutoTokenizer.from_pretrained(dst)(text).input_ids`` are a training document's ids up to its closing EOS (a
    prompt is an unfinished document; lm-eval's contexts start as training rows do). ``generation_config.json`` is
    copied when ``src`` has one."""
    from tokenizers import processors
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from transformers import PreTrainedTokenizerFast

    src, dst = Path(src), Path(dst)
    trained = HuggingFaceTokenizer(str(src))
    tok = trained.tokenizer
    if trained.bos_id is not None and not trained.hf_adds_bos:
        bos = trained.bos_token
        prepend = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                                special_tokens=[(bos, trained.bos_id)])
        tok.post_processor = prepend if tok.post_processor is None else processors.Sequence([tok.post_processor,
                                                                                              prepend])
    PreTrainedTokenizerFast.from_pretrained(str(src), tokenizer_object=tok).save_pretrained(str(dst))
    if (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", dst / "generation_config.json")


def save_hf(sd: dict[str, torch.Tensor], args: ModelArgs, folder, dtype: torch.dtype = torch.float32,
            tokenizer_dir=None, progress: bool = False) -> None:
    """Write ``config.json`` (:func:`hf_config`, with the token ids and kept fields of ``tokenizer_dir``,
    :func:`hf_metadata`) + ``model.safetensors`` (+ the tokenizer of ``tokenizer_dir`` when it has a tokenizer.json,
    :func:`save_hf_tokenizer`) atomically into ``folder``, with ordinary permissions."""
    from safetensors.torch import save_file

    hf = {k: v.detach().to(dtype).contiguous().clone()
          for k, v in progress_bar(to_hf(sd, args).items(), "convert", progress)}
    with new_folder(folder) as tmp:
        save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_config(args, dtype, hf_metadata(tokenizer_dir)).save_pretrained(str(tmp))
        if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
            save_hf_tokenizer(tokenizer_dir, tmp)
        if has_remote_code(args):
            for name in REMOTE_CODE_FILES:
                shutil.copyfile(REMOTE_CODE_DIR / name, tmp / name)


# ----------------------------------------------------------------------------- torchtitan's adapter path

class AttnLabStateDictAdapter(StateDictAdapter):
    """torchtitan ``StateDictAdapter`` of the project's model (``TrainSpec.state_dict_adapter``): what
    ``--checkpoint.last_save_in_hf`` and ``--checkpoint.initial_load_in_hf`` use, for every mechanism, with the
    key maps of :func:`to_hf` / :func:`from_hf`.

    ``fqn_to_index_mapping`` (which shard each HF tensor goes to) is torchtitan's parse of ``hf_assets_path``'s
    ``model.safetensors.index.json``; without one (a single file, or ``hf_assets_path = "embedded"``) it is None
    and torchtitan's missing-index warning, which would appear on every such run, is not given."""

    def __init__(self, model_args: ModelArgs, hf_assets_path: str | None):
        path = hf_assets_path if hf_assets_path and Path(hf_assets_path).is_dir() else None
        has_index = path is not None and (Path(path) / "model.safetensors.index.json").is_file()
        super().__init__(model_args, path if has_index else None)
        self.model_args, self.hf_assets_path = model_args, path

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return to_hf(state_dict, self.model_args)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return from_hf(hf_state_dict, self.model_args)

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        if from_quantized:  # torchtitan only warns; the weights would then load wrong
            raise CheckpointError("checkpoint.initial_load_in_hf_quantized: quantized HF checkpoints are not supported")
        return super().get_hf_storage_reader(path)
