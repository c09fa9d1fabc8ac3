"""The option harness: every configuration key (the merged ``JobConfig``, every registered mechanism's table included)
and every option of every tool, enumerated from their declarations, tried with bad values.

Each attempt either passes with a documented meaning (the rule declared next to the key, or the words of the tool
option's ``type=`` function, say the value is valid) or fails with exactly one line naming the key or flag, never a
traceback, before any work. A key or flag without a declared rule, and not listed as taking any value with a reason,
fails :func:`test_every_key_declares_its_valid_values` / :func:`test_every_tool_option_declares_its_valid_values`:
a new option is covered the day it is added.

The default suite runs the checks in process (the validation ``python -m attnlab.train`` runs before anything
starts, and each tool's ``parse_args``) plus two real launches, a run and a tool, that show the command line prints
what the in-process check raises; more launches, and every key through the command line, are ``-m slow``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import math
import pkgutil
import subprocess
import sys
import types
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnlab.tools
from attnlab.config import DEFAULT_CONFIG, checks, parse_config, rules
from attnlab.tools import common

BAD_INTS = [0, -1, 10**30, 1.5, "7", True]
BAD_FLOATS = [0.0, -1.0, 1e300, math.nan, math.inf, -math.inf, "0.1", True]
BAD_TEXT = ["", "/nonexistent/x", "FILE", "DIR", 1]
BAD_LISTS = [[], [""], ["/nonexistent/x"], "x", [1]]
BAD_VALUES = {int: BAD_INTS, float: BAD_FLOATS, str: BAD_TEXT, bool: ["true", 1], list: BAD_LISTS,
              tuple: [(), (math.nan, 1.0), ("x", 1.0), (1.0,)]}
"""Bad values by type: 0, -1, huge, NaN/±inf, empty, the wrong type, a file where a folder is expected and the
reverse ("FILE" and "DIR" stand for an existing file and folder)."""


@pytest.fixture(scope="module")
def cfg():
    return parse_config(["--job.config_file", DEFAULT_CONFIG])


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("harness")
    (d / "a_file.txt").write_text("x")
    return {"FILE": str(d / "a_file.txt"), "DIR": str(d)}


def _base(tp):
    """The annotation without its None option: ``int | None`` -> int."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp


def type_is_the_rule(tp) -> bool:
    """A boolean or a ``Literal`` key: its type is its whole rule (the type check names the valid values)."""
    tp = _base(tp)
    return tp is bool or typing.get_origin(tp) is typing.Literal


def bad_values(tp) -> list:
    tp = _base(tp)
    if typing.get_origin(tp) is typing.Literal:
        return ["not-a-choice", 1]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # e.g. float | int, list[str] | str
        return [v for a in typing.get_args(tp) for v in bad_values(a)]
    return BAD_VALUES.get(typing.get_origin(tp) or tp, BAD_TEXT)


def validate(cfg, launch_checks: bool = True) -> None:
    """Everything a run checks before it builds anything (``--preflight`` without ``launch_checks``, which a
    preflight only notes), on one process without a GPU."""
    checks.validate_config(cfg)
    if launch_checks:
        checks.check_world_size(cfg, 1)
        checks.check_float8_device(cfg, None)


def attempt(cfg, key: str, value, paths, launch_checks: bool = True) -> str | None:
    """Set ``key`` to ``value`` (restored after), validate; None if it passes, else the error message. Anything but
    a ValueError propagates (a traceback is a failure of the harness)."""
    value = paths.get(value, value) if isinstance(value, str) else value
    *parents, name = key.split(".")
    section = cfg
    for p in parents:
        section = getattr(section, p)
    old = getattr(section, name)
    setattr(section, name, value)
    try:
        validate(cfg, launch_checks)
    except ValueError as e:
        return str(e)
    finally:
        setattr(section, name, old)
    return None


def config_keys(cfg):
    return list(checks.iter_keys(type(cfg)))


def test_every_key_declares_its_valid_values(cfg):
    """Each key has a rule next to its field (metadata "valid"), in checks.TITAN_RULES for torchtitan's, or its type
    is the rule (booleans, Literal); each rule is one this harness can check."""
    missing = [k for k, tp, f in config_keys(cfg) if checks.rule_for(k, f) is None and not type_is_the_rule(tp)]
    assert not missing, f"keys without a declared rule (metadata={{'valid': ...}} or a TITAN_RULES entry): {missing}"
    for k, _, f in config_keys(cfg):
        if checks.rule_for(k, f):
            rules.parse_rule(checks.rule_for(k, f))
    titan = {k for k, _, f in config_keys(cfg) if not rules.rule_of(f)}
    assert set(checks.TITAN_RULES) <= titan, f"TITAN_RULES names keys that are not torchtitan's: " \
                                            f"{sorted(set(checks.TITAN_RULES) - titan)}"


