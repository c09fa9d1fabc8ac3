"""DCP checkpoints for offline tools: read and write model state, the ``attnlab.json`` architecture record,
the training configuration of a run, and the one ``build_model``. Tools load runs through
:func:`checkpoint.load.load_model` / :func:`checkpoint.load.load_tool_checkpoint` (any format), built on this module.

The model is rebuilt from the training config: the same CLI/TOML argv as ``train.py`` (``argv``), or, when
``argv`` is empty, ``<run>/config.toml`` (what every run writes), ``<run>/train_args.json`` (a JSON list of the
argv, written by ``benchmarks/replicate.py``), or the step folder's ``attnlab.json`` (the architecture alone); a
run that none of them describes is an error naming the folder, never the default configuration's model.
Only the model's keys are read from the checkpoint (optimizer and trainer states are skipped), so full training
checkpoints and model-only ones both work. Shape mismatches name the keys. Hugging Face folders are
:mod:`checkpoint.hf`'s, which builds on this module (never the other way round).

A DCP folder is partly pickled, and unpickling can run code: nothing in a step folder is unpickled before
:func:`check_pickles` has read every pickle in it with an allow-list of the classes a checkpoint holds
(:func:`read_metadata`); the trainer and every tool go through it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from attnlab import attention
from attnlab.config.parse import import_custom_module
from attnlab.models.args import ModelArgs
from attnlab.models.model import Transformer
from attnlab.checkpoint.layout import CONFIG_FILE, TRAIN_ARGS_FILE, new_folder, run_dir_of

SIDECAR = "attnlab.json"
NON_MODEL_PREFIXES = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")

RUNTIME_FIELDS = ("max_seq_len", "attn_impl", "custom_import")
"""Architecture-record fields (dotted paths into :func:`args_to_dict`) a resume may change: they choose kernels,
table sizes and where a mechanism's code is imported from, not the weights' meaning."""

INIT_ONLY_FIELDS = ModelArgs.INIT_ONLY + tuple(f"attention_options.{name}.{option}"
                                               for name, mech in attention.REGISTRY.items()
                                               for option in getattr(mech.options, "INIT_ONLY", ()))
"""Architecture-record fields a resume may change because they only set initial weights: ``ModelArgs.INIT_ONLY``
(the depth-scaled init std) and each registered mechanism's options dataclass's ``INIT_ONLY`` (Parallax: W_R, ρ's
RMSNorm gain, the ρ gate's bias; FoX: the forget gate's bias).
A resume loads those weights from the checkpoint, so their initialisation is never used, and a run started under
one default of these options resumes under another."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the requested operation (message says why)."""


class UnsafeCheckpointError(CheckpointError):
    """A pickle in a step folder that names a class a checkpoint never holds: unpickling it could run code."""


def architecture_changes(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """{dotted field: (old, new)} where the architecture records ``old`` (a step folder's ``attnlab.json``) and
    ``new`` (:func:`args_to_dict` of the model built) differ, nested dicts compared key by key. Only keys present in
    both count: a checkpoint recorded before an option existed resumes with that option's default.
    :data:`RUNTIME_FIELDS` and :data:`INIT_ONLY_FIELDS` never count."""
    out = {}
    for k, v in old.items():
        path = prefix + k
        if path in RUNTIME_FIELDS or path in INIT_ONLY_FIELDS or k not in new:
            continue
        if isinstance(v, dict) and isinstance(new[k], dict):
            out.update(architecture_changes(v, new[k], path + "."))
        elif v != new[k]:
            out[path] = (v, new[k])
    return out


def record_changes(step_dir, args: ModelArgs) -> dict[str, tuple]:
    """{field: (the step's record, ``args``)} where the ``attnlab.json`` of ``step_dir`` and the architecture
    ``args`` differ (:func:`architecture_changes`); {} when the step folder has no record."""
    rec = Path(step_dir) / SIDECAR
    if not rec.is_file():
        return {}
    new = json.loads(json.dumps(args_to_dict(args)))  # tuples as JSON lists, like the record
    return architecture_changes(json.loads(rec.read_text()), new)


# ------------------------------------------------------------------------------------ pickles in a step folder

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}
"""The classes (module, name) DCP's ``.metadata`` pickle holds, besides the torch dtypes (``torch.float32``, …):
the metadata dataclasses, the shard locations, tensor sizes, the layout and memory-format encodings, and the
checkpoint's path (``StorageMeta.checkpoint_id``). Read from the checkpoints torch 2.13 writes."""


