"""The project's TOML sections, merged into torchtitan 0.2.2's ``JobConfig`` (custom-config mechanism).

Precedence: command line (``--section.key value``) > TOML file > the defaults below and torchtitan's.
Sections added or extended here: ``[model]`` (attention choice), ``[training]`` (``stop_after_step``,
``nonfinite_skips``, ``loss_chunk_tokens``), ``[checkpoint]`` (``partial_load``), ``[attention]`` (one sub-table per
registered mechanism, e.g. ``[attention.parallax]``, generated from the registry), ``[data]``, and the
optimizer/scheduler fields of ``attnlab/optim/config.py``. :func:`parse_config` reads argv into the merged
``JobConfig``, first importing torchtitan's ``[experimental] custom_import`` module (a user's own mechanism or
optimizer); :func:`validate_config` checks every key's type (from the dataclass annotations) and range once at
start, naming the key, the value and what is valid.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import traceback
import types
import typing
import warnings
from dataclasses import dataclass, field

import tomli  # a dependency on every Python (tomllib is 3.11+)

from attnlab import attention, configs
from attnlab.attention.registry import REGISTRY
from attnlab.optim import config as optim_config
from attnlab.optim.registry import get_optimizer


@dataclass
class Model:
    name: str = "qwen3_attn"
    """Train spec name; this project registers "qwen3_attn"."""
    flavor: str = "debug"
    """Size (attnlab/models/args.py): debug (1.3M parameters with the embedded 4096-token vocabulary, CPU) | repl-45M |
    repl-68M (small-scale replication, 8k vocabulary) | 0.6B | 0.6B-T24 (Transformer†) | 0.6B-P64 (Parallax†) | 0.6B-ffn3712 | 1.7B |
    1.7B-T24 | 1.7B-P64 | 1.7B-ffn7424 (the paper's Qwen3 sizes); the keys below override its dimensions."""
    dim: int = 0
    """Model width (0 = flavor's)."""
    n_layers: int = 0
    """Number of layers (0 = flavor's)."""
    n_heads: int = 0
    """Query heads (0 = flavor's); a multiple of n_kv_heads."""
    n_kv_heads: int = 0
    """Key/value heads (0 = flavor's); divides n_heads."""
    head_dim: int = 0
    """Per-head width (0 = flavor's); independent of dim (q: dim → n_heads·head_dim, as Qwen3)."""
    hidden_dim: int = 0
    """Feed-forward (SwiGLU) inner width (0 = flavor's)."""
    attention: str = "softmax"
    """Token mixer of every layer (``python train.py --list-attention`` lists them)."""
    layer_pattern: list[str] = field(default_factory=list)
    """Mechanisms repeated over depth, e.g. ["gdn", "gdn", "gdn", "parallax"]; empty = ``attention`` everywhere."""
    attn_mask_type: str = "causal"
    """"causal": each row is one sequence; "block_causal": packed documents never attend across boundaries."""
    vocab_size: int = 0
    """Override the flavor's vocabulary size (0 = flavor's); must cover the tokenizer's vocabulary."""
    rope_theta: float = 0.0
    """Override the RoPE base (0 = flavor's, 1e6)."""
    tie_embeddings: bool | None = None
    """Override weight tying of input and output embeddings (None = flavor's; the paper ties)."""


def _attention_section() -> type:
    """``[attention]``: ``impl`` plus one sub-table per registered mechanism, built from the registry as it is when
    called (by :func:`parse_config`), so a mechanism registered after this module was imported has its table too."""
    fields = [("impl", str, field(default="auto")), ("sac_save", bool, field(default=True))]
    fields += [(name, mech.options, field(default_factory=mech.options)) for name, mech in sorted(REGISTRY.items())]
    cls = dataclasses.make_dataclass("Attention", fields)
    # a class made at run time has no source for tyro to read field docstrings from: Google-style attributes
    cls.__doc__ = """Attention options: ``impl`` and one ``[attention.<mechanism>]`` table per mechanism.

    Attributes:
        impl: Kernel choice of every mechanism: "auto" picks per device (Triton/fla on GPU, the chunked PyTorch
            form on CPU); "reference" forces the readable PyTorch oracle; some mechanisms take more (their
            ``--list-attention`` entry and docs/mechanisms.md name them).
        sac_save: Under selective activation checkpointing ("op" mode), keep the outputs of the attention custom
            ops (true) or recompute them in the backward (false: less activation memory, one more forward of
            each op per step). benchmarks/README.md has both for GDN and KDA.
    """
    return cls


@dataclass
class Data:
    text_field: str = "text"
    """Column holding the text in JSONL/parquet/hub datasets."""
    hub_split: str = "train"
    """Split to read from a hub dataset."""
    hub_subset: str = ""
    """Subset (config name) of a hub dataset, e.g. "en" for allenai/c4 or "sample-10BT" for
    HuggingFaceFW/fineweb-edu; empty = the dataset's default."""
    streaming: bool | None = None
    """Stream the dataset (None = stream hub datasets, load local files as Arrow map-style datasets)."""
    val_every: int = 100
    """When ``validation.dataset_path`` is empty, every ``val_every``-th document is held out for validation."""
    embedded_vocab_size: int = 4096
    """Vocabulary of the BPE tokenizer trained for the embedded corpus."""
    cache_dir: str = ".cache/attnlab"
    """Where the embedded corpus and its tokenizer are built once and reused."""
    max_bad_records: int = 0
    """Malformed records (not a JSON object, no ``text_field`` string, broken UTF-8) that are skipped with a count
    before the run stops; 0 = the first one stops the run, naming the file and line. Local files are checked
    record by record before step 1, so a bad record never stops a run mid-training."""


@dataclass
class Training:
    stop_after_step: int = 0
    """Stop after this step as if the job were preempted (0 = run to ``training.steps``); the schedule still
    spans ``training.steps``, and a checkpoint is written at the stop step so the same command resumes."""
    nonfinite_skips: int = 0
    """Steps with a non-finite loss or gradient norm that are skipped (no optimizer update) before the run stops;
    0 = stop at the first one. 0 costs no extra host sync (checked at log steps and before every checkpoint save);
    > 0 decides before every optimizer step, one host sync and all-reduce per step."""
    loss_chunk_tokens: int = 0
    """Compute the training loss N tokens at a time (0 = off: torchtitan's loss of the whole [batch, seq_len,
    vocab] logits). The logits of one chunk exist at a time, so the loss needs O(N·vocab) memory instead of
    O(tokens·vocab): Qwen3's 151,936-entry head at 65,536 tokens a rank makes 18.5 GiB of bf16 logits (and twice
    that in their fp32 upcast); a chunk peaks at about 6·N·vocab bytes in bf16, 3.5 GiB at N = 4096
    (attnlab/models/loss.py). Same loss and gradients, no recomputation; validation, evaluation and decoding keep the full
    logits. The head must stay out of float8/MX conversion (``filter_fqns`` holds "output")."""


@dataclass
class Checkpoint:
    partial_load: bool = False
    """Resume from a checkpoint whose model keys differ from the model built: keys missing from the checkpoint
    keep their initialisation, keys the model lacks are ignored (both listed in the log). Off: any difference is
    an error naming the keys."""


@dataclass
class Metrics:
    wandb_project: str = "attnlab"
    """wandb project of the run (with ``metrics.enable_wandb``); its files go to ``<job.dump_folder>/wandb/``."""
    wandb_run_name: str = ""
    """wandb run name; empty = the name of ``job.dump_folder``."""


def job_config_class() -> type:
    """The project's sections as one dataclass (merged into torchtitan's by :func:`parse_config`)."""
    section = _attention_section()
    return dataclasses.make_dataclass("JobConfig", [
        ("model", Model, field(default_factory=Model)),
        ("attention", section, field(default_factory=section)),
        ("data", Data, field(default_factory=Data)),
        ("training", Training, field(default_factory=Training)),
        ("checkpoint", Checkpoint, field(default_factory=Checkpoint)),
        ("metrics", Metrics, field(default_factory=Metrics)),
        ("optimizer", optim_config.Optimizer, field(default_factory=optim_config.Optimizer)),
        ("lr_scheduler", optim_config.LRScheduler, field(default_factory=optim_config.LRScheduler)),
    ])


DEFAULT_CONFIG = str(configs.path("debug_cpu"))


_CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")


def names_config_file(argv: list[str]) -> bool:
    """Whether a train.py argv names its TOML (``--job.config_file`` or ``--job.config-file``, ``=`` or not)."""
    return any(a.split("=")[0] in _CONFIG_FILE_FLAGS for a in argv)


def resolve_config_file(argv: list[str]) -> list[str]:
    """``argv`` with its ``--job.config_file`` value made a file path: a file as given, or the shipped
    configuration it names (``paper/qwen3_0.6b_parallax``, :mod:`attnlab.configs`)."""
    out = list(argv)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag in _CONFIG_FILE_FLAGS:
            if eq:
                out[i] = f"{flag}={configs.resolve(value)}"
            elif i + 1 < len(out):
                out[i + 1] = configs.resolve(out[i + 1])
    return out


_CUSTOM_IMPORT_FLAGS = ("--experimental.custom_import", "--experimental.custom-import")


def custom_import_of(argv: list[str], toml_values: dict | None) -> str:
    """``experimental.custom_import`` of a train.py argv: its last value on the command line (``--experimental.
    custom_import X`` or ``=X``), else the TOML's (``toml_values``), else ""."""
    found = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in _CUSTOM_IMPORT_FLAGS:
            found = value if eq else argv[i + 1] if i + 1 < len(argv) else ""
    if found is None:
        section = (toml_values or {}).get("experimental")
        found = section.get("custom_import", "") if isinstance(section, dict) else ""
    if not isinstance(found, str):
        raise ValueError(f"experimental.custom_import={found!r}: expected a string (a dotted module name)")
    return found


def import_custom_module(name: str) -> None:
    """Import ``experimental.custom_import`` (a dotted module name on the Python path), the user's module that
    registers a mechanism (``register_attention``) or an optimizer (``register_optimizer``). It runs before the
    config class is built, so the ``[attention.<name>]`` table of a mechanism it registers exists; torchtitan's
    Trainer imports it again later, which finds it imported. A failure is one line naming the key, the module and
    the error's last line."""
    try:
        importlib.import_module(name)
    except Exception as e:  # the user's module may raise anything while it runs
        why = traceback.format_exception_only(e)[-1].strip()
        raise ValueError(f"experimental.custom_import={name!r}: importing it failed ({why}); it must be a dotted "
                         "module name importable from the Python path (PYTHONPATH)") from None


def _read_toml(argv: list[str]) -> dict | None:
    """The TOML that a (resolved) argv names first with ``--job.config_file``, parsed, as torchtitan's
    ``ConfigManager`` reads it; None when it names none."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in _CONFIG_FILE_FLAGS and (eq or i + 1 < len(argv)):
            with open(value if eq else argv[i + 1], "rb") as f:
                return tomli.load(f)
    return None


def _check_keys(cls, data: dict, prefix: str = "") -> None:
    """Reject unknown TOML keys, naming the section, the key and the valid keys."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in fields:
            section = f"[{prefix}]" if prefix else "top level"
            raise ValueError(f"unknown config key {key!r} in {section}; valid keys: {sorted(fields)}")
        name = f"{prefix}.{key}" if prefix else key
        if dataclasses.is_dataclass(fields[key].type) and not isinstance(value, dict):
            raise ValueError(f"{name}={value!r}: expected a table [{name}] of keys (tyro would ignore the value)")
        _check_keys(fields[key].type, value, name)


def merge_config_classes(base: type, custom: type) -> type:
    """torchtitan's ``ConfigManager._merge_configs`` (fields of both; same-named sections merged recursively,
    ``custom`` wins otherwise) with ``custom`` among the merged class's bases: tyro reads field docstrings from
    the classes of the MRO, and torchtitan's merged class inherits from ``base`` only, so ``--help`` showed no
    description for this project's keys."""
    b_map = {f.name: f for f in dataclasses.fields(base)}
    c_map = {f.name: f for f in dataclasses.fields(custom)}
    result = []
    for name, f in b_map.items():
        c = c_map.get(name)
        if c is not None and dataclasses.is_dataclass(f.type) and dataclasses.is_dataclass(c.type):
            m_type = merge_config_classes(f.type, c.type)
            result.append((name, m_type, field(default_factory=m_type)))
        else:
            result.append((name, (c or f).type, c or f))
    result += [(name, f.type, f) for name, f in c_map.items() if name not in b_map]
    bases = (custom,) if issubclass(custom, base) else (custom, base)
    return dataclasses.make_dataclass(f"Merged{base.__name__}", result, bases=bases)


_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _bool_field(cls, dotted: str):
    """The annotation of the (nested) field ``dotted`` ("validation.enable", "attention.parallax.rope_on_rho")
    of dataclass ``cls`` when it is ``bool`` or ``bool | None``; None otherwise."""
    tp = cls
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        hints = typing.get_type_hints(tp)
        names = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(tp)}
        name = names.get(part.replace("_", "-"))
        if name is None:
            return None
        tp = hints[name]
    return tp if tp is bool or (set(typing.get_args(tp)) == {bool, type(None)}) else None


