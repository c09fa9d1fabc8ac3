"""A key that needs an optional extra (pyproject's [project.optional-dependencies]) that is not installed fails at
preflight in one line naming the key and the ``pip install`` extra."""

import subprocess
import sys

import pytest

from tests.utils import REPO


def test_wandb_without_wandb_is_one_line_naming_the_key_and_the_extra(monkeypatch):
    """``--metrics.enable_wandb true`` without wandb was a 26-line ModuleNotFoundError naming neither."""
    from attnlab.config import parse_config
    from attnlab.train import preflight

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError, installed or not
    with pytest.raises(ValueError, match=r"metrics.enable_wandb=true: wandb is not installed; "
                                         r"pip install 'attnlab\[wandb\]'"):
        preflight(parse_config(["--metrics.enable_wandb", "true"]))


def test_fla_without_fla_core_names_the_extra(monkeypatch):
    from attnlab.attention.ops import common
    from attnlab.config import parse_config
    from attnlab.train import preflight

    monkeypatch.setattr(common, "fla_importable", lambda: (False, "fla-core not importable (ModuleNotFoundError)"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(ValueError, match=r"attention.impl='fla': .*pip install 'attnlab\[fla\]'"):
        preflight(parse_config(["--model.attention", "gdn", "--attention.impl", "fla"]))


def test_the_trainer_says_it_in_one_line():
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    proc = subprocess.run([sys.executable, "-m", "attnlab.train", "--metrics.enable_wandb", "true", "--preflight"],
                          cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install 'attnlab[wandb]'" in lines[0], proc.stderr
