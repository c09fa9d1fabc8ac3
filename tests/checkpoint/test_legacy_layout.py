"""A run written before the package move still loads, exports and resumes.

``tests/fixtures/legacy_run_84755c6/`` was written by commit 84755c6's tree (top-level ``models``/``trainer``
packages): a 2-layer softmax + Parallax run of the tiny word corpus (``corpus/``, paths in ``config.toml`` relative
to the fixture folder), trained 2 steps with a checkpoint at step 2, and its Hugging Face export ``hf/`` (without the
remote-code files, which our loader does not read). ``expected.json`` holds what that tree computed: the logits' first
4 columns for ``logits_ids`` (both folders gave the same) and the losses of steps 3 and 4 when the run resumed to 4
steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from attnlab.checkpoint.load import load_model
from tests.utils import losses, run_train

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_run_84755c6"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


@pytest.mark.parametrize("folder", ["run", "run/checkpoint/step-2", "hf"])
def test_legacy_folders_load_to_the_same_function(folder):
    model, cfg, _ = load_model(FIXTURE / folder)
    assert cfg.model.layer_pattern == ["softmax", "parallax"] or folder == "hf"
    with torch.no_grad():
        logits = model(torch.tensor([EXPECTED["logits_ids"]]))
    torch.testing.assert_close(logits[0, :, :4], torch.tensor(EXPECTED["logits_first4"]), rtol=0, atol=1e-5)


def test_legacy_run_resumes_where_it_stopped(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "legacy")
    work = tmp_path / "legacy"
    run_train(["--job.config_file", "run/config.toml", "--training.steps", "4"], cwd=str(work))
    got = losses(work / "run")
    assert sorted(got) == [1, 2, 3, 4]
    for step, loss in EXPECTED["resume_losses"].items():
        assert got[int(step)] == pytest.approx(loss, abs=1e-4), (step, got)