class _AllowListUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the (module, name) pairs of ``allowed`` and torch's dtypes; any other
    global (a function to call, a class to build) raises :class:`UnsafeCheckpointError` before it is looked up."""

    def __init__(self, file, allowed: set[tuple[str, str]], where: str):
        super().__init__(file)
        self.allowed, self.where = allowed, where

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                               torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.where}: refused, it names {module}.{name}, which a checkpoint never holds; unpickling it could "
            "run code. Nothing was loaded; use checkpoints only from sources you trust (a Hugging Face export, "
            "safetensors, holds no code)")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.where}: refused, it refers to external storage ({pid!r}), which a "
                                    "checkpoint's pickles never do")


def _restricted_loads(data: bytes, allowed: set[tuple[str, str]], where: str):
    try:
        return _AllowListUnpickler(io.BytesIO(data), allowed, where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001  (truncated or not a pickle: any unpickling error)
        raise CheckpointError(f"{where}: not a readable pickle ({type(e).__name__}: {e})") from None


def read_metadata(folder):
    """The DCP ``Metadata`` of step folder ``folder``, unpickled with the allow-list of :data:`_METADATA_CLASSES`
    (torch's ``FileSystemReader.read_metadata`` unpickles it with no restriction). Raises CheckpointError naming
    the file when it is missing or unreadable, UnsafeCheckpointError when it names any other class."""
    path = Path(folder) / ".metadata"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    meta = _restricted_loads(data, _METADATA_CLASSES, str(path))
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(meta, Metadata):
        raise CheckpointError(f"{path}: holds a {type(meta).__name__}, not DCP metadata")
    return meta


def check_pickles(folder):
    """Read every pickle of DCP step folder ``folder`` as the load would, but restricted, and return its metadata:

    - ``.metadata`` (and per-rank ``__<r>.metadata`` files), which DCP reads with ``pickle.load``: the
      :data:`_METADATA_CLASSES` allow-list (:func:`read_metadata`);
    - every non-tensor item in the ``.distcp`` shards (step counters, optimizer hyper-parameters, the
      schedule's and the data loader's states), which DCP reads with ``torch.load(weights_only=False)``: torch's
      own restricted unpickler (``weights_only=True``: tensors, numbers, strings, containers);
    - the data loader's per-rank state inside them (``dataloader.dp_rank_<r>``, bytes that torchtitan and
      ``data.loader`` read with ``pickle.loads``): plain numbers, strings and containers, no class at all.

    Raises UnsafeCheckpointError naming the file (and item) for anything else, before anything was unpickled
    unrestricted; CheckpointError for unreadable files. Tensor items are read by DCP with ``weights_only=True``
    already."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    for extra in sorted(folder.glob("__*.metadata")):
        _restricted_loads(extra.read_bytes(), _METADATA_CLASSES, str(extra))
    meta = read_metadata(folder)
    byte_keys = {k for k, m in meta.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata)}
    items = sorted(((info.relative_path, info.offset, info.length, index.fqn)
                    for index, info in (meta.storage_data or {}).items() if index.fqn in byte_keys))
    checked: set[bytes] = set()  # many items are equal (each parameter's lr, betas, …): each is read once
    for relative_path, offset, length, fqn in items:
        where = f"{folder / relative_path} (item {fqn})"
        try:
            with open(folder / relative_path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except OSError as e:
            raise CheckpointError(f"{where}: cannot be read ({e.strerror or e})") from None
        if data in checked:
            continue
        checked.add(data)
        if not zipfile.is_zipfile(io.BytesIO(data)):  # what torch.save writes (DCP stores each item that way)
            raise CheckpointError(f"{where}: corrupt or truncated ({len(data)} bytes, not a torch.save record); the "
                                  "checkpoint cannot be loaded")
        try:
            value = torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"{where}: refused by torch's restricted unpickler ({_first_line(e)}); "
                                        "unpickling it could run code. Nothing was loaded; use checkpoints only "
                                        "from sources you trust") from None
        except Exception as e:  # noqa: BLE001  (a damaged record)
            raise CheckpointError(f"{where}: corrupt or truncated, cannot be read ({type(e).__name__}: "
                                  f"{_first_line(e)}); the checkpoint cannot be loaded") from None
        if fqn.startswith("dataloader.") and isinstance(value, (bytes, bytearray)):
            _restricted_loads(bytes(value), set(), where)
    return meta


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def args_to_dict(args: ModelArgs) -> dict[str, Any]:
    """JSON-able architecture: ModelArgs fields with ``layer_pattern`` expanded to one entry per layer and
    every used mechanism's options as a dict."""
    d = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelArgs) if f.name != "attention_options"}
    d["layer_pattern"] = args.layer_mechanisms()
    d["attention_options"] = {
        name: dataclasses.asdict(opts) if dataclasses.is_dataclass(opts) else dict(opts or {})
        for name, opts in args.attention_options.items() if name in set(args.layer_mechanisms())
    }
    return d


