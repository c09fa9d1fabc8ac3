"""Load a trained model from a run folder or a DCP step folder, for offline tools (analysis, eval, conversion).

    from models.checkpoint_io import load_model
    model, cfg, step_dir = load_model("runs/x", ["--job.config_file", "configs/x.toml"])

The model is rebuilt from the training config: the same CLI/TOML argv as ``train.py`` (``argv``), or, when
``argv`` is empty, ``<run>/train_args.json`` (a JSON list of the argv, written by ``scripts/replicate.py``).
Only the model's keys are read from the checkpoint (``torch.distributed.checkpoint`` loads what is asked
for), so full training checkpoints and model-only ones both work. Shape mismatches name the keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch

from models.args import ModelArgs

def resolve_step_dir(path: str | os.PathLike) -> Path:
    """A DCP folder (with ``.metadata``): ``path`` itself, or the highest ``step-N`` under ``path`` or
    ``path/checkpoint``."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    for folder in (p / "checkpoint", p):
        steps = [(int(m.group(1)), d) for d in folder.glob("step-*") if (m := re.fullmatch(r"step-(\d+)", d.name))
                 and (d / ".metadata").is_file()]
        if steps:
            return max(steps)[1]
    raise FileNotFoundError(f"{str(path)!r}: not a DCP checkpoint folder (no .metadata) and no step-N folder under "
                            "it or under its checkpoint/ folder")


def run_dir_of(step_dir: Path) -> Path:
    """The run folder (``job.dump_folder``) of ``<run>/checkpoint/step-N``."""
    return step_dir.parent.parent if step_dir.parent.name == "checkpoint" else step_dir.parent


def load_config(argv: list[str] | None, step_dir: Path):
    """The merged JobConfig: from ``argv`` (train.py's flags) or ``<run>/train_args.json``."""
    from config import DEFAULT_CONFIG, parse_config

    argv = list(argv or [])
    saved = run_dir_of(step_dir) / "train_args.json"
    if not argv and saved.is_file():
        argv = json.loads(saved.read_text())
    if not any(a.split("=")[0] in ("--job.config_file", "--job.config-file") for a in argv):
        argv = ["--job.config_file", DEFAULT_CONFIG, *argv]
    return parse_config(argv)


def model_args_from_config(cfg) -> ModelArgs:
    from models.args import get_flavor

    args = get_flavor(cfg.model.flavor)
    args.update_from_config(cfg)
    return args


def build_model(args: ModelArgs, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Construct on the meta device, materialise on ``device`` and initialise (as the trainer does)."""
    import attention  # noqa: F401  (registers every mechanism)
    from models.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model


def load_weights(model: torch.nn.Module, step_dir: str | os.PathLike, strict: bool = True) -> list[str]:
    """Read ``model``'s keys from a DCP checkpoint in place; returns keys the checkpoint lacks (only when
    ``strict=False``; those keep their initialisation). With ``strict``, model keys the checkpoint lacks and
    checkpoint model keys the model lacks (weights that would be dropped) are both errors naming the keys."""
    import torch.distributed.checkpoint as dcp

    from models.hf import NON_MODEL_PREFIXES

    reader = dcp.FileSystemReader(str(step_dir))
    meta = reader.read_metadata().state_dict_metadata
    sd = model.state_dict()
    missing = [k for k in sd if k not in meta]
    unexpected = sorted(k for k in meta if not k.startswith(NON_MODEL_PREFIXES) and k not in sd)
    bad = [f"{k}: checkpoint {tuple(meta[k].size)} vs model {tuple(v.shape)}" for k, v in sd.items()
           if k in meta and hasattr(meta[k], "size") and tuple(meta[k].size) != tuple(v.shape)]
    if bad or ((missing or unexpected) and strict):
        raise ValueError(f"checkpoint {str(step_dir)!r} does not fit the model built from the config "
                         f"(pass the training flags / --job.config_file): mismatched {bad[:5]}, missing "
                         f"{missing[:5]}, not in the model {unexpected[:5]}")
    present = {k: v for k, v in sd.items() if k in meta}
    dcp.load(present, storage_reader=reader, no_dist=True)
    model.load_state_dict({**sd, **present}, strict=True)
    if model.model_args.enable_weight_tying:
        model.output.weight = model.tok_embeddings.weight
    return missing


def load_model(path: str | os.PathLike, argv: list[str] | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32):
    """(model in eval mode, JobConfig, step folder) for a run folder or step folder ``path``."""
    step_dir = resolve_step_dir(path)
    cfg = load_config(argv, step_dir)
    model = build_model(model_args_from_config(cfg), device)
    load_weights(model, step_dir)
    return model.to(dtype).eval(), cfg, step_dir


def checkpoint_step(step_dir: Path) -> int | None:
    m = re.fullmatch(r"step-(\d+)", step_dir.name)
    return int(m.group(1)) if m else None


def replace_args(args: ModelArgs, **kw) -> ModelArgs:
    return dataclasses.replace(args, **kw)
