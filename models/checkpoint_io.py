"""Load a trained model from a run folder or a DCP step folder, for offline tools (analysis, eval, conversion).

    from models.checkpoint_io import load_model
    model, cfg, step_dir = load_model("runs/x", ["--job.config_file", "configs/x.toml"])

The model is rebuilt from the training config: the same CLI/TOML argv as ``train.py`` (``argv``), or, when
``argv`` is empty, ``<run>/config.toml`` (what every run writes), ``<run>/train_args.json`` (a JSON list of the
argv, written by ``scripts/replicate.py``), or the step folder's ``attnlab.json`` (the architecture alone); a
run that none of them describes is an error naming the folder, never the default configuration's model.
Only the model's keys are read from the checkpoint (``torch.distributed.checkpoint`` loads what is asked
for), so full training checkpoints and model-only ones both work. Shape mismatches name the keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import torch

from models.args import ModelArgs
from models.run_folder import step_of

def resolve_step_dir(path: str | os.PathLike) -> Path:
    """A DCP folder (with ``.metadata``): ``path`` itself, or the highest ``step-N`` under ``path`` or
    ``path/checkpoint``."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    for folder in (p / "checkpoint", p):
        steps = [(n, d) for d in folder.glob("step-*") if (n := step_of(d)) is not None and (d / ".metadata").is_file()]
        if steps:
            return max(steps)[1]
    raise FileNotFoundError(f"{str(path)!r}: not a DCP checkpoint folder (no .metadata) and no step-N folder under "
                            "it or under its checkpoint/ folder")


def run_dir_of(step_dir: Path) -> Path:
    """The run folder (``job.dump_folder``) of a step folder (:func:`models.run_folder.run_of`)."""
    from models.run_folder import run_of

    return run_of(step_dir) or step_dir.parent


def _run_argv(argv: list[str] | None, step_dir: Path) -> list[str] | None:
    """train.py's argv describing the run of ``step_dir``: ``argv`` when it names ``--job.config_file``, else
    ``argv`` on top of ``<run>/config.toml``, else ``argv`` (on top of the default config) when given, else
    ``<run>/train_args.json``; None when there is none of them."""
    from models.run_folder import CONFIG_FILE, TRAIN_ARGS_FILE

    argv = list(argv or [])
    run = run_dir_of(step_dir)
    if any(a.split("=")[0] in ("--job.config_file", "--job.config-file") for a in argv):
        return argv
    if (run / CONFIG_FILE).is_file():
        return ["--job.config_file", str(run / CONFIG_FILE), *argv]
    if argv:
        return argv
    if (run / TRAIN_ARGS_FILE).is_file():
        return json.loads((run / TRAIN_ARGS_FILE).read_text())
    return None


def load_config(argv: list[str] | None, step_dir: Path):
    """The merged JobConfig of the run of ``step_dir`` (:func:`config_and_architecture`)."""
    return config_and_architecture(argv, step_dir)[0]


def config_and_architecture(argv: list[str] | None, step_dir: Path):
    """(JobConfig, ModelArgs) of the run of ``step_dir``: from :func:`_run_argv`, or, for a run with none of its
    descriptions but an ``attnlab.json`` in the step folder, that record (the default config set to it by
    :func:`_with_architecture`; fields no key sets, such as the flavor's RMSNorm eps, come from the record).
    Raises CheckpointError naming the folders when nothing describes the run."""
    from config import DEFAULT_CONFIG, parse_config
    from models.hf import SIDECAR, CheckpointError, read_sidecar

    run_argv = _run_argv(argv, step_dir)
    if run_argv is None and not (step_dir / SIDECAR).is_file():
        raise CheckpointError(f"nothing describes the model of {str(step_dir)!r}: its run folder "
                              f"{str(run_dir_of(step_dir))!r} has no config.toml or train_args.json and the step "
                              f"folder no {SIDECAR}; pass the run's training config after `--`, e.g. "
                              "`-- --job.config_file configs/x.toml --model.attention parallax`")
    argv = run_argv or []
    if not any(a.split("=")[0] in ("--job.config_file", "--job.config-file") for a in argv):
        argv = ["--job.config_file", DEFAULT_CONFIG, *argv]
    cfg = parse_config(argv)
    if run_argv is not None:
        return cfg, model_args_from_config(cfg)
    args = read_sidecar(step_dir)
    _with_architecture(cfg, args)
    return cfg, args