def args_from_dict(d: dict[str, Any]) -> ModelArgs:
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = set(d) - known
    if unknown:
        raise CheckpointError(f"architecture record has unknown fields {sorted(unknown)}; valid: {sorted(known)}")
    kw = {k: v for k, v in d.items() if k != "attention_options"}
    args = ModelArgs(**kw)
    opts = {}
    missing = sorted(set(args.layer_mechanisms()) - set(attention.REGISTRY))
    if missing and args.custom_import:  # a mechanism of the user's own package: the record names its module
        try:
            import_custom_module(args.custom_import)
        except ValueError as e:
            raise CheckpointError(f"the checkpoint's layers use attention {missing}: {e}") from None
    for name in set(args.layer_mechanisms()):
        if name not in attention.REGISTRY:  # a mechanism of the user's own package, not imported in this process
            raise CheckpointError(f"the checkpoint's layers use attention {name!r}, which is not registered here: "
                                  "import the module that registers it first (the run's [experimental] custom_import, "
                                  f"its folder on PYTHONPATH); registered: {sorted(attention.REGISTRY)}")
        mech = attention.get_mechanism(name, "layer_pattern")
        kw = dict(d.get("attention_options", {}).get(name, {}))
        defaults = mech.options()
        for k, v in kw.items():  # JSON turns tuples into lists
            if isinstance(v, list) and isinstance(getattr(defaults, k, None), tuple):
                kw[k] = tuple(v)
        opts[name] = mech.options(**kw)
    args.attention_options = opts
    return args


def load_dcp_state(folder, progress: bool = False) -> dict[str, torch.Tensor]:
    """Model tensors of a DCP folder (optimizer and other trainer states skipped), keys as the model's."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = check_pickles(folder)
    sd = {}
    for key, m in meta.state_dict_metadata.items():
        if key.startswith(NON_MODEL_PREFIXES) or not isinstance(m, TensorStorageMetadata):
            continue
        sd[key] = torch.empty(m.size, dtype=m.properties.dtype)
    if not sd:
        raise CheckpointError(f"{folder}: the DCP checkpoint holds no model tensors")
    read_dcp(sd, folder)
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    if progress:
        progress_bar(len(sd), "read").update(len(sd))
    return sd


def read_dcp(state: dict[str, torch.Tensor], folder) -> None:
    """Fill ``state`` (keys as stored) in place from the DCP folder ``folder``. A shard that cannot be read
    (truncated by a full disk or a copy cut short, or corrupt) is a CheckpointError naming the folder and every
    shard shorter than the metadata says, instead of DCP's traceback of the unpickler's EOFError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (CheckpointException is a BaseException)
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1:] or [""]
        short = _short_shards(folder)
        raise CheckpointError(f"{folder}: corrupt or truncated checkpoint shard"
                              + (f" ({'; '.join(short)})" if short else "")
                              + f"; the checkpoint cannot be read ({type(e).__name__}: {last[0].strip()[:200]})") from e