def bool_values_as_flags(argv: list[str], cls) -> list[str]:
    """``--section.key true|false|1|0`` (any case; also ``=value``) for a boolean key of ``cls`` becomes tyro's
    ``--section.key`` / ``--section.no-key`` (``True``/``False`` for ``bool | None`` keys), so every key takes
    ``--section.key value`` as the README says. Another word after a boolean key is an error naming the key;
    the bare flag forms pass unchanged."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        flag, eq, value = arg.partition("=")
        tp = _bool_field(cls, flag[2:]) if flag.startswith("--") and not flag.startswith("---") else None
        if tp is None:
            out.append(arg)
            continue
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                out.append(arg)
                continue
            value, i = argv[i], i + 1
        word = value.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"{flag[2:]}={value!r}: expected a boolean (true/false/1/0, or the bare flag {flag} / "
                             f"{flag.rsplit('.', 1)[0]}.no-{flag.rsplit('.', 1)[1]})")
        if tp is bool:
            section, key = flag.rsplit(".", 1)
            out.append(flag if word in _TRUE else f"{section}.no-{key}")
        else:
            out += [flag, "True" if word in _TRUE else "False"]
    return out


def parse_config(argv: list[str]):
    """Parse ``argv`` (CLI > TOML > defaults) into the merged JobConfig and validate it; first imports the module
    ``experimental.custom_import`` names (:func:`import_custom_module`), so a run, and every tool that rebuilds
    one from its config.toml, has the user's mechanisms and optimizers registered."""
    from torchtitan.config import ConfigManager
    from torchtitan.config import JobConfig as TitanJobConfig

    from attnlab.data.loader import EMBEDDED

    class Manager(ConfigManager):
        def _validate_config(self) -> None:
            m = self.config.model
            if m.hf_assets_path != EMBEDDED or m.tokenizer_path:
                return super()._validate_config()
            # "embedded" names the built-in corpus's tokenizer (data.loader), not a folder: torchtitan's
            # "HF assets path does not exist" warning does not apply
            m.hf_assets_path = os.curdir
            try:
                super()._validate_config()
            finally:
                m.hf_assets_path = EMBEDDED

    argv = resolve_config_file(argv)
    toml_values = _read_toml(argv)
    module = custom_import_of(argv, toml_values)
    if module:  # before the config class is built: it may register a mechanism, whose table the class needs
        import_custom_module(module)
    merged = merge_config_classes(TitanJobConfig, job_config_class())
    argv = bool_values_as_flags(argv, merged)
    manager = Manager(config_cls=merged)
    if toml_values:
        _check_keys(merged, toml_values)
    with warnings.catch_warnings():
        # TOML has no tuples: a tuple-typed key (e.g. attention.gdn.A_init_range) reads back from a run's
        # config.toml as a list, which tyro warns about; check_types validates its length and item types instead
        warnings.filterwarnings("ignore", message=r"The field .* is annotated with type `tuple", category=UserWarning)
        cfg = manager.parse_args(argv)
    cfg.model.name = cfg.model.name or "qwen3_attn"
    if isinstance(cfg.model.converters, list):  # `--model.converters ""` turns float8 off
        cfg.model.converters = [c for c in cfg.model.converters if c]
    validate_config(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------- types

def _describe(tp) -> str:
    """What a value of annotation ``tp`` looks like, in TOML words."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return f"one of {list(args)}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin in (list, tuple):
        plural = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
        inner = ", ".join(plural.get(a, _describe(a)) for a in dict.fromkeys(args) if a is not Ellipsis) or "values"
        return f"a list of {inner}" + (f" ({len(args)} items)" if origin is tuple and Ellipsis not in args else "")
    if dataclasses.is_dataclass(tp):
        return "a table of keys"
    return {bool: "a boolean (true/false, unquoted)", int: "an integer", float: "a number", str: "a string",
            type(None): "unset (None)"}.get(tp, getattr(tp, "__name__", str(tp)))


def _fits(value, tp) -> bool:
    """Does ``value`` (as TOML/tyro produced it) have annotation ``tp``? Unknown annotations pass."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any or isinstance(tp, (str, typing.TypeVar)):
        return True
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return not args or (len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args)))
    if origin is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(tp):
        return dataclasses.is_dataclass(value) and not isinstance(value, type)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def check_types(obj, prefix: str = "") -> None:
    """Every field of the dataclass ``obj`` (recursively) against its annotation; raises naming the key, the
    value and the expected type. TOML values reach the config unconverted (``rope_on_rho = "false"`` is a
    string, ``steps = 10.7`` a float), so this is where they are caught."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        tp = hints.get(f.name, f.type)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_types(value, key + ".")
        elif not _fits(value, tp):
            raise ValueError(f"{key}={value!r} ({type(value).__name__}): expected {_describe(tp)}")


_POS, _NONNEG, _UNIT = "> 0", ">= 0", "in [0, 1]"
# optimizer.lr may be 0 (a run that must not move the weights, e.g. a save-format round trip), as torch's optimizers
# allow; a negative lr is rejected here, naming the key, instead of inside torch.
RANGES: dict[str, str] = {
    "training.steps": _POS, "training.seq_len": _POS, "training.local_batch_size": _POS,
    "training.max_norm": _POS, "training.stop_after_step": _NONNEG, "training.nonfinite_skips": _NONNEG,
    "training.gc_freq": _POS, "training.loss_chunk_tokens": _NONNEG,
    "optimizer.lr": _NONNEG, "optimizer.weight_decay": _NONNEG, "optimizer.eps": _POS,
    "optimizer.beta1": "in [0, 1)", "optimizer.beta2": "in [0, 1)", "optimizer.adam_beta1": "in [0, 1)",
    "optimizer.adam_beta2": "in [0, 1)", "optimizer.adam_eps": _POS, "optimizer.muon_momentum": "in [0, 1)",
    "optimizer.muon_ns_steps": _POS, "optimizer.muon_eps": _POS, "optimizer.muon_min_dim": _NONNEG,
    "optimizer.adam_embed_lr_mult": _NONNEG, "optimizer.adam_head_lr_mult": _NONNEG,
    "optimizer.adam_norm_lr_mult": _NONNEG, "optimizer.adam_vector_lr_mult": _NONNEG,
    "optimizer.lr_warmup_steps": _NONNEG,
    "lr_scheduler.warmup_steps": _NONNEG, "lr_scheduler.total_steps": _POS, "lr_scheduler.decay_ratio": _UNIT,
    "lr_scheduler.min_lr_factor": _UNIT, "lr_scheduler.warmup_fraction": _UNIT, "lr_scheduler.decay_start": _UNIT,
    "lr_scheduler.wd_anneal_gamma": _NONNEG,
    "data.val_every": _NONNEG, "data.embedded_vocab_size": _POS, "data.max_bad_records": _NONNEG,
    "checkpoint.interval": _POS, "checkpoint.keep_latest_k": "0 or >= 2", "checkpoint.load_step": ">= -1",
    "metrics.log_freq": _POS, "validation.freq": _POS, "validation.steps": "-1 or > 0",
    "validation.seq_len": _POS, "validation.local_batch_size": _POS,
    "model.vocab_size": _NONNEG, "model.rope_theta": _NONNEG, "model.dim": _NONNEG, "model.n_layers": _NONNEG,
    "model.n_heads": _NONNEG, "model.n_kv_heads": _NONNEG, "model.head_dim": _NONNEG, "model.hidden_dim": _NONNEG,
}
"""Range of numeric keys (None = unset passes); anything outside is an error naming the key."""

_RULES = {
    _POS: lambda v: v > 0, _NONNEG: lambda v: v >= 0, _UNIT: lambda v: 0 <= v <= 1,
    "in [0, 1)": lambda v: 0 <= v < 1, "0 or >= 2": lambda v: v == 0 or v >= 2, ">= -1": lambda v: v >= -1,
    "-1 or > 0": lambda v: v == -1 or v > 0,
}


def check_ranges(job_config) -> None:
    for key, rule in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(job_config, section, None), name, None)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value) or not _RULES[rule](value):
            raise ValueError(f"{key}={value!r}: must be {rule}")


def check_context_parallel(job_config) -> None:
    """``parallelism.context_parallel_degree = N`` (attnlab/attention/cp.py): every layer's mechanism runs under it, the
    sequences split into 2N equal chunks, no kernel or compile path that cannot take a shard of a row."""
    cp, m = job_config.parallelism.context_parallel_degree, job_config.model
    key = "parallelism.context_parallel_degree"
    if cp < 1:
        raise ValueError(f"{key}={cp}: must be >= 1")
    supported = sorted(n for n, e in REGISTRY.items() if getattr(e.cls, "context_parallel", False))
    for name in sorted({m.attention, *m.layer_pattern}):
        if name not in supported:
            raise ValueError(f"{key}={cp}: mechanism {name!r} does not run under context parallelism yet; "
                             f"supported: {supported}")
    for section in ("training", "validation"):
        seq_len = getattr(job_config, section).seq_len
        if seq_len % (2 * cp):
            raise ValueError(f"{section}.seq_len={seq_len}: must be a multiple of 2 x {key} = {2 * cp} (each rank "
                             "holds two equal chunks of every sequence)")
    if job_config.compile.enable and "model" in job_config.compile.components:
        raise ValueError(f"compile.enable with {key}={cp}: the blocks compile as one graph each, and the key/value "
                         "all-gather breaks it; set compile.enable = false")


def check_loss_chunks(job_config) -> None:
    """``training.loss_chunk_tokens`` runs the head's matmuls itself (attnlab/models/loss.py), in the compute dtype: a float8
    or MX converter must leave the head alone, i.e. have it in its ``filter_fqns`` (matched as torchtitan does: an
    entry contained in the name "output")."""
    n, converters = job_config.training.loss_chunk_tokens, job_config.model.converters
    for name in ("quantize.linear.float8", "quantize.linear.mx"):
        filters = functools.reduce(getattr, name.split("."), job_config).filter_fqns
        if name in converters and not any(f in "output" for f in filters):
            raise ValueError(f"training.loss_chunk_tokens={n} with model.converters {name!r}: the chunked loss runs "
                             f"the head's matmuls itself and cannot run it in low precision; add \"output\" to "
                             f"{name}.filter_fqns, or set training.loss_chunk_tokens = 0")


def validate_config(job_config) -> None:
    """Fail before training starts, naming the key, the value and what is valid."""
    check_types(job_config)
    check_ranges(job_config)
    m = job_config.model
    for key, name in [("model.attention", m.attention)] + [
        (f"model.layer_pattern[{i}]", n) for i, n in enumerate(m.layer_pattern)
    ]:
        attention.get_mechanism(name, key)
    get_optimizer(job_config.optimizer.name)
    if m.attn_mask_type not in ("causal", "block_causal"):
        raise ValueError(f"model.attn_mask_type={m.attn_mask_type!r}; choose from ['causal', 'block_causal']")
    f8 = job_config.quantize.linear.float8
    if "quantize.linear.float8" in job_config.model.converters and f8.recipe_name and f8.enable_fsdp_float8_all_gather:
        raise ValueError(f"quantize.linear.float8.recipe_name={f8.recipe_name!r} cannot be combined with "
                         "enable_fsdp_float8_all_gather=true in torchtitan 0.2.2; unset recipe_name for tensorwise "
                         "scaling with float8 all-gather")
    for section in ("training", "validation"):
        workers = getattr(job_config, section).dataloader.num_workers
        if workers > 1:
            raise ValueError(
                f"{section}.dataloader.num_workers={workers}: must be 0 or 1. The packed dataset is one stateful "
                "stream per data-parallel rank, so each further worker would read every document again (repeated "
                "batches); 1 tokenizes in a worker process, off the training loop")
    p = job_config.parallelism
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree"):
        if getattr(p, key) != 1:
            raise ValueError(f"parallelism.{key}={getattr(p, key)}: this framework supports FSDP/HSDP and context "
                             "parallelism; set it to 1")
    if p.context_parallel_degree != 1:
        check_context_parallel(job_config)
    if job_config.training.loss_chunk_tokens:
        check_loss_chunks(job_config)
