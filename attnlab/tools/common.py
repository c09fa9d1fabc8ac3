"""The command line every tool shares: the positional ``CKPT`` and ``--step`` (:func:`add_checkpoint_arguments`),
train.py flags after ``--`` (:func:`split_train_flags`), for tools that evaluate a model one parser with
``--dtype``/``--device`` (:func:`tool_parser`) and the load that turns a bad folder into one error line
(:func:`load_run`), ``--tokenizer`` of every tool that reads a model (:func:`add_tokenizer_argument`, resolved by
:func:`checkpoint_tokenizer`), and the options of a softmax → Parallax conversion (:func:`add_conversion_arguments`).
What the arguments name is resolved by :mod:`attnlab.checkpoint.layout` and loaded by :mod:`attnlab.checkpoint.load`."""

from __future__ import annotations

import argparse
import math
import os
import warnings

import torch

from attnlab.checkpoint import convert
from attnlab.checkpoint.convert import DEFAULT_RHO_NORM_INIT, parse_layers
from attnlab.checkpoint.dcp import CheckpointError
from attnlab.checkpoint.load import load_model

TRAIN_FLAGS_HELP = ("After `--`, train.py flags (`--section.key value`) applied on top of the run's config.toml; "
                    "a run without config.toml (older runs) needs its training flags here, e.g. "
                    "`-- --job.config_file x --model.attention parallax`.")


class ToolParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (``prog: error: argument --rows: must be an
    integer >= 1``), without the usage text argparse prints first; ``--help`` shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _valid(text: str):
    """Decorate an argparse ``type=`` function with ``text``, the valid values in words (its error and the
    harness in tests/test_option_harness.py read it)."""
    def wrap(fn):
        fn.valid = text
        return fn
    return wrap


def number_type(name: str, kind: type, rule: str, ok, valid: str = ""):
    """An argparse ``type=`` named ``name`` that parses ``kind`` (int or float; a float must be finite) and accepts
    the values ``ok`` holds for, ``rule`` saying which in words (its error: "'0': must be an integer >= 1");
    ``valid`` (default: the noun and ``rule``) is what :func:`_valid` records."""
    noun = "an integer" if kind is int else "a number"

    @_valid(valid or f"{noun} {rule}".strip())
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if isinstance(v, float) and not math.isfinite(v) or not ok(v):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {noun} {rule}")
        return v

    parse.__name__ = parse.__qualname__ = name
    return parse


positive_int = number_type("positive_int", int, ">= 1", lambda v: v >= 1)
non_negative_int = number_type("non_negative_int", int, ">= 0", lambda v: v >= 0)
any_int = number_type("any_int", int, "", lambda v: True)
positive_float = number_type("positive_float", float, "> 0", lambda v: v > 0)
non_negative_float = number_type("non_negative_float", float, ">= 0", lambda v: v >= 0)
finite_float = number_type("finite_float", float, "(finite)", lambda v: True, valid="a finite number")
unit_float = number_type("unit_float", float, "in [0, 1)", lambda v: 0 <= v < 1)
probability = number_type("probability", float, "in (0, 1]", lambda v: 0 < v <= 1)


def at_least(n: int):
    """An argparse ``type=``: an integer >= ``n``."""
    return number_type("at_least", int, f">= {n}", lambda v: v >= n)


def or_empty(fn):
    """An argparse ``type=`` that takes "" (the option's "unset", e.g. "default: ...") or what ``fn`` takes."""
    @_valid(f"empty or {fn.valid}")
    def check(text: str) -> str:
        return text if text == "" else fn(text)
    return check


def _path(text: str, ok, what: str) -> str:
    if not text or not ok(text):
        raise argparse.ArgumentTypeError(f"{text!r}: {what}")
    return text


@_valid("an existing file or folder")
def existing_path(text: str) -> str:
    return _path(text, os.path.exists, "no such file or folder")


@_valid("an existing folder")
def existing_dir(text: str) -> str:
    return _path(text, os.path.isdir, "not a folder" if os.path.exists(text) else "no such folder")


@_valid("an existing file")
def existing_file(text: str) -> str:
    return _path(text, os.path.isfile, "not a file" if os.path.exists(text) else "no such file")