def _with_architecture(cfg, args: ModelArgs) -> None:
    """Set the ``[model]``/``[attention]`` keys of ``cfg`` to the architecture ``args`` (a step folder's
    attnlab.json) and the sequence lengths to its trained context, so the tools read and report that model and
    not the default config's."""
    from models.args import DIMS

    m = cfg.model
    for f in DIMS:
        setattr(m, f, getattr(args, f))
    m.vocab_size, m.rope_theta, m.tie_embeddings = args.vocab_size, args.rope_theta, args.enable_weight_tying
    m.attention, m.layer_pattern, m.attn_mask_type = args.attention, list(args.layer_pattern), args.attn_mask_type
    for name, opts in args.attention_options.items():
        setattr(cfg.attention, name, opts)
    cfg.training.seq_len = cfg.validation.seq_len = args.max_seq_len


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

    from models.hf import NON_MODEL_PREFIXES, CheckpointError, read_dcp

    try:
        meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{step_dir}: not a readable DCP checkpoint ({type(e).__name__}: {e})") from e
    sd = model.state_dict()
    missing = [k for k in sd if k not in meta]
    unexpected = sorted(k for k in meta if not k.startswith(NON_MODEL_PREFIXES) and k not in sd)
    bad = [f"{k}: checkpoint {tuple(meta[k].size)} vs model {tuple(v.shape)}" for k, v in sd.items()
           if k in meta and hasattr(meta[k], "size") and tuple(meta[k].size) != tuple(v.shape)]
    if bad or ((missing or unexpected) and strict):
        raise CheckpointError(f"checkpoint {str(step_dir)!r} does not fit the model built from the config "
                         f"(pass the training flags / --job.config_file): mismatched {bad[:5]}, missing "
                         f"{missing[:5]}, not in the model {unexpected[:5]}")
    present = {k: v for k, v in sd.items() if k in meta}
    read_dcp(present, step_dir)
    model.load_state_dict({**sd, **present}, strict=True)
    if model.model_args.enable_weight_tying:
        model.output.weight = model.tok_embeddings.weight
    return missing


def load_model(path: str | os.PathLike, argv: list[str] | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32):
    """(model in eval mode, JobConfig, step folder) for a run folder or step folder ``path``."""
    step_dir = resolve_step_dir(path)
    cfg, args = config_and_architecture(argv, step_dir)
    model = build_model(args, device)
    load_weights(model, step_dir)
    return model.to(dtype).eval(), cfg, step_dir


def replace_args(args: ModelArgs, **kw) -> ModelArgs:
    return dataclasses.replace(args, **kw)


def load_run(ap, args, train_flags: list[str]):
    """(model, JobConfig, step folder) of the tool's ``CKPT``/``--step`` (DCP run or step folder), with
    ``cfg.model.hf_assets_path`` pointing at the run's own tokenizer; a bad folder or checkpoint exits through
    ``ap`` with one line."""
    from models.hf import CheckpointError
    from models.run_folder import resolve

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        ckpt = resolve(args.ckpt, args.step, dcp_only=True)
    except FileNotFoundError as e:
        ap.error(str(e))
    try:
        model, cfg, step_dir = load_model(ckpt.path, ckpt.config_argv(train_flags), device=args.device,
                                          dtype=getattr(torch, args.dtype))
    except CheckpointError as e:  # nothing describes the run, a corrupt shard, weights that do not fit
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    ckpt.use_tokenizer(cfg)
    return model, cfg, step_dir


def add_model_arguments(ap) -> None:
    """The checkpoint, dtype and device arguments of the tools that load a run through :func:`load_run`."""
    from models.run_folder import add_checkpoint_arguments

    add_checkpoint_arguments(ap, hf=False)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
