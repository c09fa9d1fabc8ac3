"""Hugging Face folders: export and import of safetensors + config.json, one state-dict adapter per mechanism,
and the one way tools load a checkpoint of either format (:func:`load_tool_checkpoint`, :func:`load_model`).

A model lives on disk in two formats; this module reads and writes the Hugging Face one and reads either
(:func:`load_checkpoint`), with the DCP side in :mod:`models.checkpoint_io`:

- **DCP step folder** (``<dump>/checkpoint/step-N`` as the trainer writes it, or a model-only folder):
  flattened parameter names next to optimizer/scheduler/data-loader entries. Its architecture comes from the
  sidecar ``attnlab.json`` (:mod:`models.checkpoint_io`) or, for softmax/Parallax layers, from the tensor shapes
  (:func:`infer_args`).
- **Hugging Face folder**: ``config.json`` + ``model.safetensors`` (or a sharded index). A model whose every
  layer is Qwen3 softmax attention (q/k-norm, no window) is written as a plain ``Qwen3ForCausalLM`` that
  ``transformers.AutoModelForCausalLM`` loads with equal logits. Any other mechanism keeps the Qwen3 keys and
  adds its own under ``self_attn.`` (Parallax: ``r_proj``, ``r_norm``, ``r_gate``); such a folder has
  ``model_type = "attnlab"`` so transformers never loads it as a Qwen3 (silently dropping weights). Every exported
  ``config.json`` carries the full architecture under ``"attnlab"`` (import is exact). When every layer is
  softmax (any options) or Parallax, the folder also holds a standalone remote-code model
  (``attnlab/checkpoint/hf_remote``: configuration + modeling files, ``auto_map`` in config.json), so
  ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` loads it. config.json is written and read
  through transformers' config classes (:func:`hf_config`, :func:`args_from_hf_config`); the tokenizer is saved with
  transformers and encodes as the training data path does (:func:`save_hf_tokenizer`).

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
from attnlab.checkpoint.dcp import (SIDECAR, CheckpointError, args_from_dict, args_to_dict, build_model, config_and_architecture,
                                  config_for, is_dcp_folder, load_dcp_state, model_args_from_config, progress_bar,
                                  read_sidecar, run_argv, undescribed)
from attnlab.checkpoint.layout import TRAIN_FLAGS_HELP, add_checkpoint_arguments, new_folder, resolve, split_train_flags

ATTN_PARAM_TO_HF = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "wr": "r_proj"}
"""Attention submodule renames (torchtitan → HF) of the Qwen3-named mechanisms below; the attention parameters
of every other mechanism keep their own names under ``self_attn.``."""
QWEN3_NAMED = ("softmax", "parallax")


def _attn_renames(args: ModelArgs, i: int) -> dict[str, str]:
    return ATTN_PARAM_TO_HF if args.layer_mechanisms()[int(i)] in QWEN3_NAMED else {}
SOFTMAX_PARAMS = {"wq.weight", "wk.weight", "wv.weight", "wo.weight"}
QK_NORM_PARAMS = {"q_norm.weight", "k_norm.weight"}
PARALLAX_PARAMS = {"wr.weight", "r_norm.weight"}
GATE_PARAMS = {"r_gate.weight", "r_gate.bias"}


# --------------------------------------------------------------------------- architecture from tensor shapes

def _layer_params(keys, i: int) -> set[str]:
    prefix = f"layers.{i}.attention."
    return {k[len(prefix):] for k in keys if k.startswith(prefix)}


def infer_mechanism(params: set[str]) -> str | None:
    """'softmax' / 'parallax' from a layer's attention parameter names, None when neither fits."""
    base = params - QK_NORM_PARAMS
    if base == SOFTMAX_PARAMS:
        return "softmax"
    if base - GATE_PARAMS == SOFTMAX_PARAMS | PARALLAX_PARAMS and (not (base & GATE_PARAMS) or GATE_PARAMS <= base):
        return "parallax"
    return None


