"""Train a Qwen3-style LLM with a swappable attention block, through torchtitan 0.2.2's trainer.

    python train.py                                   # the embedded default (CPU, no download)
    python train.py --list-attention                  # registered mechanisms
    torchrun --nproc_per_node=N train.py --job.config_file configs/X.toml [--section.key value ...]

Config precedence: command line > TOML > defaults (torchtitan's ``JobConfig`` merged with ``config.py``).
What this subclass adds to torchtitan's ``Trainer``: config validation before anything starts, CPU
support (device shim + gloo), ``training.stop_after_step`` (simulated preemption), perplexity and per-group lr/wd in every log line and in
``<dump_folder>/metrics.jsonl``, RNG state in checkpoints, and clear errors for unusable checkpoints.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TitanJobConfig
from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer

import attention
import config as project_config
from models import register_train_spec
from models.cpu import install_cpu_shim

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "debug_cpu.toml")


class AttnTrainer(Trainer):
    """torchtitan's Trainer; overrides only state (RNG) and checkpoint loading errors."""

    def __init__(self, job_config):
        project_config.validate_config(job_config)
        install_cpu_shim()
        register_train_spec()
        super().__init__(job_config)
        self._wrap_checkpoint_load()

    def _wrap_checkpoint_load(self) -> None:
        load = self.checkpointer.load
        folder = getattr(self.checkpointer, "folder", self.job_config.checkpoint.folder)

        def checked_load(step: int = -1) -> bool:
            self._prepare_dataloader_reshard(folder, step)
            try:
                return load(step=step)
            except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
                lines = [ln for ln in str(e).splitlines() if ln.strip()]
                raise RuntimeError(
                    f"checkpoint in {folder!r} (step {step if step >= 0 else 'latest'}) cannot be loaded into this "
                    f"run: {type(e).__name__}: {lines[-1] if lines else ''}. It is corrupt or was written "
                    "by a different model/optimizer config; point checkpoint.folder/job.dump_folder elsewhere or "
                    "remove it.") from e

        self.checkpointer.load = checked_load

    def _prepare_dataloader_reshard(self, folder: str, step: int) -> None:
        """Tell the data loader how many data-parallel ranks wrote the checkpoint about to be loaded (read from
        the DCP metadata), so that a different world size reshards its position (see data.loader)."""
        dl = getattr(self, "dataloader", None)
        if dl is None or not hasattr(dl, "resume_world_size") or not folder or not os.path.isdir(folder):
            return
        step = step if step >= 0 else self.checkpointer._find_load_step(folder)
        path = os.path.join(folder, f"step-{step}")
        if step < 0 or not os.path.isfile(os.path.join(path, ".metadata")):
            return
        from torch.distributed.checkpoint import FileSystemReader

        try:
            keys = FileSystemReader(path).read_metadata().state_dict_metadata
        except Exception:  # unreadable metadata: the load itself reports it
            return
        ranks = [k for k in keys if k.startswith("dataloader.dp_rank_")]
        dl.resume_world_size, dl.checkpoint_path = (len(ranks) or None), path
        if ranks:
            dl.check_reshardable(len(ranks))  # before DCP, so the message is not buried in a load error

    def should_continue_training(self) -> bool:
        stop = self.job_config.training.stop_after_step
        return super().should_continue_training() and not (0 < stop <= self.step)

    def train(self):
        super().train()
        stop = self.job_config.training.stop_after_step
        if 0 < stop == self.step < self.job_config.training.steps and self.step % self.checkpointer.interval:
            # a full (resumable) save now; "last_step" saves would be model-only by default
            self.checkpointer.interval = self.step
            self.checkpointer.save(self.step)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["rng_cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "rng_cpu" in state_dict:
            torch.set_rng_state(state_dict["rng_cpu"])
        if "rng_cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["rng_cuda"])


def _check_keys(cls, data: dict, prefix: str = "") -> None:
    """Reject unknown TOML keys, naming the section, the key and the valid keys."""
    import dataclasses

    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in fields:
            section = f"[{prefix}]" if prefix else "top level"
            raise ValueError(f"unknown config key {key!r} in {section}; valid keys: {sorted(fields)}")
        _check_keys(fields[key].type, value, f"{prefix}.{key}" if prefix else key)


def parse_config(argv: list[str]):
    """Parse ``argv`` (CLI > TOML > defaults) into the merged JobConfig and validate it."""
    merged = ConfigManager._merge_configs(TitanJobConfig, project_config.JobConfig)
    manager = ConfigManager(config_cls=merged)
    toml_values = manager._maybe_load_toml(argv)
    if toml_values:
        _check_keys(merged, toml_values)
    cfg = manager.parse_args(argv)
    cfg.model.name = cfg.model.name or "qwen3_attn"
    cfg.model.converters = [c for c in cfg.model.converters if c]  # `--model.converters ""` turns float8 off
    project_config.validate_config(cfg)
    return cfg


def _single_process_env() -> None:
    """``python train.py`` without torchrun: a world of one process."""
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def run(argv: list[str]) -> AttnTrainer:
    """Parse, build and train; returns the (closed) trainer."""
    init_logger()
    cfg = parse_config(argv)
    trainer = AttnTrainer(cfg)
    try:
        if cfg.checkpoint.create_seed_checkpoint:  # torchtitan's way to share one init across parallelisms
            if int(os.environ["WORLD_SIZE"]) != 1 or not cfg.checkpoint.enable:
                raise ValueError("checkpoint.create_seed_checkpoint needs one process and checkpoint.enable = true")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    finally:
        trainer.close()
    return trainer


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--list-attention" in argv:
        print(attention.describe())
        return
    if not any(a.split("=")[0] in ("--job.config_file", "--job.config-file") for a in argv):
        argv = ["--job.config_file", DEFAULT_CONFIG, *argv]
    _single_process_env()
    run(argv)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
