"""The kernel layer stands alone: nothing under ``attention/ops`` imports from above it, and its op folders name
their files from one vocabulary.

Layering (README, "Layout"): reference → Triton kernel (``attention/ops``) → attention module (``attention/*.py``)
→ model (``models/``) → trainer (``train.py``). Imports are read with ``ast`` (every ``import`` statement,
module level or inside a function, relative ones resolved), so a lazy import inside a function counts too.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPS = REPO / "attention" / "ops"
ABOVE = ("models", "trainer", "train", "config", "optim", "data", "scripts")  # top-level packages above the kernels
OP_FILES = {"__init__.py", "naive.py", "chunk.py", "recurrent.py", "fla.py"}
"""What an op folder ``attention/ops/<op>/`` may hold besides its ``triton/`` package (README, "Adding a mechanism")."""


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


def reaches_up(module: str) -> bool:
    top = module.split(".")[0]
    if top in ABOVE:
        return True
    return top == "attention" and not module.startswith("attention.ops.")


def test_reaches_up_classifies():
    assert reaches_up("attention.base.document_ids") and reaches_up("attention.linear_common.log_once")
    assert reaches_up("attention.registry") and reaches_up("models.parallelize.sac_save_list")
    assert reaches_up("train.parse_config") and reaches_up("config.JobConfig")
    assert not reaches_up("attention.ops.common.document_ids") and not reaches_up("torch.nn")
    assert not reaches_up("triton.language") and not reaches_up("fla.ops.kda")


def test_ops_import_nothing_above_them():
    files = sorted(OPS.rglob("*.py"))
    assert len(files) > 40  # the walk found the kernel layer
    bad = [f"{path.relative_to(REPO)}:{line} imports {mod}"
           for path in files for line, mod in imported_modules(path) if reaches_up(mod)]
    assert not bad, "attention/ops must not import attention/*.py, models/ or train.py:\n" + "\n".join(bad)


def test_relative_imports_resolve(tmp_path):
    pkg = tmp_path / "attention" / "ops" / "x"
    pkg.mkdir(parents=True)
    f = pkg / "m.py"
    f.write_text("from . import y\nfrom ..common import z\nfrom ...base import w\n")
    expected = ["attention.ops.x.y", "attention.ops.common.z", "attention.base.w"]
    assert [m for _, m in imported_modules(f, tmp_path)] == expected


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


def test_config_and_data_do_not_import_the_model_or_the_trainer():
    """The TOML schema (``config.py``) and the data pipeline (``data/``) sit beside the model: the model-dependent
    checks (flavor, head counts, the tokenizer against the embedding) run where the model is built (``train.preflight``,
    ``models.args``), so neither reaches up into ``models/``, ``trainer/`` or ``train.py``."""
    files = [REPO / "config.py", *sorted((REPO / "data").rglob("*.py"))]
    bad = [f"{path.relative_to(REPO)}:{line} imports {mod}" for path in files for line, mod in imported_modules(path)
           if mod.split(".")[0] in ("models", "trainer", "train", "scripts")]
    assert not bad, "\n".join(bad)


def test_checkpoint_io_does_not_import_hf():
    """One direction between the run loaders: ``models.hf`` (Hugging Face folders) builds on
    ``models.checkpoint_io`` (DCP, the architecture record, ``build_model``), which never imports it back."""
    bad = [f"models/checkpoint_io.py:{line} imports {mod}"
           for line, mod in imported_modules(REPO / "models" / "checkpoint_io.py") if mod.startswith("models.hf")]
    assert not bad, "\n".join(bad)