def _short_shards(folder) -> list[str]:
    """'<shard> has N of M bytes' for every shard of a DCP folder shorter than the extent its metadata records."""
    need: dict[str, int] = {}
    for info in read_metadata(folder).storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    size = {name: (Path(folder) / name).stat().st_size if (Path(folder) / name).is_file() else 0 for name in need}
    return [f"{name} has {size[name]} of {n} bytes" for name, n in sorted(need.items()) if size[name] < n]


def save_dcp_state(sd: dict[str, torch.Tensor], folder, args: ModelArgs) -> None:
    """Model-only DCP folder (what ``checkpoint.initial_load_path`` with ``initial_load_model_only`` reads)
    plus the ``attnlab.json`` architecture record. Written to a temporary folder, then renamed."""
    import torch.distributed.checkpoint as dcp

    with new_folder(folder) as tmp:
        dcp.save({k: v.contiguous() for k, v in sd.items()}, checkpoint_id=str(tmp), no_dist=True)
        (tmp / SIDECAR).write_text(json.dumps(args_to_dict(args), indent=2))


def read_sidecar(folder) -> ModelArgs | None:
    p = Path(folder) / SIDECAR
    return args_from_dict(json.loads(p.read_text())) if p.is_file() else None


def build_model(args: ModelArgs, state_dict: dict[str, torch.Tensor] | None = None, device="cpu",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build on the meta device, materialise, init, then load ``state_dict`` strictly (names as the model's)."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    if state_dict is not None:
        expected = model.state_dict()
        bad = [f"{k} {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in state_dict.items()
               if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
        if bad:
            raise CheckpointError(f"checkpoint tensors do not fit the architecture ({len(bad)} shape mismatches, "
                                  f"checkpoint vs model): {'; '.join(bad[:3])}")
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if args.enable_weight_tying:
            missing = [k for k in missing if k != "output.weight"]
        if missing or unexpected:
            raise CheckpointError(f"checkpoint does not match the model: missing {missing[:6]}{'…' if len(missing) > 6 else ''}, "
                                  f"unexpected {unexpected[:6]}{'…' if len(unexpected) > 6 else ''}")
        if args.enable_weight_tying:
            model.output.weight = model.tok_embeddings.weight
    return model.to(dtype).eval()


def progress_bar(it, desc: str, enable: bool = True):
    """A transient tqdm bar over ``it`` (an iterable, or an int total to ``update`` by hand); off unless enable."""
    from tqdm import tqdm

    if isinstance(it, int):
        return tqdm(total=it, desc=desc, disable=not enable, leave=False)
    return tqdm(it, desc=desc, disable=not enable, leave=False)


def run_argv(argv: list[str] | None, step_dir: Path) -> list[str] | None:
    """train.py's argv describing the run of ``step_dir``: ``argv`` when it names ``--job.config_file``, else
    ``argv`` on top of ``<run>/config.toml``, else ``argv`` (on top of the default config) when given, else
    ``<run>/train_args.json``; None when there is none of them."""
    from attnlab.config import names_config_file

    argv = list(argv or [])
    run = run_dir_of(step_dir)
    if names_config_file(argv):
        return argv
    if (run / CONFIG_FILE).is_file():
        return ["--job.config_file", str(run / CONFIG_FILE), *argv]
    if argv:
        return argv
    if (run / TRAIN_ARGS_FILE).is_file():
        return json.loads((run / TRAIN_ARGS_FILE).read_text())
    return None


def config_and_architecture(argv: list[str] | None, step_dir: Path):
    """(JobConfig, ModelArgs) of the run of ``step_dir``: from :func:`run_argv` (:func:`parse_run_config`), or, for a run with none of its
    descriptions but an ``attnlab.json`` in the step folder, that record (the default config set to it by
    :func:`_with_architecture`; fields no key sets, such as the flavor's RMSNorm eps, come from the record).
    Raises CheckpointError naming the folders when nothing describes the run."""
    from attnlab.config import DEFAULT_CONFIG, names_config_file

    described = run_argv(argv, step_dir)
    if described is None:
        if not (step_dir / SIDECAR).is_file():
            raise undescribed(step_dir)
        args = read_sidecar(step_dir)
        return config_for(args), args
    if not names_config_file(described):
        described = ["--job.config_file", DEFAULT_CONFIG, *described]
    cfg = parse_run_config(described)
    return cfg, model_args_from_config(cfg)


def parse_run_config(argv: list[str]):
    """``config.parse_config(argv)`` for a tool rebuilding a run; a configuration that does not parse (a run's
    config.toml that is not valid TOML, an unknown key, a bad value) is a CheckpointError naming the file."""
    from attnlab.config import parse_config

    try:
        return parse_config(argv)
    except ValueError as e:  # tomli.TOMLDecodeError is one
        flag = [a for a in argv if a.startswith("--job.config_file")][:1]
        i = argv.index(flag[0]) if flag else -1
        name = (flag[0].partition("=")[2] or argv[i + 1]) if flag else "the configuration"
        what = "not valid TOML" if type(e).__name__ == "TOMLDecodeError" else "cannot be used"
        raise CheckpointError(f"{name}: {what} ({_first_line(e)})") from None


def config_changes(ckpt_dir: Path, config_file: Path) -> str | None:
    """Where the run configuration ``config_file`` (a run's config.toml) describes another model than the
    ``attnlab.json`` record the step folder ``ckpt_dir`` was saved with (:func:`record_changes`), as
    "field: X in the record, Y in config.toml; …"; None when they agree or the step has no record."""
    if not (Path(ckpt_dir) / SIDECAR).is_file():
        return None
    args = model_args_from_config(parse_run_config(["--job.config_file", str(config_file)]))
    changed = record_changes(ckpt_dir, args)
    return "; ".join(f"{k}: {old!r} in the record, {new!r} in {Path(config_file).name}"
                     for k, (old, new) in changed.items()) or None


def config_for(args: ModelArgs):
    """The default JobConfig set to the architecture ``args`` (:func:`_with_architecture`): the configuration of a
    checkpoint that only its own record describes (a DCP ``attnlab.json``, an HF ``config.json``)."""
    from attnlab.config import DEFAULT_CONFIG, parse_config

    cfg = parse_config(["--job.config_file", DEFAULT_CONFIG])
    _with_architecture(cfg, args)
    return cfg


def undescribed(step_dir: Path) -> CheckpointError:
    """The error for a step folder that neither its run's files nor its own record describe."""
    return CheckpointError(f"nothing describes the model of {str(step_dir)!r}: its run folder "
                           f"{str(run_dir_of(step_dir))!r} has no config.toml or train_args.json and the step "
                           f"folder no {SIDECAR}; pass the run's training config after `--`, e.g. "
                           "`-- --job.config_file x --model.attention parallax`")


def _with_architecture(cfg, args: ModelArgs) -> None:
    """Set the ``[model]``/``[attention]`` keys of ``cfg`` to the architecture ``args`` (a step folder's
    attnlab.json) and the sequence lengths to its trained context, so the tools read and report that model and
    not the default config's."""
    from attnlab.models.args import DIMS

    m = cfg.model
    for f in DIMS:
        setattr(m, f, getattr(args, f))
    m.vocab_size, m.rope_theta, m.tie_embeddings = args.vocab_size, args.rope_theta, args.enable_weight_tying
    m.attention, m.layer_pattern, m.attn_mask_type = args.attention, list(args.layer_pattern), args.attn_mask_type
    for name, opts in args.attention_options.items():
        setattr(cfg.attention, name, opts)
    cfg.training.seq_len = cfg.validation.seq_len = args.max_seq_len


def model_args_from_config(cfg) -> ModelArgs:
    from attnlab.models.args import get_flavor

    args = get_flavor(cfg.model.flavor)
    args.update_from_config(cfg)
    return args
