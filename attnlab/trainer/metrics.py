"""Training metrics: torchtitan's ``MetricsProcessor`` (its metric names, timing and memory) plus perplexity, the lr
and weight decay of every parameter group, progress (step/total, elapsed, ETA), ``<dump_folder>/metrics.jsonl`` and a
wandb run named from ``[metrics] wandb_project``/``wandb_run_name``.

TensorBoard and wandb get torchtitan's names (``loss_metrics/global_avg_loss``, ``throughput(tps)``, ``mfu(%)``,
``memory/max_reserved(GiB)``, ``validation_metrics/loss``, ...), with this project's additions passed through its
``extra_metrics``: ``loss_metrics/perplexity``, ``validation_metrics/perplexity``, ``time_metrics/elapsed(s)``,
``time_metrics/eta(s)``, ``lr/<group>`` and ``wd/<group>``. ``metrics.jsonl`` keeps its short keys for the tools
that read it (:data:`JSONL_KEYS`)."""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any

import torch

from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor, WandBLogger
from torchtitan.tools.logging import logger

from attnlab.data.loader import document_lengths

from attnlab.trainer.titan import drop_titan_metrics_lines, metrics_rank

JSONL_KEYS = {
    "loss_metrics/global_avg_loss": "loss", "loss_metrics/global_max_loss": "max_loss",
    "loss_metrics/perplexity": "ppl", "throughput(tps)": "tps", "mfu(%)": "mfu",
    "time_metrics/elapsed(s)": "elapsed_s", "time_metrics/eta(s)": "eta_s",
    "validation_metrics/loss": "val_loss", "validation_metrics/perplexity": "val_ppl",
}
"""Logged name -> ``metrics.jsonl`` key, for the keys the tools read (``attnlab.tools.plot_ppl``,
``benchmarks.replicate``, ``benchmarks.bench_train``, ``attnlab.tools.smoke_configs``); the other names are written as
logged."""


def perplexity(loss: float) -> float:
    """``exp(loss)``, the loss capped at 50 so that a diverging run logs a large number instead of overflowing."""
    return math.exp(min(loss, 50.0))


