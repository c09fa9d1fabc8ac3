"""How a tool starts training runs of its own: ``python -m attnlab.train`` in a subprocess, through torchrun for
several processes, importing the same ``attnlab`` as the caller (a checkout or an installed wheel)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import attnlab

PACKAGE_ROOT = str(Path(attnlab.__file__).resolve().parents[1])
"""The folder holding the imported ``attnlab`` package: put first on a child's PYTHONPATH."""


def train_command(train_args: list[str], nproc: int = 1) -> list[str]:
    """The argv that runs training with ``train_args``: one process, or torchrun's ``nproc`` local ones on a free
    port (so several launches can run side by side)."""
    if nproc == 1:
        return [sys.executable, "-m", "attnlab.train", *train_args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0",
            "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "-m", "attnlab.train", *train_args]


def child_env(**extra: str) -> dict[str, str]:
    """The caller's environment with this ``attnlab`` first on PYTHONPATH (the caller's entries kept after it,
    e.g. a wheel folder), unbuffered output, no inherited ``LOCAL_RANK``, and ``extra``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", **extra}
    env.pop("LOCAL_RANK", None)
    return env
