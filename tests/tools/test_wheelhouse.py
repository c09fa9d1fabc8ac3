"""scripts/wheelhouse.sh: argument errors (fast), and (slow: downloads ~160 MB from the package index) a real
torch-less wheelhouse installed offline into a fresh venv that borrows only torch/triton from this interpreter."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.utils import REPO

SCRIPT = REPO / "scripts" / "wheelhouse.sh"


@pytest.mark.parametrize("args,message", [
    ([], "OUT_DIR is required"),
    (["/tmp/x", "3.12", "manylinux_2_28_x86_64", "--cuda", "cu13"], "--cuda must be cpu or cuXYZ"),
    (["/tmp/x", "twelve"], "PYTHON_VERSION must look like 3.12"),
    (["/tmp/x", "--frobnicate"], "unknown option --frobnicate"),
])
def test_bad_arguments(args, message):
    p = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and message in p.stderr, p.stderr


@pytest.mark.slow
def test_offline_install_into_fresh_venv(tmp_path):
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    wh = tmp_path / "wh"
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(SCRIPT), str(wh), py, "manylinux_2_28_x86_64", "--cpu", "--no-torch"],
                       capture_output=True, text=True, timeout=1200, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    names = sorted(x.name for x in wh.glob("*.whl"))
    assert any(n.startswith("attnlab-") for n in names) and any(n.startswith("torchtitan-0.2.2-") for n in names)
    assert not any(n.startswith(("torch-", "triton-")) for n in names), names  # left out by --no-torch
    for dep in ("torchao-", "torchdata-", "datasets-", "tokenizers-", "numpy-", "sympy-", "tyro-"):
        assert any(n.startswith(dep) for n in names), (dep, names)
    venv = tmp_path / "venv"
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    site = Path(subprocess.check_output([str(vpy), "-c", "import site; print(site.getsitepackages()[0])"],
                                        text=True).strip())
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():  # torch and triton only (with their metadata), nothing else from this env
        if entry.name.split("-")[0] in ("torch", "torchgen", "functorch", "triton") and \
                (entry.is_dir() and not entry.name.startswith(("torchao", "torchdata", "torchtitan"))):
            (site / entry.name).symlink_to(entry)
    p = subprocess.run(["bash", str(wh / "install.sh")], capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "PYTHON": str(vpy)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    code = "import attention, models, optim, data, train, torchtitan, torchao; print(train.__file__)"
    out = subprocess.check_output([str(vpy), "-c", code], text=True, cwd=str(tmp_path))
    assert str(venv) in out
