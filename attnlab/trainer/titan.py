"""Every private part of torchtitan 0.2.2 the trainer relies on, in this one file: a torchtitan upgrade is checked
here.

- ``CheckpointManager``: the trainer's checkpoint rules (:class:`trainer.checkpoint.CheckpointGuard`) run in place of
  its ``load``, ``save`` and ``dcp_load`` and of its step-folder scan and rotation (:func:`hook_checkpointer`), and
  use its step-folder names (:func:`step_path`), save policy (:func:`saves_at`) and purge thread (:func:`purge`).
- ``MetricsProcessor``: which rank logs (:func:`metrics_rank`), and its console lines, which
  :class:`trainer.metrics.TrainMetrics` prints its own way (:func:`drop_titan_metrics_lines`).
"""

from __future__ import annotations

import functools
import logging

from torchtitan.components import metrics as titan_metrics
from torchtitan.tools.logging import logger


def hook_checkpointer(checkpointer, rules) -> None:
    """Route the loads and saves of ``checkpointer`` (torchtitan's ``CheckpointManager``) through ``rules``: its
    ``load``, ``save`` and ``dcp_load`` call ``rules.load``/``save``/``dcp_load`` with torchtitan's method as the first
    argument; its step-folder scan (``_find_load_step``) and rotation (``_purge_stale_checkpoints``), which count
    any name containing ``step-(\\d+)``, become ``rules.newest_step`` and ``rules.rotate``."""
    checkpointer.load = functools.partial(rules.load, checkpointer.load)
    checkpointer.save = functools.partial(rules.save, checkpointer.save)
    checkpointer.dcp_load = functools.partial(rules.dcp_load, checkpointer.dcp_load)
    if checkpointer.enable:
        checkpointer._find_load_step = rules.newest_step
        checkpointer._purge_stale_checkpoints = rules.rotate


def step_path(checkpointer, step: int) -> str:
    """The folder ``checkpointer`` saves step ``step`` to and loads it from (``<checkpoint folder>/step-N``)."""
    return checkpointer._create_checkpoint_id(step)


def saves_at(checkpointer, step: int, last_step: bool) -> bool:
    """Whether ``checkpointer.save(step, last_step)`` writes a checkpoint (interval, last step, first step)."""
    return checkpointer._should_save(step, last_step)


def purge(checkpointer, path: str) -> None:
    """Hand the step folder ``path`` to ``checkpointer``'s purge thread (running while ``keep_latest_k > 0``)."""
    checkpointer.purge_queue.put(path)


def metrics_rank(parallel_dims, job_config) -> int:
    """The rank that logs metrics to TensorBoard and wandb (the last pipeline stage's first rank, else 0)."""
    return titan_metrics._get_metrics_rank(parallel_dims, job_config)


class _DropTitanMetricsLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.pathname == titan_metrics.__file__ and record.funcName in ("log", "log_validation"))


def drop_titan_metrics_lines() -> None:
    """Keep ``MetricsProcessor.log`` and ``log_validation`` from printing their console lines (the subclass prints
    its own); everything else torchtitan logs is kept. Idempotent."""
    if not any(isinstance(f, _DropTitanMetricsLines) for f in logger.filters):
        logger.addFilter(_DropTitanMetricsLines())