def infer_args(sd: dict[str, torch.Tensor], norm_eps: float = 1e-6, rope_theta: float = 1e6,
               max_seq_len: int = 4096, attn_mask_type: str = "causal") -> ModelArgs:
    """Architecture of a softmax/Parallax state dict from its tensor shapes (DCP folders record none).
    Not recoverable from shapes: norm_eps, rope_theta, sliding windows, RoPE-on-ρ (assumed on) — pass them
    or use a folder with a sidecar."""
    if "tok_embeddings.weight" not in sd or "norm.weight" not in sd:
        raise CheckpointError("no model weights found (expected tok_embeddings.weight and norm.weight); "
                              "is this a training checkpoint of this framework?")
    vocab, dim = sd["tok_embeddings.weight"].shape
    n_layers = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"layers\.(\d+)\.", k)))
    mechs = []
    for i in range(n_layers):
        p = _layer_params(sd, i)
        mech = infer_mechanism(p)
        if mech is None:
            raise CheckpointError(f"layer {i}: attention parameters {sorted(p)} are neither softmax nor Parallax; "
                                  f"this folder has no {SIDECAR} describing its mechanism (supported: softmax, parallax)")
        mechs.append(mech)
    a0 = "layers.0.attention."
    qk_norm = f"{a0}q_norm.weight" in sd
    if not qk_norm:
        raise CheckpointError("layers without q_norm: the head size cannot be inferred from shapes; "
                              f"this folder needs an {SIDECAR} record")
    head_dim = sd[f"{a0}q_norm.weight"].shape[0]
    n_heads = sd[f"{a0}wq.weight"].shape[0] // head_dim
    n_kv = sd[f"{a0}wk.weight"].shape[0] // head_dim
    hidden = sd["layers.0.feed_forward.w1.weight"].shape[0]
    tied = "output.weight" not in sd or (sd["output.weight"].shape == sd["tok_embeddings.weight"].shape
                                         and torch.equal(sd["output.weight"], sd["tok_embeddings.weight"]))
    opts = {}
    for name in set(mechs):
        mech = attention.get_mechanism(name)
        kw: dict[str, Any] = {"qk_norm": qk_norm}
        if name == "parallax":
            kw["rho_gate"] = any(f"layers.{i}.attention.r_gate.weight" in sd for i in range(n_layers))
        opts[name] = mech.options(**kw)
    pattern = mechs if len(set(mechs)) > 1 else []
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                     hidden_dim=hidden, vocab_size=vocab, norm_eps=norm_eps, rope_theta=rope_theta,
                     max_seq_len=max_seq_len, enable_weight_tying=tied, attn_mask_type=attn_mask_type,
                     attention=mechs[0], layer_pattern=pattern, attention_options=opts)


def is_hf_folder(path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and (any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file())


# ------------------------------------------------------------------------------------------------- HF

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


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32):
    """config.json as a transformers config object (``save_pretrained`` writes it), with the full architecture under
    ``"attnlab"`` (read back exactly by :func:`args_from_hf_config`): a ``Qwen3Config`` for a plain Qwen3 model
    (transformers ignores the extra key); otherwise the remote-code ``AttnLabConfig`` (``model_type = "attnlab"``)
    with the same Qwen3 fields for tools that read them, and ``auto_map`` to the remote-code model when it implements
    every layer."""
    from transformers import Qwen3Config

    qwen3 = dict(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
                 num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                 head_dim=args.head_dim, max_position_embeddings=args.max_seq_len, rms_norm_eps=args.norm_eps,
                 rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                 tie_word_embeddings=args.enable_weight_tying, dtype=dtype, attnlab=args_to_dict(args))
    if is_plain_qwen3(args):
        return Qwen3Config(architectures=["Qwen3ForCausalLM"], **qwen3)
    from attnlab.checkpoint.hf_remote.configuration_attnlab import AttnLabConfig

    cfg = AttnLabConfig(architectures=["AttnLabForCausalLM"], **qwen3)
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


