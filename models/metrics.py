"""Metrics: torchtitan's processor plus perplexity, per-group lr/wd, progress (step/total, elapsed, ETA),
``<dump_folder>/metrics.jsonl`` and a wandb run named from ``[metrics] wandb_project``/``wandb_run_name``."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch

from torchtitan.components.metrics import LoggerContainer, MetricsProcessor, WandBLogger, _get_metrics_rank
from torchtitan.tools.logging import logger


class JsonlLogger:
    """Appends one JSON object per logged step to ``<dump_folder>/metrics.jsonl`` (read by plot_ppl.py)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        end_partial_line(path)
        self.f = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Non-finite numbers become ``null`` (JSON has no NaN); the run stops on them (train.py's guard)."""
        finite = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
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


def group_hparams(optimizers) -> dict[str, float]:
    """Current lr and weight decay of every parameter group (``group["name"]`` when the builder sets it)."""
    out = {}
    for i, opt in enumerate(getattr(optimizers, "optimizers", [])):
        for j, g in enumerate(opt.param_groups):
            name = g.get("name", f"{i}.{j}")
            out[f"lr/{name}"] = float(g["lr"])
            out[f"wd/{name}"] = float(g.get("weight_decay", 0.0))
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


class PerplexityMetrics(MetricsProcessor):
    """torchtitan's metrics (the same timing and memory keys) plus perplexity, per-group lr/wd, progress and a
    JSONL file; one line per log step.

    ``hparams``: the trainer sets it to :func:`group_hparams` just before each optimizer step, so the lr/wd
    logged are the ones that step used (torchtitan steps the scheduler before logging). ``start(step)``: the
    step training (re)starts from, for elapsed time and ETA."""

    def __init__(self, job_config, parallel_dims, tag=None):
        wandb = job_config.metrics.enable_wandb
        job_config.metrics.enable_wandb = False  # torchtitan's logger would pick "torchtitan" and tb/<ts>/wandb
        try:
            super().__init__(job_config, parallel_dims, tag)
        finally:
            job_config.metrics.enable_wandb = wandb
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 0 or wandb:
            if not isinstance(self.logger, LoggerContainer):
                self.logger = LoggerContainer()
        if wandb and (job_config.metrics.save_for_all_ranks or rank == _get_metrics_rank(parallel_dims, job_config)):
            self.logger.add_logger(ProjectWandBLogger(job_config, tag))
        if rank == 0:
            self.logger.add_logger(JsonlLogger(os.path.join(job_config.job.dump_folder, "metrics.jsonl")))
        self.hparams: dict[str, float] | None = None
        self.start(0)

    def start(self, step: int) -> None:
        self._t0, self._step0 = time.perf_counter(), step

    def _progress(self, step: int) -> tuple[int, float, float]:
        """(the step this process stops at, seconds since ``start``, estimated seconds left)."""
        t = self.job_config.training
        end = t.stop_after_step if 0 < t.stop_after_step < t.steps else t.steps
        elapsed = time.perf_counter() - self._t0
        done = step - self._step0
        return end, elapsed, elapsed / done * max(end - step, 0) if done > 0 else float("nan")

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        dt = time.perf_counter() - self.time_last_log
        tps = self.ntokens_since_last_log / (dt * self.parallel_dims.non_data_parallel_size)
        # MFU against the GPU's peak; on a CPU torchtitan's fallback peak is an A100's, so there is no MFU to report
        mfu = 100 * self.num_flops_per_token * tps / self.gpu_peak_flops if torch.cuda.is_available() else None
        mem = self.device_memory_monitor.get_peak_stats()
        loading = self.data_loading_times
        ppl = math.exp(min(global_avg_loss, 50.0))
        end, elapsed, eta = self._progress(step)
        hparams = self.hparams or group_hparams(self.optimizers)
        metrics = {"loss": global_avg_loss, "ppl": ppl, "max_loss": global_max_loss, "grad_norm": grad_norm,
                   "tps": tps, "tflops": self.num_flops_per_token * tps / 1e12, "mfu": mfu,
                   "memory_gib": mem.max_reserved_gib, "elapsed_s": elapsed, "eta_s": eta,
                   # torchtitan's own keys (MetricsProcessor.log), so its dashboards read these files too
                   "time_metrics/end_to_end(s)": dt / self.job_config.metrics.log_freq,
                   "time_metrics/data_loading(s)": sum(loading) / len(loading) if loading else 0.0,
                   "time_metrics/data_loading(%)": 100 * sum(loading) / dt,
                   "memory/max_active(GiB)": mem.max_active_gib, "memory/max_active(%)": mem.max_active_pct,
                   "memory/max_reserved(GiB)": mem.max_reserved_gib, "memory/max_reserved(%)": mem.max_reserved_pct,
                   "memory/num_alloc_retries": mem.num_alloc_retries, "memory/num_ooms": mem.num_ooms,
                   **(extra_metrics or {}), **hparams}
        self.logger.log(metrics, step)
        lr = next((v for k, v in hparams.items() if k.startswith("lr/")), (extra_metrics or {}).get("lr", 0.0))
        eta_txt = _clock(eta) if math.isfinite(eta) else "?"
        logger.info(f"step {step:5d}/{end}  loss {global_avg_loss:7.4f}  ppl {ppl:9.2f}  lr {lr:.2e}  "
                    f"gnorm {grad_norm:6.3f}  tps {tps:8,.0f}  mfu {'  n/a' if mfu is None else f'{mfu:5.2f}'}%  mem {mem.max_reserved_gib:5.2f}GiB  "
                    f"elapsed {_clock(elapsed)}  eta {eta_txt}")
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()

    def log_validation(self, loss, step, extra_metrics=None):
        ppl = math.exp(min(loss, 50.0))
        self.logger.log({"val_loss": loss, "val_ppl": ppl, **(extra_metrics or {})}, step)
        logger.info(f"validation step {step:5d}  loss {loss:7.4f}  ppl {ppl:9.2f}")
        self.ntokens_since_last_log = 0
        self.time_last_log = time.perf_counter()


def build_metrics(job_config, parallel_dims, model_args=None, tag=None) -> PerplexityMetrics:
    return PerplexityMetrics(job_config, parallel_dims, tag)
