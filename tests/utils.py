"""Shared test helpers: launching real training runs (the tiny corpus and its arguments live in attnlab/testing/tiny_runs.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from pathlib import Path

from attnlab.testing.tiny_runs import losses, make_corpus, read_metrics, tiny_args

REPO = Path(__file__).resolve().parents[1]

__all__ = ["REPO", "free_port", "losses", "make_corpus", "random_qwen3", "read_metrics", "run_train", "tiny_args"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous or a process group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(args: list[str], nproc: int = 1, timeout: int = 300, module: str | None = None,
              **popen) -> subprocess.CompletedProcess:
    """``python -m attnlab.train args`` on ``nproc`` processes (torchrun beyond one); ``module``: ``python -m module
    args`` instead, a module that prepares the process (registers a mechanism) and then runs the trainer."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    entry = ["-m", module or "attnlab.train"]
    if nproc == 1:
        cmd = [sys.executable, *entry, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0",
               "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", *entry, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          **{"cwd": str(REPO), **popen})
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def random_qwen3(folder, seed: int, jitter: float = 0.0, **sizes):
    """A transformers ``Qwen3ForCausalLM`` of ``sizes`` (Qwen3Config keywords), random from ``seed`` and with
    ``jitter`` × N(0, 1) added to every weight (so norms and zero-initialised tensors are not at their init),
    saved by transformers into ``folder``; returns the model in eval mode."""
    import torch
    import transformers

    cfg = transformers.Qwen3Config(rms_norm_eps=1e-6, max_position_embeddings=64, **sizes)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if jitter:
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(jitter * torch.randn_like(p))
    hf.save_pretrained(folder)
    return hf
