"""Metrics: torchtitan's processor plus perplexity, per-group lr/wd and ``<dump_folder>/metrics.jsonl``."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch

from torchtitan.components.metrics import LoggerContainer, MetricsProcessor
from torchtitan.tools.logging import logger


class JsonlLogger:
    """Appends one JSON object per logged step to ``<dump_folder>/metrics.jsonl`` (read by plot_ppl.py)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.f = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Non-finite numbers become ``null`` (JSON has no NaN); the run stops on them (train.py's guard)."""
        finite = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self.f.write(json.dumps({"step": step, "time": time.time(), **finite}, allow_nan=False) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def group_hparams(optimizers) -> dict[str, float]:
    """Current lr and weight decay of every parameter group (``group["name"]`` when the builder sets it)."""
    out = {}
    for i, opt in enumerate(getattr(optimizers, "optimizers", [])):
        for j, g in enumerate(opt.param_groups):
            name = g.get("name", f"{i}.{j}")
            out[f"lr/{name}"] = float(g["lr"])
            out[f"wd/{name}"] = float(g.get("weight_decay", 0.0))
    return out


class PerplexityMetrics(MetricsProcessor):
    """torchtitan's metrics plus perplexity, per-group lr/wd, and a JSONL file; one line per log step."""

    def __init__(self, job_config, parallel_dims, tag=None):
        super().__init__(job_config, parallel_dims, tag)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            if not isinstance(self.logger, LoggerContainer):
                self.logger = LoggerContainer()
            self.logger.add_logger(JsonlLogger(os.path.join(job_config.job.dump_folder, "metrics.jsonl")))

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        dt = time.perf_counter() - self.time_last_log
        tps = self.ntokens_since_last_log / (dt * self.parallel_dims.non_data_parallel_size)
        mfu = 100 * self.num_flops_per_token * tps / self.gpu_peak_flops
        mem = self.device_memory_monitor.get_peak_stats()
        ppl = math.exp(min(global_avg_loss, 50.0))
        metrics = {"loss": global_avg_loss, "ppl": ppl, "max_loss": global_max_loss, "grad_norm": grad_norm,
                   "tps": tps, "tflops": self.num_flops_per_token * tps / 1e12, "mfu": mfu,
                   "memory_gib": mem.max_reserved_gib, **(extra_metrics or {}), **group_hparams(self.optimizers)}
        self.logger.log(metrics, step)
        lr = next((v for k, v in metrics.items() if k.startswith("lr/")), extra_metrics.get("lr", 0.0))
        logger.info(f"step {step:5d}  loss {global_avg_loss:7.4f}  ppl {ppl:9.2f}  lr {lr:.2e}  "
                    f"gnorm {grad_norm:6.3f}  tps {tps:8,.0f}  mfu {mfu:5.2f}%  mem {mem.max_reserved_gib:5.2f}GiB")
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