class JsonlLogger(BaseLogger):
    """Appends one JSON object per logged step to ``<dump_folder>/metrics.jsonl``, under :data:`JSONL_KEYS`' names
    (``memory_gib`` repeats ``memory/max_reserved(GiB)``)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        end_partial_line(path)
        self.f = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Non-finite numbers become ``null`` (JSON has no NaN); the run stops on them (trainer.nonfinite)."""
        record = {JSONL_KEYS.get(k, k): v for k, v in metrics.items()}
        if "memory/max_reserved(GiB)" in metrics:
            record["memory_gib"] = metrics["memory/max_reserved(GiB)"]
        finite = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.f.write(json.dumps({"step": step, "time": time.time(), **finite}, allow_nan=False) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def end_partial_line(path: str) -> None:
    """Repair a metrics.jsonl whose last record was cut short (a kill or a full disk mid-write) before a resumed run
    appends to it, which would otherwise glue its first record onto the broken one: a last line that parses but
    lost its newline gets it, one that does not parse is dropped; either with a warning naming the file."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        start, line = data.rfind(b"\n") + 1, data.count(b"\n") + 1
        try:
            json.loads(data[start:])
        except ValueError:  # JSONDecodeError, or bytes cut inside a UTF-8 character
            f.seek(start)
            f.truncate()
            logger.warning(f"{path} line {line}: dropped a partial record ({len(data) - start} "
                           "bytes, an interrupted write); appending after the last complete one")
            return
        f.write(b"\n")
        logger.warning(f"{path} line {line}: the last record lacked its newline (an interrupted "
                       "write); ended it")


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, in order. A last line without its newline that does not parse (a run killed
    mid-write and not resumed since) is skipped with a warning; any other line that is not a JSON object is a
    ValueError naming the file and the line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not line.endswith("\n"):
                logger.warning(f"{path} line {n}: skipped a partial last record (an interrupted write)")
                continue
            raise ValueError(f"{path} line {n}: not valid JSON ({e.msg}, column {e.colno})") from e
        if not isinstance(rec, dict):
            raise ValueError(f"{path} line {n}: not a JSON object ({type(rec).__name__})")
        out.append(rec)
    return out


class ProjectWandBLogger(WandBLogger):
    """torchtitan's wandb logger with the project, run name and folder from the config: ``metrics.wandb_project``,
    ``metrics.wandb_run_name`` (empty = the dump folder's name) and ``<dump_folder>/wandb/``. The other
    ``WANDB_*`` environment variables torchtitan reads (team, id, tags, group, ...) still apply."""

    def __init__(self, job_config, tag: str | None = None):
        import wandb

        m, dump = job_config.metrics, job_config.job.dump_folder
        self.wandb, self.tag = wandb, tag
        os.makedirs(dump, exist_ok=True)
        env = {k: os.getenv(f"WANDB_{v}") for k, v in (("id", "RUN_ID"), ("notes", "RUN_NOTES"), ("tags", "RUN_TAGS"),
               ("group", "RUN_GROUP"), ("job_type", "RUN_JOB_TYPE"), ("resume_from", "RESUME_FROM"),
               ("fork_from", "FORK_FROM"))}  # torchtitan's WandBLogger names
        wandb.init(entity=os.getenv("WANDB_TEAM"), project=m.wandb_project,
                   name=m.wandb_run_name or os.path.basename(os.path.abspath(dump)), dir=dump,
                   config=job_config.to_dict(), **env)
        logger.info(f"wandb: project {m.wandb_project!r}, files under {dump}/wandb")


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _LastLogged(BaseLogger):
    """Keeps the metrics of the last log call (torchtitan's timing and memory, for the console line)."""

    def __init__(self):
        self.metrics: dict[str, Any] = {}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.metrics = metrics


class TrainMetrics(MetricsProcessor):
    """torchtitan's metrics with this project's additions (module docstring) and its own console line per log step:
    ``step N/total``, loss, perplexity, lr, grad norm, tokens/s, MFU (none on a CPU, where torchtitan's fallback
    peak is an A100's), memory, elapsed time and ETA.

    ``lr_wd``: the trainer sets it to the optimizers' ``lr_wd()`` at the start of each step, so the lr/wd logged
    are the ones that step used (torchtitan steps the scheduler before logging). ``start(step)``: the step training
    (re)starts from, for elapsed time and ETA."""

    def __init__(self, job_config, parallel_dims, tag=None):
        wandb = job_config.metrics.enable_wandb
        job_config.metrics.enable_wandb = False  # torchtitan's logger would pick "torchtitan" and tb/<ts>/wandb
        try:
            super().__init__(job_config, parallel_dims, tag)
        finally:
            job_config.metrics.enable_wandb = wandb
        if not torch.cuda.is_available():
            self.gpu_peak_flops = math.nan  # MFU is NaN (null in metrics.jsonl, "n/a" on the console)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        loggers = self.logger if isinstance(self.logger, LoggerContainer) else LoggerContainer()  # TensorBoard
        self._last = _LastLogged()
        loggers.add_logger(self._last)
        if wandb and (job_config.metrics.save_for_all_ranks or rank == metrics_rank(parallel_dims, job_config)):
            loggers.add_logger(ProjectWandBLogger(job_config, tag))
        if rank == 0:
            loggers.add_logger(JsonlLogger(os.path.join(job_config.job.dump_folder, "metrics.jsonl")))
        self.logger = loggers
        drop_titan_metrics_lines()
        self.lr_wd: dict[str, float] = {}
        self.document_flops: DocumentFlops | None = None  # the trainer sets it for block_causal runs
        self.start(0)

    def start(self, step: int) -> None:
        self._t0, self._step0 = time.perf_counter(), step

    @property
    def logged(self) -> dict[str, Any]:
        """The metrics of the last ``log`` or ``log_validation`` call, under torchtitan's names."""
        return self._last.metrics

    def _progress(self, step: int) -> tuple[int, float, float]:
        """(the step this process stops at, seconds since ``start``, estimated seconds left)."""
        t = self.job_config.training
        end = t.stop_after_step if 0 < t.stop_after_step < t.steps else t.steps
        elapsed = time.perf_counter() - self._t0
        done = step - self._step0
        return end, elapsed, elapsed / done * max(end - step, 0) if done > 0 else float("nan")

    def counted(self, data_iterator):
        """``data_iterator``'s microbatches, each added to :attr:`document_flops` on its way (on the host, before
        torchtitan moves it to the device); ``data_iterator`` itself when documents are not counted."""
        if self.document_flops is None:
            return data_iterator

        def each():
            for inputs, labels in data_iterator:
                self.document_flops.add(inputs["positions"])
                yield inputs, labels

        return each()

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if self.document_flops is not None and self.document_flops.total:  # MFU and tflops of the documents run
            self.num_flops_per_token = self.document_flops.per_token(self.ntokens_since_last_log)
        end, elapsed, eta = self._progress(step)
        ppl = perplexity(global_avg_loss)
        ours = {"loss_metrics/perplexity": ppl, "time_metrics/elapsed(s)": elapsed, "time_metrics/eta(s)": eta,
                **self.lr_wd}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **ours})
        m = self.logged
        lr = next((v for k, v in m.items() if k.startswith("lr/")), m.get("lr", 0.0))
        mfu = m["mfu(%)"]
        logger.info(f"step {step:5d}/{end}  loss {global_avg_loss:7.4f}  ppl {ppl:9.2f}  lr {lr:.2e}  "
                    f"gnorm {grad_norm:6.3f}  tps {m['throughput(tps)']:8,.0f}  "
                    f"mfu {f'{mfu:5.2f}' if math.isfinite(mfu) else '  n/a'}%  "
                    f"mem {m['memory/max_reserved(GiB)']:5.2f}GiB  elapsed {_clock(elapsed)}  "
                    f"eta {_clock(eta) if math.isfinite(eta) else '?'}")

    def log_validation(self, loss, step, extra_metrics=None):
        ppl = perplexity(loss)
        super().log_validation(loss, step, {**(extra_metrics or {}), "validation_metrics/perplexity": ppl})
        logger.info(f"validation step {step:5d}  loss {loss:7.4f}  ppl {ppl:9.2f}")


class DocumentFlops:
    """Training FLOPs of the steps since the last log, counted per document of a ``block_causal`` batch: a query
    attends within its own document only, so a row of short documents does less attention than the one
    ``seq_len``-token sequence torchtitan's ``num_flops_per_token`` assumes. ``add(positions)`` counts one
    microbatch from its per-document positions [B, T] (on the host, before they move to the device: no sync);
    ``per_token(tokens)`` is the count over the tokens since the last call, then starts again. ``flops_of_len(n)``:
    the FLOPs of one n-token document (``ModelArgs.training_flops`` of [n], cached per length: the count is a sum
    over documents)."""

    def __init__(self, flops_of_len):
        self.flops_of_len = functools.cache(flops_of_len)
        self.total = 0

    def add(self, positions: torch.Tensor) -> None:
        self.total += sum(self.flops_of_len(n) for n in document_lengths(positions))

    def per_token(self, tokens: int) -> float:
        out, self.total = self.total / tokens, 0
        return out


def build_metrics(job_config, parallel_dims, model_args=None, tag=None) -> TrainMetrics:
    """TrainSpec ``build_metrics_processor_fn``."""
    return TrainMetrics(job_config, parallel_dims, tag)