def load_hf_state(folder, progress: bool = False, args: ModelArgs | None = None) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(architecture, torchtitan-named state dict) of a Hugging Face folder; the architecture is ``args`` when
    given (a trainer's ``last_save_in_hf`` step folder has safetensors but no config.json), else config.json's."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if args is None:
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
    """Write ``config.json`` (:func:`hf_config`) + ``model.safetensors`` (+ the tokenizer of ``tokenizer_dir`` when it
    has a tokenizer.json, :func:`save_hf_tokenizer`) atomically into ``folder``, with ordinary permissions."""
    from safetensors.torch import save_file

    hf = {k: v.detach().to(dtype).contiguous().clone()
          for k, v in progress_bar(to_hf(sd, args).items(), "convert", progress)}
    with new_folder(folder) as tmp:
        save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_config(args, dtype).save_pretrained(str(tmp))
        if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
            save_hf_tokenizer(tokenizer_dir, tmp)
        if has_remote_code(args):
            for name in REMOTE_CODE_FILES:
                shutil.copyfile(REMOTE_CODE_DIR / name, tmp / name)


# ------------------------------------------------------------------------------------------ any folder

def load_checkpoint(path, args: ModelArgs | None = None, progress: bool = False, **infer_kw):
    """(format "dcp" | "hf", architecture, state dict) of a DCP step folder or an HF folder (with config.json,
    or safetensors only when ``args`` is given). DCP architecture: ``args`` if given, else the sidecar, else
    inferred from shapes (``infer_kw``)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if is_hf_folder(path):
        a, sd = load_hf_state(path, progress)
        return "hf", args or a, sd
    if args is not None and any(path.glob("*.safetensors")):  # checkpoint.last_save_in_hf
        return "hf", *load_hf_state(path, progress, args)
    if is_dcp_folder(path):
        sd = load_dcp_state(path, progress)
        return "dcp", args or read_sidecar(path) or infer_args(sd, **infer_kw), sd
    raise CheckpointError(f"{path}: neither a DCP step folder (.metadata) nor a Hugging Face folder "
                          "(config.json + *.safetensors; a step folder saved with checkpoint.last_save_in_hf "
                          "needs its run's config.toml or --config)")


def job_config(config_file, overrides: list[str] | None = None):
    """The merged JobConfig of a training TOML (+ ``--section.key value`` overrides)."""
    from attnlab.config import parse_config

    return parse_config(["--job.config_file", str(config_file), *(overrides or [])])


def args_from_job_config(config_file, overrides: list[str] | None = None) -> ModelArgs:
    """ModelArgs of a training TOML (+ ``--section.key value`` overrides), as the trainer builds them."""
    return model_args_from_config(job_config(config_file, overrides))


def load_tool_checkpoint(ckpt, config_file=None, progress: bool = False, train_flags: list[str] | None = None,
                         infer: bool = True, **infer_kw):
    """(format, architecture, state dict, JobConfig or None) of a resolved :class:`models.run_folder.Checkpoint`:
    the one way every tool reads a run, a step folder or a Hugging Face folder.

    Architecture, first found: ``config_file`` (a TOML the user names) or the run's own description
    (``<run>/config.toml``, ``<run>/train_args.json``), with ``train_flags`` (train.py ``--section.key value``
    overrides) on top, which also gives the JobConfig; the folder's own record (HF config.json / DCP attnlab.json);
    with ``infer``, the tensor shapes (``infer_kw``, softmax/Parallax only). A DCP folder that nothing describes is
    a CheckpointError naming the folders when ``infer`` is off."""
    flags = list(train_flags or [])
    argv = ["--job.config_file", str(config_file), *flags] if config_file else ckpt.config_argv(flags)
    if is_dcp_folder(ckpt.path):
        described = run_argv(argv, ckpt.path) is not None
        cfg, args = config_and_architecture(argv, ckpt.path) if described else (None, read_sidecar(ckpt.path))
        if args is None and not infer:
            raise undescribed(ckpt.path)
        sd = load_dcp_state(ckpt.path, progress)
        return "dcp", args or infer_args(sd, **infer_kw), sd, cfg
    from attnlab.config import names_config_file, parse_config

    names_config = names_config_file(argv)
    if flags and not names_config:  # they would be dropped: an HF folder's architecture is its config.json
        raise CheckpointError(f"{ckpt.path}: a Hugging Face folder outside a run, so the train.py flags after `--` "
                              f"({' '.join(flags)}) have no configuration to apply to; add --job.config_file")
    cfg = parse_config(argv) if names_config else None
    fmt, args, sd = load_checkpoint(ckpt.path, model_args_from_config(cfg) if cfg else None, progress, **infer_kw)
    return fmt, args, sd, cfg


def load_model(path, train_flags: list[str] | None = None, device="cpu", dtype: torch.dtype = torch.float32,
               step: int | None = None):
    """(model in eval mode, JobConfig, checkpoint folder) of a run, step or Hugging Face folder ``path``
    (:func:`models.run_folder.resolve`, then :func:`load_tool_checkpoint` without shape inference, then
    :func:`build_model`). A checkpoint only its own record describes gets the default configuration set to that
    architecture; ``cfg.model.hf_assets_path`` points at the checkpoint's own tokenizer when it has one."""
    ckpt = resolve(path, step)
    _, args, sd, cfg = load_tool_checkpoint(ckpt, train_flags=train_flags, infer=False)
    cfg = cfg or config_for(args)
    model = build_model(args, sd, device=device, dtype=dtype)
    ckpt.use_tokenizer(cfg)
    return model, cfg, ckpt.path


def load_run(ap, args, train_flags: list[str]):
    """:func:`load_model` of a tool's ``CKPT``/``--step``/``--device``/``--dtype`` (:func:`tool_parser`); a bad
    folder or checkpoint exits through ``ap`` with one line."""
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        return load_model(args.ckpt, train_flags, device=args.device, dtype=getattr(torch, args.dtype), step=args.step)
    except FileNotFoundError as e:
        ap.error(str(e))
    except CheckpointError as e:  # nothing describes the run, a corrupt shard, weights that do not fit
        ap.exit(2, f"{ap.prog}: error: {e}\n")


def tool_parser(doc: str, argv: list[str]):
    """(parser, the tool's own arguments, train.py flags) of a tool that loads a model through :func:`load_run`:
    ``argv`` split at the train.py flags (``models.run_folder.split_train_flags``), and a parser with the
    checkpoint, ``--dtype`` and ``--device`` arguments and ``doc`` as its description."""
    import argparse

    own, train_flags = split_train_flags(argv)
    ap = argparse.ArgumentParser(description=doc, epilog=TRAIN_FLAGS_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(ap)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    return ap, own, train_flags


def tokenizer_folder(ckpt, cfg=None) -> Path | None:
    """The tokenizer of a checkpoint: the run's ``tokenizer/`` or the HF folder's files, else the config's
    ``model.hf_assets_path`` (the embedded default's cached tokenizer for "embedded"); None when there is none."""
    if ckpt.tokenizer is not None:
        return ckpt.tokenizer
    if cfg is None:
        return None
    from attnlab.data.loader import tokenizer_path

    path = Path(tokenizer_path(cfg))
    return path if (path / "tokenizer.json").is_file() else None


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
