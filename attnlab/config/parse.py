"""argv and TOML into the merged ``JobConfig``: precedence command line > TOML > defaults, a shipped config by name,
the user's ``[experimental] custom_import`` module imported first, unknown keys refused, booleans as values."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import sys
import traceback
import typing
import warnings
from dataclasses import field

import tomli  # a dependency on every Python (tomllib is 3.11+)

from attnlab import configs
from attnlab.config.checks import validate_config
from attnlab.config.sections import job_config_class


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


def import_requested_module(argv: list[str]) -> dict | None:
    """Import the module ``experimental.custom_import`` names in ``argv`` (its ``--job.config_file`` resolved) or in
    the TOML it names, if any; returns that TOML's values (None without one)."""
    toml_values = _read_toml(argv)
    module = custom_import_of(argv, toml_values)
    if module:
        import_custom_module(module)
    return toml_values


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


def tyro_error_line(text: str) -> str:
    """tyro's boxed error (a title, the message wrapped over lines, then a hint below a rule) as its message on one
    line, e.g. "Error parsing --training.steps: invalid literal for int() with base 10: 'abc'"."""
    body = []
    for line in text.splitlines()[1:]:
        line = line.strip().strip("│╰╯─").strip()
        if not line or set(line) <= {"─", " "}:
            if body:
                break
            continue
        body.append(line)
    return " ".join(" ".join(body).split()) or text.strip()


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
    toml_values = import_requested_module(argv)  # before the class is built: it needs the user's mechanisms' tables
    merged = merge_config_classes(TitanJobConfig, job_config_class())
    argv = bool_values_as_flags(argv, merged)
    manager = Manager(config_cls=merged)
    if toml_values:
        _check_keys(merged, toml_values)
    with warnings.catch_warnings():
        # TOML has no tuples: a tuple-typed key (e.g. attention.gdn.A_init_range) reads back from a run's
        # config.toml as a list, which tyro warns about; check_types validates its length and item types instead
        warnings.filterwarnings("ignore", message=r"The field .* is annotated with type `tuple", category=UserWarning)
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured):
                cfg = manager.parse_args(argv)
        except SystemExit as e:  # tyro's boxed message for a flag it cannot parse, as one line naming the flag
            if e.code:
                raise ValueError(tyro_error_line(captured.getvalue())) from None
            sys.stderr.write(captured.getvalue())
            raise
        sys.stderr.write(captured.getvalue())
    cfg.model.name = cfg.model.name or "qwen3_attn"
    if isinstance(cfg.model.converters, list):  # `--model.converters ""` turns float8 off
        cfg.model.converters = [c for c in cfg.model.converters if c]
    validate_config(cfg)
    return cfg