def test_every_key_refuses_bad_values_in_one_line(cfg, paths):
    """Every key x its bad values: passes only where the key's declared rule and type say the value is valid, and
    otherwise fails with one line naming the key."""
    tried, refused, wrong = 0, 0, []
    for key, tp, f in config_keys(cfg):
        rule = checks.rule_for(key, f)
        for value in bad_values(tp):
            tried += 1
            msg = attempt(cfg, key, value, paths)
            shown = paths.get(value, value) if isinstance(value, str) else value
            if msg is None:
                try:  # passed: the declaration must call it valid
                    checks.check_type(key, shown, tp)
                    if rule:
                        rules.check_value(key, shown, rule, cfg)
                except ValueError as e:
                    wrong.append(f"{key}={shown!r} passed, but its declaration refuses it: {e}")
                continue
            refused += 1
            if "\n" in msg or key not in msg:
                wrong.append(f"{key}={shown!r}: message not one line naming the key: {msg!r}")
    assert not wrong, "\n".join(wrong)
    assert tried > 1000 and refused > tried // 2, (tried, refused)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_numeric_keys_accept_exactly_what_they_declare(cfg, paths, data):
    """Random numbers for random numeric keys: validation passes exactly when the declared rule does."""
    numeric = [(k, tp, f) for k, tp, f in config_keys(cfg) if _base(tp) in (int, float)]
    key, tp, f = data.draw(st.sampled_from(numeric))
    value = data.draw(st.integers(-10**6, 10**6) if _base(tp) is int else
                      st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5).map(float))
    rule = checks.rule_for(key, f)
    try:
        rules.check_value(key, value, rule, cfg)
        valid = True
    except ValueError:
        valid = False
    msg = attempt(cfg, key, value, paths)
    if valid:  # only a rule across keys may refuse it (e.g. a degree against the one process here)
        assert msg is None or "\n" not in msg, (key, value, msg)
    else:
        assert msg is not None and key in msg and "\n" not in msg, (key, value, msg)


# ---------------------------------------------------------------------------------------------- cross-key rules

@pytest.mark.parametrize("key, value, expect", [
    ("model.layer_pattern", ["softmax"] * 4 + ["parallax"], "model.layer_pattern has 5 entries"),
    ("parallelism.context_parallel_degree", 2, "parallelism.context_parallel_degree=2"),
    ("parallelism.data_parallel_shard_degree", 2, "parallelism.data_parallel_shard_degree=2"),
    ("parallelism.data_parallel_replicate_degree", 2, "parallelism.data_parallel_replicate_degree=2"),
    ("model.converters", ["quantize.linear.float8"], "compute capability >= 8.9"),
    ("training.global_batch_size", 12, "training.global_batch_size=12"),
])
def test_cross_key_rules_refuse_in_one_line(cfg, paths, key, value, expect):
    """Lengths against n_layers, degrees against the processes launched (one here), float8 against the device."""
    cfg.model.n_layers, old = 4, cfg.model.n_layers
    try:
        msg = attempt(cfg, key, value, paths)
    finally:
        cfg.model.n_layers = old
    assert msg is not None and expect in msg and "\n" not in msg


def test_float8_passes_where_the_device_runs_it(cfg):
    cfg.model.converters = ["quantize.linear.float8"]
    try:
        checks.check_float8_device(cfg, (9, 0))
        cfg.quantize.linear.float8.emulate = True
        checks.check_float8_device(cfg, None)
    finally:
        cfg.model.converters, cfg.quantize.linear.float8.emulate = [], False


# ---------------------------------------------------------------------------------------------- tools

