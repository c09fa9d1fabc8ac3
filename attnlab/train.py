"""Train a Qwen3-style LLM with a swappable attention block, through torchtitan 0.2.2's trainer.

    python -m attnlab.train                           # the embedded default (CPU, no download)
    python -m attnlab.train --list-attention          # registered mechanisms
    python -m attnlab.train --job.config_file NAME --preflight   # check a configuration and exit
    torchrun --nproc_per_node=N -m attnlab.train --job.config_file paper/qwen3_0.6b_parallax [--section.key value ...]

``--job.config_file`` takes a TOML file or a shipped configuration's name (``attnlab configs`` lists them);
``attnlab train`` and a checkout's ``python -m attnlab.train`` run the same :func:`main`.

Config precedence: command line > TOML > defaults (torchtitan's ``JobConfig`` merged with ``config.py``, which
parses and validates it). ``AttnTrainer`` is torchtitan's ``Trainer`` with this project's TrainSpec and the
components of ``attnlab/trainer/`` (docs/architecture.md) in its loop: CPU support, the run folder's locks and
start-time checks, the non-finite guard, the checkpoint load and save checks, metrics with perplexity and progress, a
stop with a checkpoint on SIGTERM/SIGUSR1 or at ``training.stop_after_step``, RNG state in checkpoints, each rank's
shard of the batch under context parallelism (``attnlab/attention/cp.py``), and the loss computed by the model in chunks
without the logits under ``training.loss_chunk_tokens`` (``attnlab/models/loss.py``).
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
from typing import Any

import torch

from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer

from attnlab import attention
import attnlab.config as project_config
from attnlab.config import DEFAULT_CONFIG, checks, names_config_file, parse_config
from attnlab.config.parse import import_requested_module, resolve_config_file
from attnlab.data.loader import check_data_source
from attnlab.trainer.checkpoint import CheckpointGuard, restore_rng_state, with_rng_state
from attnlab.trainer.cpu import install_cpu_shim, single_process_env
from attnlab.trainer.metrics import DocumentFlops
from attnlab.trainer.nonfinite import NonFiniteGuard
from attnlab.trainer.preemption import StopSignals
from attnlab.trainer.run_guard import RunGuard
from attnlab.trainer.step import run_step
from attnlab.trainer.syncs import StepSyncs
from attnlab.trainer.spec import register_train_spec
from attnlab.trainer.teardown import destroy_process_groups


class AttnTrainer(Trainer):
    """torchtitan's Trainer with the components of ``attnlab/trainer/`` plugged into its loop."""

    def __init__(self, job_config):
        """``job_config`` has passed :func:`preflight` (``main`` runs it before anything starts)."""
        install_cpu_shim()
        register_train_spec()
        self.run_guard = RunGuard(job_config)  # locks and checks the run folder before anything is built
        self.stop_signals = StopSignals()
        self.stop_signal = 0
        self.syncs = StepSyncs.from_env(job_config)  # ATTNLAB_COUNT_SYNCS: host syncs counted per step
        try:
            if self.syncs:
                self.syncs.__enter__()
            super().__init__(job_config)
            self.stop_signals.use_process_group()
            self.nonfinite = NonFiniteGuard(self.model_parts, self.optimizers, self.device,
                                            job_config.training.nonfinite_skips,
                                            self.checkpointer.folder if job_config.checkpoint.enable else None)
            self.checkpoints = CheckpointGuard(self, self.nonfinite, after_load=self._after_load)
            # torchtitan's train_step calls optimizers.step(): the guard decides first whether the step runs
            self.optimizers.step = functools.partial(self._optimizer_step, self.optimizers.step)
            self.run_guard.check_disk(self.model_parts)
            if job_config.training.loss_chunk_tokens:
                # the model returns its summed loss (post_dataloading_process hands it the labels); the validator,
                # built above with torchtitan's cross-entropy, keeps reading the logits
                self.loss_fn = model_summed_loss
            if job_config.model.attn_mask_type == "block_causal":  # MFU counts each document's own attention
                model = self.model_parts[0]
                self.metrics_processor.document_flops = DocumentFlops(
                    lambda n: self.model_args.training_flops(model, [n]))
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        self.run_guard.release()
        self.stop_signals.restore()
        if self.syncs:
            self.syncs.__exit__(None, None, None)
            self.syncs = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._release()

    def _after_load(self) -> None:
        """After the checkpoint load (or none) passed every check: the run folder describes this run, and elapsed
        time and ETA count from the step training starts at."""
        self.run_guard.describe_run()
        self.metrics_processor.start(self.step)

    # ------------------------------------------------------------------------------------------------ the loop

    def post_dataloading_process(self, input_dict, labels):
        cp = self.model_parts[0].cp  # context parallelism: this rank's shard of every row (attention.cp)
        inputs, labels, extra_inputs, extra_kwargs = (
            super().post_dataloading_process(input_dict, labels) if cp is None else cp.shard_batch(input_dict, labels))
        chunk = self.job_config.training.loss_chunk_tokens
        if chunk:  # the model computes the loss itself, chunk tokens at a time, and never makes the logits
            extra_kwargs = {**extra_kwargs, "labels": labels, "loss_chunk_tokens": chunk}
        return inputs, labels, extra_inputs, extra_kwargs

    def forward_backward_step(self, *args, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(*args, **kwargs)
        self.nonfinite.note_loss(loss)
        return loss

    def _optimizer_step(self, step_fn, *args, **kwargs):
        if self.nonfinite.step_is_finite(self.step):
            step_fn(*args, **kwargs)

    def train_step(self, data_iterator):
        # the lr/wd this step runs at (torchtitan steps the scheduler before it logs)
        self.metrics_processor.lr_wd = self.optimizers.lr_wd()
        documents = self.job_config.model.attn_mask_type == "block_causal" and self.model_parts[0].cp is None
        if self.syncs:
            data_iterator = self.syncs.host_batches(data_iterator)
        run_step(self, self.metrics_processor.counted(data_iterator), documents)  # a log step checks the guard

    def should_continue_training(self) -> bool:
        if self.syncs:  # the top of the loop: one step's syncs end here
            self.syncs.end_step(self.step)
        stop = self.job_config.training.stop_after_step
        if not super().should_continue_training() or 0 < stop <= self.step:
            return False
        self.stop_signal = self.stop_signals.agreed()
        return not self.stop_signal

    def train(self):
        super().train()
        self.stop_signals.wait()
        self.nonfinite.check(self.step)  # a run without a log step or save since the last check ends loudly too
        if not (0 < self.job_config.training.stop_after_step == self.step or self.stop_signal):
            return
        saved = self.checkpoints.save_now(self.step)
        if self.stop_signal:
            what = (f"saved step {self.step}" if saved and self.step else
                    "no step trained, nothing saved" if saved else f"checkpointing is off, step {self.step} not saved")
            logger.warning(f"received {signal.Signals(self.stop_signal).name}: {what}, exiting")

    def state_dict(self) -> dict[str, Any]:
        return with_rng_state(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        restore_rng_state(state_dict)


def model_summed_loss(loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trainer's ``loss_fn(pred, labels)`` under ``training.loss_chunk_tokens``: the model took the labels and
    returned the summed cross-entropy (``models.model.Transformer.forward``), which passes through unchanged;
    torchtitan's ``forward_backward_step`` then divides it by the global token count as it does the logits' loss."""
    return loss_sum


def preflight(job_config) -> None:
    """The checks a configuration passes before torchtitan starts (which initialises the process group and writes
    ``comm_traces/``), each a ValueError naming the key: the keys' types and declared rules
    (``config.validate_config``), the data files and held-out split (``data.loader.check_data``), the lr schedule,
    and the model built once on the meta device (no memory, no files): ``model.layer_pattern`` against the resolved
    depth, a mechanism's options, its ``[attention] impl``, the sizes, and a tokenizer that fits the embedding; the
    run folder and the checkpoint to load (``trainer.run_folder.check_run_folder``)."""
    from attnlab.data.loader import check_data, tokenizer_path
    from attnlab.checkpoint.dcp import model_args_from_config
    from attnlab.models.model import Transformer
    from attnlab.checkpoint.layout import check_tokenizer_fits
    from attnlab.optim.schedules import build_schedule
    from attnlab.trainer.run_folder import check_run_folder

    project_config.validate_config(job_config)
    check_data(job_config)
    build_schedule(job_config.lr_scheduler, job_config.training.steps)
    args = model_args_from_config(job_config)
    checks.check_layer_pattern(args.layer_pattern, args.n_layers)  # n_layers as resolved from the flavor
    with torch.device("meta"):
        model = Transformer(args)
    tok = tokenizer_path(job_config)
    check_run_folder(job_config, args, model.state_dict(), tok)  # the dump folder and the checkpoint to load
    if os.path.isfile(os.path.join(tok, "tokenizer.json")):
        check_tokenizer_fits(tok, args.vocab_size, "set model.vocab_size to at least that many, or point "
                             "model.hf_assets_path at a tokenizer that fits")
    if job_config.attention.impl == "fla":  # the other paths run anywhere, or pick one that does ("auto")
        from attnlab.attention.ops.common import fla_importable

        ok, why = fla_importable() if torch.cuda.is_available() else (False, "no CUDA device")
        if not ok:
            extra = "; it installs with pip install 'attnlab[fla]'" if "not importable" in why else ""
            raise ValueError(f"attention.impl='fla': fla-core cannot run here ({why}{extra}); use 'auto', which picks "
                             "the fastest path that runs on this machine")
    if job_config.metrics.enable_wandb:
        try:
            importlib.import_module("wandb")
        except ImportError:
            raise ValueError("metrics.enable_wandb=true: wandb is not installed; pip install 'attnlab[wandb]', or "
                             "set metrics.enable_wandb false") from None


def check_launch(job_config) -> None:
    """What depends on how this process was launched and where, checked after :func:`preflight` and before
    torchtitan starts (there a bare assertion or a long traceback): the parallel degrees against the processes
    launched (``WORLD_SIZE``), float8 against the GPU. A ValueError naming the key."""
    checks.check_world_size(job_config, int(os.environ.get("WORLD_SIZE", "1")))
    checks.check_float8_device(job_config, torch.cuda.get_device_capability() if torch.cuda.is_available() else None)


def run(cfg) -> AttnTrainer:
    """Build and train the parsed configuration ``cfg``, which has passed :func:`preflight`; returns the (closed)
    trainer."""
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
    if "--list-attention" in argv:  # with the mechanisms of the experimental.custom_import module it names
        try:
            import_requested_module(resolve_config_file([a for a in argv if a != "--list-attention"]))
        except ValueError as e:
            sys.exit(f"train.py: error: {e}")
        print(attention.describe())
        return
    check_only = "--preflight" in argv  # check the configuration as a run would, then exit
    argv = [a for a in argv if a != "--preflight"]
    if not names_config_file(argv):
        argv = ["--job.config_file", DEFAULT_CONFIG, *argv]
    single_process_env()
    init_logger()
    try:
        cfg = parse_config(argv)
        preflight(cfg)
        if not check_only:  # check_data_source: one request to the Hub, which a configuration check leaves out
            check_launch(cfg)
            check_data_source(cfg)
    except ValueError as e:  # bad configuration: one line naming the key, nothing built or written
        sys.exit(f"train.py: error: {e}")
    if check_only:  # a configuration checked away from the machines it runs on: the launch's problems are a note
        try:
            check_launch(cfg)
            note = ""
        except ValueError as e:
            note = f"\nnote: launched like this, on this machine, the run would stop: {e}"
        print(f"preflight passed: {cfg.job.config_file} ({cfg.model.flavor}, {cfg.model.attention}, "
              f"{cfg.training.steps} steps); nothing was built or written{note}")
        return
    stop_signal = run(cfg).stop_signal
    destroy_process_groups()
    if stop_signal:
        sys.exit(128 + stop_signal)  # the shell's status of a process ended by that signal (STOP_SIGNALS)


if __name__ == "__main__":
    main()
