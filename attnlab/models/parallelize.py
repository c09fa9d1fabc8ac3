"""Parallelisation for the project's model: torchtitan's activation checkpointing, per-block
``torch.compile`` and FSDP2, applied in that order (as torchtitan's Qwen3 does), and context parallelism
(:mod:`attention.cp`: the model gets its CP group; FSDP then shards over data × context ranks). TP/PP are not
supported (``validate_config`` rejects them). Over gloo (CPU) FSDP must use sum reductions."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import apply_ac
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from torchtitan.models.llama3.infra.parallelize import apply_ddp, disable_fsdp_gradient_division
from torchtitan.models.llama4.infra.parallelize import apply_compile
from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list
from torchtitan.tools.logging import logger

from attnlab.attention.cp import ContextParallel
from attnlab.attention.ops import sac_save_ops
from attnlab.attention.ops.linear_attn import fla_usable


def sac_save_list(attention_ops: bool = True) -> set:
    """Ops whose outputs selective activation checkpointing ("op" mode) keeps instead of recomputing: torchtitan's
    Qwen3 list (matmuls, SDPA/flash/varlen/flex attention, ...) plus, with ``attention_ops`` (``[attention]
    sac_save``), the attention forward ops that declare themselves (:func:`attention.ops.sac_save_ops`).

    Without them the backward re-runs every layer's Triton attention forward (two forwards per step), while
    softmax's ``_varlen_attn`` is on torchtitan's list. The opaque ops (``attention.ops.custom_ops.opaque_op``)
    recompute their forward in their own backward; saving their output spares a third run. Saving keeps the ops'
    outputs in activation memory instead (benchmarks/README.md has GDN's and KDA's time and memory both ways)."""
    ops = set(_op_sac_save_list)
    if attention_ops:
        ops.update(sac_save_ops())
    return ops


def parallelize_model(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if parallel_dims.cp_enabled:
        model.cp = ContextParallel.from_mesh(parallel_dims.get_mesh("cp"))
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=compile_model,
                 op_sac_save_list=sac_save_list(job_config.attention.sac_save),
                 base_folder=job_config.job.dump_folder)
    if compile_model:
        if torch.cuda.is_available():  # fla's first use imports and patches modules, which dynamo cannot trace
            log_fla_state(torch.device("cuda"))
        apply_compile(model, job_config.compile, ep_enabled=False)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(model, parallel_dims.get_mesh(names), job_config)
        logger.info("Applied FSDP to the model")
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=compile_model)
    return model


def log_fla_state(device: torch.device) -> None:
    """Ask fla's state once, eagerly (the compiled blocks then only read it), and log the fallback the compiled
    paths cannot log themselves: fla missing, or its gated backward unsafe on this GPU and Triton."""
    ok, why = fla_usable(device, needs_grad=True)
    if not ok:
        logger.warning(f"fla-core's training kernels are unavailable here ({why}): 'auto' paths that train "
                       "through them take their fallbacks (docs/kernels.md)")


def apply_fsdp(model: nn.Module, mesh, job_config) -> None:
    """FSDP2: one group per block, the embeddings with the head and final norm (one group, so tied weights
    work: torchtitan 0.2.2's ``apply_fsdp`` puts the tied weight in two groups and fails), then the root."""
    t = job_config.training
    cfg = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[t.mixed_precision_param],
                                                           reduce_dtype=TORCH_DTYPE_MAP[t.mixed_precision_reduce])}
    if t.enable_cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        cfg["offload_policy"] = CPUOffloadPolicy()
    policy = job_config.parallelism.fsdp_reshard_after_forward
    if policy not in ("default", "always", "never"):
        raise ValueError(f"parallelism.fsdp_reshard_after_forward={policy!r}; choose from ['default', 'always', 'never']")
    reshard = policy != "never"
    for block in model.layers.values():
        fully_shard(block, **cfg, reshard_after_forward=reshard)
    fully_shard([model.tok_embeddings, model.norm, model.output], **cfg, reshard_after_forward=policy == "always")
    fully_shard(model, **cfg)
    disable_fsdp_gradient_division(model)  # the loss is already divided by the global token count
    if torch.distributed.get_backend() == "gloo":  # gloo has no PREMUL_SUM
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