ANY_VALUE = {
    ("analyze", "data"): "local file, folder, glob or hub dataset: the loader names one it cannot read",
    ("eval_ppl", "data"): "local file, folder, glob or hub dataset: the loader names one it cannot read",
    ("eval_ppl", "edges"): "a comma list checked against the sequence length (parse_edges), naming --edges",
    ("passkey", "lengths"): "a comma list checked against the run's context, naming --lengths",
    ("passkey", "depths"): "a comma list checked to lie in [0, 1], naming --depths",
    ("generate", "prompt"): "any text is a prompt",
    ("generate", "tokenizer"): "a tokenizer folder or 'ids'; loading names a folder without tokenizer.json",
    ("import_hf", "base"): "a TOML file or a shipped configuration's name, resolved naming it",
    ("eval_downstream", "tasks"): "lm-eval task names; lm-eval names an unknown task",
    ("eval_downstream", "batch_size"): "an integer or 'auto', lm-eval's own --batch_size",
    ("fetch_tokenizer", "repo"): "a hub repository id; the hub names one that does not exist",
    ("fetch_tokenizer", "revision"): "a branch, tag or commit of that repository",
    ("plot_ppl", "labels"): "any comma list; one label per run is checked, naming --labels",
    ("smoke_configs", "data"): "training data as training.dataset_path takes it, checked by each run's preflight",
    ("smoke_configs", "only"): "fnmatch patterns; a pattern that selects nothing is reported",
    ("smoke_configs", "flavor"): "a model.flavor, checked by each run's preflight",
    ("synthetic", "attention"): "registered mechanisms, checked against the registry naming --attention",
    ("synthetic", "tasks"): "task names, checked against the task list naming --tasks",
    ("train_tokenizer", "files"): "files, folders or globs; a pattern matching no file is an error naming it",
    ("train_tokenizer", "text_field"): "a column name; a file without it is an error naming the file",
    ("multigpu_check", "nprocs"): "a comma list of process counts, parsed naming --nprocs",
    ("multigpu_check", "resume"): "a:b pairs, parsed naming --resume",
    ("multigpu_check", "flavor"): "a model.flavor, checked by each launch's preflight",
    ("multigpu_check", "attention"): "a model.attention, checked by each launch's preflight",
    ("multigpu_check", "optimizer"): "an optimizer.name, checked by each launch's preflight",
    ("multigpu_check", "data"): "training data as training.dataset_path takes it, checked by each launch's preflight",
}
"""Tool options that take any text (tool, argparse dest) -> why and who checks it."""


def tool_modules() -> dict[str, object]:
    """Every tool of ``attnlab/tools`` with a command line (``main``), by name."""
    out = {}
    for info in pkgutil.iter_modules(attnlab.tools.__path__):
        mod = importlib.import_module(f"attnlab.tools.{info.name}")
        if hasattr(mod, "main"):
            out[info.name] = mod
    return out


TOOLS = tool_modules()


def value_actions(ap):
    """The actions of parser ``ap`` that take a value (flags and positionals; not --help or switches)."""
    return [a for a in ap._actions if a.nargs != 0 and not isinstance(a, argparse._HelpAction)]


def good_value(action, paths, tmp) -> str:
    """A value that ``action`` accepts, to fill a required argument while another one is tried."""
    if action.choices:
        return str(list(action.choices)[0])
    valid = getattr(action.type, "valid", "")
    if "nothing exists yet" in valid:
        return str(tmp / "new")
    if "file to write" in valid:
        return str(tmp / "out.json")
    if "file" in valid and "folder" not in valid:
        return paths["FILE"]
    return paths["DIR"] if "folder" in valid else "1"


def parse_one(ap, argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of ``ap.parse_args(argv)`` (0 when it parses)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0), err.getvalue()
    return 0, err.getvalue()


def test_every_tool_exposes_its_parser():
    assert len(TOOLS) >= 16, sorted(TOOLS)
    for name, mod in TOOLS.items():
        assert isinstance(mod.build_parser(), common.ToolParser), name


def test_every_tool_option_declares_its_valid_values():
    """Each option that takes a value has ``choices``, a ``type=`` function of tools/common.py with its words
    (``.valid``), or an ANY_VALUE entry saying why any text is valid."""
    missing = [f"{name} {a.option_strings or a.dest}" for name, mod in TOOLS.items()
               for a in value_actions(mod.build_parser())
               if a.choices is None and not getattr(a.type, "valid", None) and (name, a.dest) not in ANY_VALUE]
    assert not missing, f"tool options without declared valid values: {missing}"


def tool_attempts(paths, tmp):
    """(tool, option, argv) for every value-taking option of every tool x every bad value, the other required
    arguments filled with good values."""
    bad = ["0", "-1", "1e400", "99999999999999999999", "nan", "inf", "", "x", paths["FILE"], paths["DIR"],
           "/nonexistent/x"]
    for name, mod in TOOLS.items():
        ap = mod.build_parser()
        actions = value_actions(ap)
        for target in actions:
            for value in bad:
                argv = []
                for a in actions:
                    v = value if a is target else good_value(a, paths, tmp) if (a.required or not a.option_strings) \
                        else None
                    if v is not None:
                        argv += [v] if not a.option_strings else [a.option_strings[-1], v]
                yield name, ap, target, value, argv


