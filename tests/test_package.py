"""attnlab as users install it: the wheel's one top-level name, its shipped configurations, and the installed package
run from an empty folder outside the checkout (training, preflight of a shipped config by name, a tool)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from attnlab import configs
from tests.utils import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel --no-deps`` builds from this checkout (without build isolation: no download), built
    from a copy of what it packs, so setuptools' ``build/`` and ``*.egg-info`` land there, not in the checkout."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO / "attnlab", src / "attnlab", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, timeout=600)
    (found,) = out.glob("attnlab-*.whl")
    return found


def test_wheel_installs_one_package_with_its_configs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"attnlab"}, sorted(top)
    shipped = {n.removeprefix("attnlab/configs/").removesuffix(".toml") for n in names
               if n.startswith("attnlab/configs/") and n.endswith(".toml")}
    assert shipped == set(configs.names()) and {"debug_cpu", "paper/qwen3_0.6b_parallax"} <= shipped
    assert "attnlab/attention/ops/autotune_picks.json" in names
    assert "attnlab/checkpoint/hf_remote/modeling_attnlab.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "attnlab = attnlab.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_installed_wheel_trains_checks_and_evaluates_outside_the_checkout(wheel, tmp_path):
    """From an empty folder, with only the installed wheel on the path (not this checkout): the embedded default
    trains 3 steps through ``python -m attnlab.train``, a shipped paper config passes preflight by name, and the
    ``attnlab`` command runs ``eval_ppl`` on the run."""
    site, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONSAFEPATH", None)

    def run(*cmd: str) -> str:
        p = subprocess.run(list(cmd), cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        return p.stdout + p.stderr

    where = run(sys.executable, "-c", "import attnlab; print(attnlab.__file__)")
    assert where.strip().startswith(str(site)), where  # the installed copy, not the checkout
    run(sys.executable, "-m", "attnlab.train", "--training.steps", "3", "--job.dump_folder", "run",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--validation.steps", "2",
        "--checkpoint.interval", "3")
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert (work / "run" / "checkpoint" / "step-3").is_dir()

    out = run(sys.executable, "-m", "attnlab.train", "--job.config_file", "paper/qwen3_0.6b_parallax", "--preflight")
    assert "preflight passed" in out and "qwen3_0.6b_parallax.toml" in out
    assert not (work / "outputs").exists()  # preflight writes nothing

    (work / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    run(str(site / "bin" / "attnlab"), "eval_ppl", "run", "--data", "text.txt", "--max-rows", "2", "--seq-len", "64",
        "--batch-size", "2", "--no-progress", "-o", "ppl.json")
    res = json.loads((work / "ppl.json").read_text())
    assert res["step"] == 3 and res["ppl"] > 1