def _under_a_folder(path: str) -> bool:
    """Whether the nearest existing ancestor of ``path`` is a folder (so the missing ones can be made)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return os.path.isdir(parent)


@_valid("a path where nothing exists yet (its missing parent folders are made)")
def new_path(text: str) -> str:
    _path(text, lambda p: not os.path.lexists(p), "already exists; name a new path")
    return _path(text, _under_a_folder, "a file is in the way of its parent folders")


@_valid("a folder, or a path where nothing exists yet")
def dir_path(text: str) -> str:
    _path(text, lambda p: not os.path.exists(p) or os.path.isdir(p), "is a file, not a folder")
    return _path(text, _under_a_folder, "a file is in the way of its parent folders")


@_valid("a file to write: not a folder")
def out_file(text: str) -> str:
    _path(text, lambda p: not os.path.isdir(p), "is a folder; name a file")
    return _path(text, _under_a_folder, "a file is in the way of its parent folders")


def split_train_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the tool's own arguments, the train.py flags after ``--``)."""
    return (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


def add_checkpoint_arguments(ap: argparse.ArgumentParser, name: str = "ckpt") -> None:
    """The positional checkpoint argument and ``--step`` shared by every tool (resolved by
    :func:`attnlab.checkpoint.layout.resolve`)."""
    ap.add_argument(name, metavar=name.upper(), type=existing_dir,
                    help="a run folder (job.dump_folder: its config.toml rebuilds the model), a checkpoint/step-N "
                         "folder, or a Hugging Face folder")
    ap.add_argument("--step", type=non_negative_int, default=None,
                    help="which checkpoint/step-N of a run folder (default: the latest)")


TOKENIZER_HELP = ("folder with the tokenizer.json these weights were trained with (default: the run's tokenizer/, the "
                  "Hugging Face folder's own, else the run config's model.hf_assets_path)")
MAKE_TOKENIZER = ("`attnlab train_tokenizer FILES -o DIR` trains one on your text, `attnlab fetch_tokenizer --repo "
                  "ORG/NAME -o DIR` fetches a hub model's")
"""How a user without a tokenizer folder gets one, for the messages that ask for ``--tokenizer DIR``."""


@_valid("an existing folder, or 'ids' (the prompt as space-separated token ids)")
def tokenizer_dir_or_ids(text: str) -> str:
    return text if text == "ids" else existing_dir(text)


def add_tokenizer_argument(ap: argparse.ArgumentParser, help: str = TOKENIZER_HELP, ids: bool = False) -> None:
    """``--tokenizer DIR``, the one way every tool that reads a model is given the tokenizer of its weights
    (resolved by :func:`checkpoint_tokenizer`); with ``ids`` it also takes "ids" (generate's token-id prompts)."""
    ap.add_argument("--tokenizer", metavar="DIR", type=tokenizer_dir_or_ids if ids else existing_dir, default=None,
                    help=help)


def checkpoint_tokenizer(ckpt, cfg, given: str | None, vocab_size: int, required: bool = True):
    """The tokenizer folder of the checkpoint ``ckpt`` (a :class:`attnlab.checkpoint.layout.CheckpointRef`) whose
    run is described by the JobConfig ``cfg`` (its config.toml, train_args.json, a TOML the user named, or flags;
    None when nothing describes it, as :func:`attnlab.checkpoint.load.load_tool_checkpoint` returns it): ``given``
    (``--tokenizer``), else the run's ``tokenizer/`` or the Hugging Face folder's own files, else ``cfg``'s
    ``model.hf_assets_path``. A checkpoint nothing describes (a Hugging Face folder or model-only step folder outside
    a run) without a tokenizer of its own is refused unless ``given``: the default configuration's tokenizer is not
    the one its weights were trained with. A tokenizer with more tokens than the model's ``vocab_size`` embedding
    rows is refused. Raises CheckpointError, one line; with ``required`` off, returns None where it would refuse
    for want of a tokenizer."""
    from pathlib import Path

    from attnlab.checkpoint.layout import check_tokenizer_fits
    from attnlab.checkpoint.load import tokenizer_folder

    if given:
        if not (Path(given) / "tokenizer.json").is_file():
            raise CheckpointError(f"--tokenizer {given}: no tokenizer.json there ({MAKE_TOKENIZER})")
        tok = Path(given)
    elif ckpt.tokenizer is None and cfg is None:
        tok, why = None, "no tokenizer.json of its own and no run naming one"
    else:
        tok = tokenizer_folder(ckpt, cfg)
        why = f"its run's model.hf_assets_path {cfg.model.hf_assets_path if cfg else ''} has no tokenizer.json"
    if tok is None:
        if not required:
            return None
        raise CheckpointError(f"{ckpt.path}: {why}; pass --tokenizer DIR, the tokenizer these weights were trained "
                              f"with ({MAKE_TOKENIZER})")
    try:
        check_tokenizer_fits(tok, vocab_size)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return tok


def tool_parser(doc: str) -> ToolParser:
    """The parser of a tool that loads a model through :func:`load_run`: the checkpoint, ``--dtype``, ``--device``
    and ``--tokenizer`` arguments, ``doc`` as its description; train.py flags follow ``--``
    (:func:`split_train_flags`)."""
    ap = ToolParser(description=doc, epilog=TRAIN_FLAGS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(ap)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    add_device_argument(ap)
    add_tokenizer_argument(ap)
    return ap


@_valid("a torch device: cpu, cuda, cuda:N, mps, ...")
def torch_device(text: str) -> str:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:0, ...)") from None
    return text


def add_device_argument(ap: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--device``: a torch device, by default cuda when there is one, else cpu."""
    ap.add_argument("--device", type=torch_device, default=default or ("cuda" if torch.cuda.is_available() else "cpu"),
                    help="torch device")


def load_run(ap: argparse.ArgumentParser, args: argparse.Namespace, train_flags: list[str]):
    """:func:`attnlab.checkpoint.load.load_model` of a tool's ``CKPT``/``--step``/``--device``/``--dtype``
    (:func:`tool_parser`), its config's ``model.hf_assets_path`` set to the tokenizer of the weights
    (:func:`checkpoint_tokenizer`, ``--tokenizer``); a bad folder, checkpoint or tokenizer exits through ``ap`` with
    one line."""
    from attnlab.checkpoint.dcp import run_argv
    from attnlab.checkpoint.layout import resolve

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        model, cfg, step_dir = load_model(args.ckpt, train_flags, device=args.device, dtype=getattr(torch, args.dtype),
                                          step=args.step)
        ckpt = resolve(args.ckpt, args.step)
        described = run_argv(ckpt.config_argv(train_flags), ckpt.path) is not None  # else cfg is the default's
        tok = checkpoint_tokenizer(ckpt, cfg if described else None, args.tokenizer, model.model_args.vocab_size)
        cfg.model.hf_assets_path = str(tok)
        return model, cfg, step_dir
    except FileNotFoundError as e:
        ap.error(str(e))
    except CheckpointError as e:  # nothing describes the run, a corrupt shard, weights that do not fit
        ap.exit(2, f"{ap.prog}: error: {e}\n")


@_valid("layer indices and ranges, e.g. '14-27' or '0,2,5-7'")
def layer_list(text: str) -> str:
    """The text of ``--layers``, checked for form here; the indices against n_layers once the model is known."""
    if not all(part.strip().replace("-", "", 1).isdigit() for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: expected layer indices and ranges, e.g. '14-27' or '0,2,5-7'")
    return text


def add_conversion_arguments(ap: argparse.ArgumentParser, when: str = "") -> None:
    """The options of a softmax → Parallax conversion, shared by the conversion tools (``when`` prefixes each help
    text, e.g. "with --parallax"). :func:`convert_from_arguments` reads them back."""
    w = f"{when}: " if when else ""
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--layers", type=layer_list,
                       help=f"{w}layers to convert, e.g. '14-27' or '0,2,5-7' (default: all)")
    which.add_argument("--top-half", action="store_true", help=f"{w}convert layers n_layers//2 .. n_layers-1")
    ap.add_argument("--rho-gate", action="store_true", help=f"{w}add the per-head sigmoid gate on ρ (weights 0)")
    ap.add_argument("--gate-bias", type=finite_float, default=0.0,
                    help=f"{w}initial gate bias (σ(bias) = initial gate)")
    ap.add_argument("--no-rope-on-rho", action="store_true", help=f"{w}do not apply RoPE to ρ")
    ap.add_argument("--rho-norm-init", type=non_negative_float, default=DEFAULT_RHO_NORM_INIT,
                    help=f"{w}gain of ρ's RMSNorm in the converted layers (attention.parallax.rho_norm_init; "
                         "‖ρ‖ = √head_dim · gain once W_R moves; default: the module default, "
                         f"{DEFAULT_RHO_NORM_INIT:g}; 1 is the Parallax paper's recipe as written)")


CONVERSION_OPTIONS = ("layers", "top_half", "rho_gate", "gate_bias", "no_rope_on_rho", "rho_norm_init")
"""The argparse destinations :func:`add_conversion_arguments` adds."""


def conversion_options_given(ap, a) -> list[str]:
    """The conversion options of ``a`` set away from their defaults in parser ``ap``, as flags."""
    return ["--" + d.replace("_", "-") for d in CONVERSION_OPTIONS if getattr(a, d) != ap.get_default(d)]


def convert_from_arguments(args, sd, a, progress: bool = False):
    """(converted layer indices, new ModelArgs, new state dict): :func:`attnlab.checkpoint.convert.convert_state`
    with the layers and options parsed by :func:`add_conversion_arguments`."""
    if a.top_half:
        layers = list(range(args.n_layers // 2, args.n_layers))
    else:
        layers = parse_layers(a.layers, args.n_layers) if a.layers else list(range(args.n_layers))
    # looked up on its module, where tests/tools/test_convert_to_parallax.py replaces it with a conversion that is wrong
    return layers, *convert.convert_state(args, sd, layers, not a.no_rope_on_rho, a.rho_gate, a.gate_bias, progress,
                                          a.rho_norm_init)
