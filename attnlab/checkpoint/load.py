"""The one way every tool loads a checkpoint, of either format: a DCP step folder (``<run>/checkpoint/step-N`` as
the trainer writes it, or a model-only folder) or a Hugging Face folder (:mod:`checkpoint.hf`).

- :func:`load_model`: the model in eval mode and its JobConfig from a run, step or Hugging Face folder;
- :func:`load_tool_checkpoint`: (format, architecture, state dict, JobConfig) of a resolved
  :class:`checkpoint.layout.CheckpointRef`, for tools that build or convert the model themselves;
- :func:`load_checkpoint`: (format, architecture, state dict) of one folder, without its run.

A DCP folder's architecture comes from its run's training configuration, its ``attnlab.json`` record
(:mod:`checkpoint.dcp`) or, for softmax/Parallax layers, the tensor shapes (:func:`infer_args`); a Hugging Face
folder's from its config.json.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from attnlab import attention
from attnlab.models.args import ModelArgs
from attnlab.checkpoint.dcp import (SIDECAR, CheckpointError, build_model, config_and_architecture, config_changes,
                                    config_for, load_dcp_state, model_args_from_config, parse_run_config, read_sidecar,
                                    run_argv, undescribed)
from attnlab.checkpoint.hf import load_hf_state
from attnlab.checkpoint.layout import CheckpointRef, has_safetensors, is_dcp_folder, is_hf_folder, resolve

SOFTMAX_PARAMS = {"wq.weight", "wk.weight", "wv.weight", "wo.weight"}
QK_NORM_PARAMS = {"q_norm.weight", "k_norm.weight"}
PARALLAX_PARAMS = {"wr.weight", "r_norm.weight"}
GATE_PARAMS = {"r_gate.weight", "r_gate.bias"}
"""A layer's attention parameter names (under ``layers.<i>.attention.``) by which :func:`infer_mechanism` tells
softmax from Parallax."""


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
                                  f"this folder has no {SIDECAR} describing its mechanism "
                                  "(supported: softmax, parallax)")
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
    if args is not None and has_safetensors(path):  # checkpoint.last_save_in_hf
        return "hf", *load_hf_state(path, progress, args)
    if is_dcp_folder(path):
        sd = load_dcp_state(path, progress)
        return "dcp", args or read_sidecar(path) or infer_args(sd, **infer_kw), sd
    raise CheckpointError(f"{path}: neither a DCP step folder (.metadata) nor a Hugging Face folder "
                          "(config.json + *.safetensors; a step folder saved with checkpoint.last_save_in_hf "
                          "needs its run's config.toml or --config)")


def job_config(config_file, overrides: list[str] | None = None):
    """The merged JobConfig of a training TOML (+ ``--section.key value`` overrides)."""
    return parse_run_config(["--job.config_file", str(config_file), *(overrides or [])])


def args_from_job_config(config_file, overrides: list[str] | None = None) -> ModelArgs:
    """ModelArgs of a training TOML (+ ``--section.key value`` overrides), as the trainer builds them."""
    return model_args_from_config(job_config(config_file, overrides))


def load_tool_checkpoint(ckpt: CheckpointRef, config_file=None, progress: bool = False,
                         train_flags: list[str] | None = None, infer: bool = True, **infer_kw):
    """(format, architecture, state dict, JobConfig or None) of a resolved :class:`checkpoint.layout.CheckpointRef`:
    the one way every tool reads a run, a step folder or a Hugging Face folder.

    Architecture, first found: ``config_file`` (a TOML the user names) or the run's own description
    (``<run>/config.toml``, ``<run>/train_args.json``), with ``train_flags`` (train.py ``--section.key value``
    overrides) on top, which also gives the JobConfig; the folder's own record (HF config.json / DCP attnlab.json);
    with ``infer``, the tensor shapes (``infer_kw``, softmax/Parallax only). A DCP folder that nothing describes is
    a CheckpointError naming the folders when ``infer`` is off, and so is a run's config.toml that describes another
    model than the step's ``attnlab.json`` (edited after training; changes on purpose go in ``train_flags``).
    Every pickle of a DCP folder is checked before anything is unpickled (:func:`checkpoint.dcp.check_pickles`)."""
    flags = list(train_flags or [])
    argv = ["--job.config_file", str(config_file), *flags] if config_file else ckpt.config_argv(flags)
    if is_dcp_folder(ckpt.path):
        if not config_file and ckpt.config is not None:
            changed = config_changes(ckpt.path, ckpt.config)
            if changed:
                raise CheckpointError(
                    f"{ckpt.config} describes another model than {ckpt.path / SIDECAR}, the record the checkpoint was "
                    f"saved with: {changed}. Was it edited after training? Restore it (to use a changed model on "
                    "purpose, keep config.toml as trained and pass the key after `--`, e.g. "
                    "`-- --model.rope_theta 500000`)")
        described = run_argv(argv, ckpt.path) is not None
        cfg, args = config_and_architecture(argv, ckpt.path) if described else (None, read_sidecar(ckpt.path))
        if args is None and not infer:
            raise undescribed(ckpt.path)
        sd = load_dcp_state(ckpt.path, progress)
        return "dcp", args or infer_args(sd, **infer_kw), sd, cfg
    from attnlab.config import names_config_file

    names_config = names_config_file(argv)
    if flags and not names_config:  # they would be dropped: an HF folder's architecture is its config.json
        raise CheckpointError(f"{ckpt.path}: a Hugging Face folder outside a run, so the train.py flags after `--` "
                              f"({' '.join(flags)}) have no configuration to apply to; add --job.config_file")
    cfg = parse_run_config(argv) if names_config else None
    fmt, args, sd = load_checkpoint(ckpt.path, model_args_from_config(cfg) if cfg else None, progress, **infer_kw)
    return fmt, args, sd, cfg


def load_model(path, train_flags: list[str] | None = None, device="cpu", dtype: torch.dtype = torch.float32,
               step: int | None = None):
    """(model in eval mode, JobConfig, checkpoint folder) of a run, step or Hugging Face folder ``path``
    (:func:`checkpoint.layout.resolve`, then :func:`load_tool_checkpoint` without shape inference, then
    :func:`build_model`). A checkpoint only its own record describes gets the default configuration set to that
    architecture; ``cfg.model.hf_assets_path`` points at the checkpoint's own tokenizer when it has one."""
    ckpt = resolve(path, step)
    _, args, sd, cfg = load_tool_checkpoint(ckpt, train_flags=train_flags, infer=False)
    cfg = cfg or config_for(args)
    model = build_model(args, sd, device=device, dtype=dtype)
    ckpt.use_tokenizer(cfg)
    return model, cfg, ckpt.path


def tokenizer_folder(ckpt: CheckpointRef, cfg=None) -> Path | None:
    """The tokenizer of a checkpoint: the run's ``tokenizer/`` or the HF folder's files, else the config's
    ``model.hf_assets_path`` (the embedded default's cached tokenizer for "embedded"); None when there is none."""
    if ckpt.tokenizer is not None:
        return ckpt.tokenizer
    if cfg is None:
        return None
    from attnlab.data.loader import tokenizer_path

    path = Path(tokenizer_path(cfg))
    return path if (path / "tokenizer.json").is_file() else None
