"""The package's layers (docs/architecture.md): each subpackage of ``attnlab`` imports only the layers below it, the
kernel layer stands alone, nothing in the library imports the entry point, and the op folders name their files from
one vocabulary.

Imports are read with ``ast`` (every ``import`` statement, module level or inside a function, relative ones
resolved), so a lazy import inside a function counts too.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "attnlab"
OPS = PACKAGE / "attention" / "ops"
OP_FILES = {"__init__.py", "naive.py", "chunk.py", "recurrent.py", "fla.py"}
"""What an op folder ``attnlab/attention/ops/<op>/`` may hold besides its ``triton/`` package (README, "Adding a
mechanism")."""

_LIBRARY = {"attention.ops", "attention", "models", "optim", "data", "configs", "config", "checkpoint", "trainer"}
ALLOWED = {
    "attention.ops": set(),
    "attention": {"attention.ops"},
    "models": {"attention", "attention.ops"},
    "optim": set(),
    "data": set(),
    "configs": set(),
    "config": {"attention", "optim", "data", "configs"},
    "checkpoint": {"attention", "attention.ops", "models", "config", "data", "configs"},
    "trainer": {"attention", "attention.ops", "models", "optim", "data", "config", "checkpoint"},
    "train": _LIBRARY,
    "tools": _LIBRARY | {"tools", "testing"},
    "testing": _LIBRARY | {"tools", "testing"},
    "cli": _LIBRARY | {"train", "tools"},
}
"""Layer → the layers of ``attnlab`` it may import (besides itself). Bottom to top: the kernels (``attention.ops``),
the mechanisms, the model; beside them the optimizers, the data and the shipped TOML files; the configuration schema;
the on-disk format; the trainer; the entry point ``attnlab.train``; the tools and the test helpers; the ``attnlab``
command."""


def imported_modules(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path`` (a file under ``root``); ``from a import b`` yields ``a.b``
    (b may be a module)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: strip level − 1 trailing parts of this file's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def layer(module: str) -> str | None:
    """The layer of a dotted module under ``attnlab`` (None outside it, "" for the package itself)."""
    parts = module.split(".")
    if parts[0] != "attnlab":
        return None
    if len(parts) == 1:
        return ""
    if parts[1] == "attention" and len(parts) > 2 and parts[2] == "ops":
        return "attention.ops"
    return parts[1]


def test_layer_classifies():
    assert layer("attnlab.attention.ops.common.document_ids") == "attention.ops"
    assert layer("attnlab.attention.base.w") == "attention" and layer("attnlab.checkpoint.hf") == "checkpoint"
    assert layer("torch.nn") is None and layer("attnlab") == ""


def test_relative_imports_resolve(tmp_path):
    pkg = tmp_path / "attnlab" / "attention" / "ops" / "x"
    pkg.mkdir(parents=True)
    f = pkg / "m.py"
    f.write_text("from . import y\nfrom ..common import z\nfrom ...base import w\n")
    expected = ["attnlab.attention.ops.x.y", "attnlab.attention.ops.common.z", "attnlab.attention.base.w"]
    assert [m for _, m in imported_modules(f, tmp_path)] == expected


def test_every_layer_imports_only_the_layers_below_it():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100 and len(list(OPS.rglob("*.py"))) > 40  # the walk found the package and its kernels
    bad, unknown = [], set()
    for path in files:
        own = layer(".".join(path.relative_to(REPO).with_suffix("").parts))
        if own in ("", "__init__"):
            continue
        if own not in ALLOWED:
            unknown.add(own)
            continue
        for line, mod in imported_modules(path):
            dep = layer(mod)
            if dep and dep != own and dep not in ALLOWED[own]:
                bad.append(f"{path.relative_to(REPO)}:{line} ({own}) imports {mod} ({dep})")
    assert not unknown, f"subpackages without a place in ALLOWED: {sorted(unknown)}"
    assert not bad, "imports across the layers (tests/test_layering.py ALLOWED):\n" + "\n".join(bad)


def test_the_package_root_imports_nothing():
    """``import attnlab`` stays cheap: its ``__init__`` imports none of the layers."""
    assert not [m for _, m in imported_modules(PACKAGE / "__init__.py") if layer(m) is not None]


def test_op_folders_use_one_vocabulary():
    """Every op folder holds ``__init__.py`` and only ``naive.py`` (required), ``chunk.py``, ``recurrent.py``,
    ``fla.py`` and a ``triton/`` package (any file names inside it)."""
    folders = sorted(d for d in OPS.iterdir() if d.is_dir() and d.name != "__pycache__")
    assert len(folders) >= 10  # the walk found the op folders
    bad = []
    for d in folders:
        files = {f.name for f in d.iterdir() if f.suffix == ".py"}
        dirs = {f.name for f in d.iterdir() if f.is_dir() and f.name != "__pycache__"}
        if not {"__init__.py", "naive.py"} <= files or files - OP_FILES or dirs - {"triton"}:
            bad.append(f"{d.relative_to(REPO)}: {sorted(files | {x + '/' for x in dirs})}")
        if "triton" in dirs and not (d / "triton" / "__init__.py").exists():
            bad.append(f"{d.relative_to(REPO)}/triton has no __init__.py")
    assert not bad, "op folders outside the vocabulary (naive, chunk, recurrent, fla, triton/):\n" + "\n".join(bad)


CHECKPOINT_ORDER = ("layout", "dcp", "hf", "load")
"""The on-disk format's modules, bottom to top: run/step/HF folders, DCP checkpoints (with the architecture record
and ``build_model``), Hugging Face folders, the tools' loader of either format."""


def test_the_on_disk_format_builds_upwards():
    """Inside ``attnlab.checkpoint`` each module of :data:`CHECKPOINT_ORDER` imports only those before it
    (``checkpoint.dcp`` never imports ``checkpoint.hf``, neither imports ``checkpoint.load``)."""
    bad = []
    for i, name in enumerate(CHECKPOINT_ORDER):
        above = [f"attnlab.checkpoint.{m}" for m in CHECKPOINT_ORDER[i + 1:]]
        bad += [f"attnlab/checkpoint/{name}.py:{line} imports {mod}"
                for line, mod in imported_modules(PACKAGE / "checkpoint" / f"{name}.py")
                if any(mod == m or mod.startswith(m + ".") for m in above)]
    assert not bad, "\n".join(bad)


def test_the_library_holds_no_tool_argument_parser():
    """The tools' command line (``CKPT``, ``--step``, train.py flags, conversion options) is
    attnlab/tools/common.py's: the on-disk format imports no ``argparse``."""
    bad = [f"{path.relative_to(REPO)}:{line}" for path in sorted((PACKAGE / "checkpoint").rglob("*.py"))
           for line, mod in imported_modules(path) if mod.split(".")[0] == "argparse"]
    assert not bad, "argparse imported by the on-disk format: " + ", ".join(bad)