def test_every_tool_option_refuses_bad_values_in_one_line(paths, tmp_path):
    tried, refused, wrong = 0, 0, []
    for name, ap, target, value, argv in tool_attempts(paths, tmp_path):
        tried += 1
        status, err = parse_one(ap, argv)
        label = target.option_strings[-1] if target.option_strings else target.metavar or target.dest
        if status == 0:
            continue  # parsed: its type= words, choices or ANY_VALUE reason say what it means
        refused += 1
        lines = err.strip().splitlines()
        if status != 2 or len(lines) != 1 or f"argument {label}" not in lines[0] and label not in lines[0]:
            wrong.append(f"{name} {label} {value!r}: status {status}, stderr {err!r}")
    assert not wrong, "\n".join(wrong)
    assert tried > 1000 and refused > tried // 3, (tried, refused)


# ---------------------------------------------------------------------------------------------- the command line

def launch(module: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def assert_one_line(r: subprocess.CompletedProcess, name: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode not in (0, None) and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(lines) == 1 and name in lines[0], r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("args, name", [
    (["--model.layer_pattern", "softmax,softmax,softmax,softmax,parallax"], "model.layer_pattern"),
    (["--training.steps", "abc"], "--training.steps"),
])
def test_preflight_command_line_is_the_in_process_check(tmp_path, args, name):
    """``python -m attnlab.train --preflight`` prints what the in-process check raises: one line naming the key."""
    assert_one_line(launch("attnlab.train", "--preflight", "--job.dump_folder", str(tmp_path / "run"), *args,
                           cwd=tmp_path), name)
    assert not (tmp_path / "run").exists()


def test_a_run_on_one_process_refuses_degrees_before_torchtitan_starts(tmp_path):
    """A real launch (--preflight only notes what the launch cannot run, as a configuration may be checked away
    from its machines): one line naming the key, before torchtitan (whose ParallelDims asserted) or the run folder."""
    assert_one_line(launch("attnlab.train", "--job.dump_folder", str(tmp_path / "run"),
                           "--parallelism.context_parallel_degree", "2", cwd=tmp_path),
                    "parallelism.context_parallel_degree")
    assert not (tmp_path / "run").exists()


def test_tool_command_line_is_its_parser(tmp_path):
    assert_one_line(launch("attnlab.tools.eval_ppl", str(tmp_path), "--data", "x", "--batch-size", "0"),
                    "--batch-size")


def cli_spelling(value, tp, paths) -> str | None:
    """``value`` as a command-line word, for values of the key's own type only (a wrong type is a TOML case: on the
    command line every word is text that tyro converts); None for the others and for lists."""
    base = _base(tp)
    if isinstance(value, bool) or isinstance(value, (list, tuple)) or base not in (int, float, str):
        return None
    if isinstance(value, str):
        return paths.get(value, value) if base is str else None
    if base is str or isinstance(value, float) and base is int:
        return None
    return repr(value) if isinstance(value, float) else str(value)


def _sections() -> list[str]:
    from torchtitan.config import JobConfig

    from attnlab.config.parse import merge_config_classes
    from attnlab.config.sections import job_config_class

    merged = merge_config_classes(JobConfig, job_config_class())
    return sorted({k.split(".")[0] for k, _, _ in checks.iter_keys(merged)})


SECTIONS = _sections()


@pytest.mark.slow
@pytest.mark.parametrize("section", SECTIONS)
def test_every_key_on_the_command_line(cfg, paths, tmp_path, section):
    """Every scalar key of ``section`` with the first of its bad values the in-process check refuses, through
    ``python -m attnlab.train`` in a subprocess: non-zero, one line naming the key, no traceback."""
    wrong = []
    for key, tp, f in config_keys(cfg):
        if key.split(".")[0] != section:
            continue
        for value in bad_values(tp):
            spelled = cli_spelling(value, tp, paths)
            if spelled is None or attempt(cfg, key, value, paths, launch_checks=False) is None:
                continue
            r = launch("attnlab.train", "--preflight", "--job.dump_folder", str(tmp_path / "run"), f"--{key}",
                       spelled, cwd=tmp_path)
            lines = r.stderr.strip().splitlines()
            if r.returncode == 0 or "Traceback" in r.stderr or len(lines) != 1 or key.split(".")[-1] not in lines[0]:
                wrong.append(f"--{key} {spelled!r}: rc {r.returncode}, stderr {r.stderr[-500:]!r}")
            break
    assert not wrong, "\n".join(wrong)
