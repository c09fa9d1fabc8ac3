"""Run folders, step folders and Hugging Face folders: the one definition of each, how every offline tool finds a
checkpoint, the configuration it was trained with and its tokenizer, and the files a run leaves for them.

A run folder (``job.dump_folder``) is laid out as::

    <run>/config.toml           the resolved training configuration, all sections (:func:`write_run_files`)
    <run>/config.resolved.toml  instead, when config.toml is the file the run was started from (kept as written)
    <run>/tokenizer/            the tokenizer the run trained with (tokenizer.json, tokenizer_config.json)
    <run>/checkpoint/step-N/    DCP checkpoints
    <run>/metrics.jsonl         one record per logged step (attnlab/trainer/metrics.py)
    <run>/.attnlab-run.json     what the run wrote: each file it may replace, with its SHA-256 (:func:`record_run_files`)
    <run>/train_args.json       older runs: the train.py argv (benchmarks/replicate/)

A step folder is a folder named exactly ``step-N`` (:func:`step_of`); a checkpoint folder holds weights of either
format (:func:`is_checkpoint_folder`): DCP (:func:`is_dcp_folder`) or safetensors, a Hugging Face folder with its
config.json (:func:`is_hf_folder`) or a trainer's ``checkpoint.last_save_in_hf`` step. The trainer resumes from and
rotates only the DCP step folders; tools read every checkpoint folder (:func:`step_folders`).

Every tool takes one ``CKPT`` (a run folder, a ``step-N`` folder or a Hugging Face folder) and ``--step N``
(attnlab/tools/common.py), which :func:`resolve` turns into a :class:`CheckpointRef`. The model is rebuilt from
``<run>/config.toml`` when it exists, so a Parallax run is evaluated as Parallax without repeating its flags.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.toml"
CHECKPOINT_DIR = "checkpoint"
"""The run folder's checkpoint folder (``checkpoint.folder``'s default)."""
RESOLVED_CONFIG_FILE = "config.resolved.toml"
METRICS_FILE = "metrics.jsonl"
RUN_RECORD = ".attnlab-run.json"
"""The run's record of the files it wrote (:func:`record_run_files`)."""
TRAIN_ARGS_FILE = "train_args.json"
TOKENIZER_DIR = "tokenizer"
HF_SOURCE_CONFIG = "hf_source_config.json"
"""An imported model's original config.json, kept beside its tokenizer so an export keeps its metadata
(:data:`attnlab.checkpoint.hf.HF_KEPT`)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "generation_config.json", HF_SOURCE_CONFIG)
"""Files of a Hugging Face tokenizer folder that are copied along (the ones present)."""


@dataclass
class CheckpointRef:
    """Where a tool's ``CKPT`` argument points (:func:`resolve`).

    ``path``: the DCP step folder or Hugging Face folder holding the weights; ``run``: the run folder it belongs
    to (None for a folder outside a run, e.g. an export); ``step``: N of ``step-N`` (None otherwise)."""

    path: Path
    run: Path | None
    step: int | None

    @property
    def config(self) -> Path | None:
        """``<run>/config.toml`` when the run has one."""
        p = self.run / CONFIG_FILE if self.run is not None else None
        return p if p is not None and p.is_file() else None

    @property
    def tokenizer(self) -> Path | None:
        """The folder with the tokenizer of these weights: ``<run>/tokenizer``, or the HF folder itself."""
        for d in ([self.run / TOKENIZER_DIR] if self.run is not None else []) + [self.path]:
            if (d / "tokenizer.json").is_file():
                return d
        return None

    def config_argv(self, extra: list[str] | None = None) -> list[str]:
        """train.py argv that rebuilds this run's configuration: ``--job.config_file <run>/config.toml`` plus
        ``extra`` overrides; just ``extra`` when the run has no config.toml (the loader's older fallbacks)."""
        from attnlab.config import names_config_file

        extra = list(extra or [])
        if self.config is None or names_config_file(extra):
            return extra
        return ["--job.config_file", str(self.config), *extra]

    def use_tokenizer(self, cfg) -> None:
        """Point ``cfg.model.hf_assets_path`` at these weights' own tokenizer (:attr:`tokenizer`) when they have one."""
        if self.tokenizer is not None:
            cfg.model.hf_assets_path = str(self.tokenizer)


def step_of(folder: str | os.PathLike) -> int | None:
    r"""N of a folder named exactly ``step-N`` (as torchtitan writes them), else None. torchtitan's own scan matches
    ``step-(\d+)`` anywhere in a name, so a user's ``step-4.bak`` or ``step-8 copy`` would count as a step."""
    m = re.fullmatch(r"step-(0|[1-9]\d*)", os.path.basename(os.fspath(folder).rstrip(os.sep)))
    return int(m.group(1)) if m else None


def is_dcp_folder(path: str | os.PathLike) -> bool:
    """A complete DCP checkpoint: DCP writes ``.metadata`` last, after every shard."""
    return (Path(path) / ".metadata").is_file()


def has_safetensors(path: str | os.PathLike) -> bool:
    """Safetensors weights: ``*.safetensors`` files or a sharded checkpoint's ``model.safetensors.index.json``."""
    p = Path(path)
    return any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file()


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A Hugging Face model folder: ``config.json`` (the architecture) and safetensors weights."""
    return (Path(path) / "config.json").is_file() and has_safetensors(path)


def is_checkpoint_folder(path: str | os.PathLike) -> bool:
    """Weights a tool can load: a DCP checkpoint, a Hugging Face folder, or a trainer's
    ``checkpoint.last_save_in_hf`` step (safetensors without config.json; its run describes the architecture)."""
    return is_dcp_folder(path) or has_safetensors(path)


def step_folders(folder: str | os.PathLike, dcp_only: bool = False) -> dict[int, Path]:
    """{N: path} of the checkpoint folders in ``folder`` named exactly ``step-N`` ({} when ``folder`` is absent).

    Without ``dcp_only``: checkpoints of either format (:func:`is_checkpoint_folder`), what a tool picks a step
    from. With it: DCP checkpoints only (:func:`is_dcp_folder`), what the trainer resumes from and rotates
    (``keep_latest_k``): a Hugging Face export or ``last_save_in_hf`` step is not resumable and stays the user's,
    and a save still in flight (no ``.metadata`` yet) is neither counted nor deleted."""
    holds = is_dcp_folder if dcp_only else is_checkpoint_folder
    root = Path(folder)
    if not root.is_dir():
        return {}
    return {n: d for d in root.iterdir() if (n := step_of(d)) is not None and holds(d)}


def run_of(ckpt_dir: Path) -> Path | None:
    """The run folder of a checkpoint folder. A ``step-N`` folder belongs to the nearest of its parent and
    grandparent that holds the run's description (config.toml or train_args.json), else to ``<run>`` of
    ``<run>/checkpoint/step-N``, else to its parent (``OUT/step-0`` of attnlab/tools/import_hf.py). Any other folder
    belongs to a run only as ``<run>/checkpoint/<folder>``; None outside a run (e.g. an export)."""
    in_checkpoint = ckpt_dir.parent.parent if ckpt_dir.parent.name == CHECKPOINT_DIR else None
    if step_of(ckpt_dir) is None:
        return in_checkpoint
    for d in (ckpt_dir.parent, ckpt_dir.parent.parent):
        if (d / CONFIG_FILE).is_file() or (d / TRAIN_ARGS_FILE).is_file():
            return d
    return in_checkpoint or ckpt_dir.parent


def run_dir_of(ckpt_dir: Path) -> Path:
    """The folder whose run files describe ``ckpt_dir``: its run (:func:`run_of`), else its parent (a model-only
    folder outside a run, e.g. attnlab/tools/convert_to_parallax.py's output)."""
    return run_of(ckpt_dir) or ckpt_dir.parent


def resolve(path: str | os.PathLike, step: int | None = None) -> CheckpointRef:
    """The checkpoint ``path`` names: a run folder or its ``checkpoint/`` folder (the latest ``step-N``, or
    ``step-<step>``; :func:`step_folders`), a step folder, or a Hugging Face folder; its run is found from any of
    them (:func:`run_of`). Raises FileNotFoundError naming what was looked for."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{str(path)!r}: no such folder (expected a run folder, a step-N folder or a "
                                "Hugging Face folder)")
    if is_checkpoint_folder(p):
        if step is not None and step_of(p) != step:
            raise FileNotFoundError(f"--step {step} given but {str(path)!r} is itself a checkpoint folder; pass its "
                                    "run folder instead")
        return CheckpointRef(p, run_of(p), step_of(p))
    for folder in (p / CHECKPOINT_DIR, p):
        steps = step_folders(folder)
        if not steps:
            continue
        if step is None:
            step = max(steps)
        if step not in steps:
            raise FileNotFoundError(f"{str(path)!r}: no step-{step}; available steps: {sorted(steps)}")
        return CheckpointRef(steps[step], run_of(steps[step]), step)
    raise FileNotFoundError(f"{str(path)!r}: not a checkpoint folder (no .metadata, no safetensors weights) and no "
                            "step-N folder under it or under its checkpoint/ folder")


def save_tokenizer(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy the tokenizer files of folder ``src`` (those of :data:`TOKENIZER_FILES` present) into ``dst``
    (created, ordinary permissions); returns ``dst``. ``src`` must hold a tokenizer.json."""
    src, dst = Path(src), Path(dst)
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src}: no tokenizer.json")
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst


def check_tokenizer_fits(folder: str | os.PathLike, vocab_size: int,
                         fix: str = "use the tokenizer these weights were trained with (--tokenizer DIR)") -> None:
    """A tokenizer with more tokens than the model's ``vocab_size`` embedding rows cannot go with it (ordinary text
    indexes past the table): a ValueError naming the file, both sizes and ``fix``."""
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    n = Tokenizer.from_file(str(path)).get_vocab_size()
    if n > vocab_size:
        raise ValueError(f"{path}: {n} tokens, more than the model's {vocab_size} embedding rows; {fix}")


def write_run_files(dump_folder: str | os.PathLike, job_config, tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """What a run leaves in its ``dump_folder`` so tools rebuild it without its flags (call on one rank); returns
    the configuration file written:

    - ``config.toml``: every section of the resolved ``job_config`` (a JobConfig dataclass) as TOML; ``None``
      values have no TOML form and are left out (they are the defaults), ``job.config_file`` is dropped (the file
      stands alone). When ``config.toml`` is the ``job.config_file`` the run was started from, that file is the
      user's (comments and all, and a valid config for the tools) and stays byte-identical: the resolved
      configuration goes to ``config.resolved.toml`` beside it;
    - ``tokenizer/``: the tokenizer files of ``tokenizer_dir`` (when given and holding a tokenizer.json).
    """
    import dataclasses

    import tomli_w

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items() if v is not None}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return str(x) if isinstance(x, os.PathLike) else x

    cfg = plain(dataclasses.asdict(job_config))
    cfg.get("job", {}).pop("config_file", None)
    dump = Path(dump_folder)
    dump.mkdir(parents=True, exist_ok=True)
    target = dump / CONFIG_FILE
    given = job_config.job.config_file
    if given and target.is_file() and os.path.isfile(given) and os.path.samefile(given, target):
        target = dump / RESOLVED_CONFIG_FILE
    tmp = dump / f".{target.name}.tmp{os.getpid()}"
    tmp.write_text(tomli_w.dumps(cfg))
    os.replace(tmp, target)
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        save_tokenizer(tokenizer_dir, dump / TOKENIZER_DIR)
    return target


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of the file ``path``, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run_record(dump_folder: str | os.PathLike) -> dict[str, str | None] | None:
    """{path relative to ``dump_folder``: SHA-256 as the run last wrote it (None for ``metrics.jsonl``, which it
    appends to)} of the files the run in ``dump_folder`` wrote; None when the folder has no (readable) record:
    no run started there, or the run is of an older attnlab."""
    try:
        rec = json.loads((Path(dump_folder) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    files = rec.get("files") if isinstance(rec, dict) else None
    return files if isinstance(files, dict) else None


def record_run_files(dump_folder: str | os.PathLike, paths: list[str | os.PathLike]) -> None:
    """Add the files ``paths`` (under ``dump_folder``, just written by the run) to the run's record
    (:data:`RUN_RECORD`) with their digests, ``metrics.jsonl`` without one; call on one rank. The run replaces a
    file of its folder only while it is in the record with the same digest (attnlab/trainer/run_folder.py)."""
    dump = Path(dump_folder)
    files = run_record(dump) or {}
    for p in map(Path, paths):
        if p.is_file():
            files[str(p.relative_to(dump))] = None if p.name == METRICS_FILE else file_digest(p)
    tmp = dump / f".{RUN_RECORD}.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    os.replace(tmp, dump / RUN_RECORD)


@contextlib.contextmanager
def new_folder(dst: str | os.PathLike):
    """Write a new output folder atomically: yields a temporary sibling folder; on success it gets the
    permissions ``mkdir``/``open`` would give (:func:`ordinary_permissions`) and is renamed to ``dst``; on any
    failure it is removed, so ``dst`` is either complete or absent. Missing parent folders are created (as the
    README's ``convert_to_parallax RUN/checkpoint/step-N runs/converted/step-0`` needs)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        yield tmp
        ordinary_permissions(tmp)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ordinary_permissions(root: str | os.PathLike) -> None:
    """Give ``root`` and everything under it the modes ``mkdir``/``open`` would (0777/0666 & ~umask).
    ``tempfile.mkdtemp`` makes 0700 folders and safetensors writes 0600 files; an output folder renamed into
    place from them would otherwise be unreadable by the group."""
    umask = os.umask(0)
    os.umask(umask)
    for d, _, files in os.walk(root):
        os.chmod(d, 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(d, f), 0o666 & ~umask)
