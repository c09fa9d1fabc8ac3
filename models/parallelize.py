"""Parallelisation for the project's model: torchtitan's activation checkpointing, per-block
``torch.compile`` and FSDP2, applied in that order (as torchtitan's Qwen3 does). TP/CP/PP are not
supported (``validate_config`` rejects them). Over gloo (CPU) FSDP must use sum reductions."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import apply_ddp
from torchtitan.models.llama4.infra.parallelize import apply_compile, apply_fsdp
from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list
from torchtitan.tools.logging import logger


def _save_list() -> set:
    """Ops whose outputs selective AC keeps: torchtitan's list plus this project's attention custom ops."""
    ops = set(_op_sac_save_list)
    for name in ("parallax_fwd", "attn_fwd"):
        ns = getattr(torch.ops, "attnlab", None)
        if ns is not None and hasattr(ns, name):
            ops.add(getattr(ns, name).default)
    return ops


def parallelize_model(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=compile_model,
                 op_sac_save_list=_save_list(), base_folder=job_config.job.dump_folder)
    if compile_model:
        apply_compile(model, job_config.compile, ep_enabled=False)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(model, parallel_dims.get_mesh(names),
                   param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
                   reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
                   pp_enabled=False, cpu_offload=job_config.training.enable_cpu_offload,
                   reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
                   gradient_divide_factor=parallel_dims.fsdp_gradient_divide_factor)
        if torch.distributed.get_backend() == "gloo":  # gloo has no PREMUL_SUM (platform.md)
            from torch.distributed.fsdp import FSDPModule

            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        logger.info("Applied FSDP to the model")
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=compile_model)
    return model
