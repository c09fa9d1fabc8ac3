"""The project's torchtitan ``TrainSpec`` ("qwen3_attn", the ``[model] name`` of every config): the model and its
flavors, parallelisation, optimizers and lr schedules, data loader and tokenizer, metrics, validator and Hugging
Face state-dict adapter."""

from __future__ import annotations

import functools

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.protocols import train_spec as ts

from attnlab.data.loader import build_dataloader, build_tokenizer
from attnlab.models.args import FLAVORS, ModelArgs, get_flavor
from attnlab.checkpoint.hf import AttnLabStateDictAdapter
from attnlab.models.model import Transformer
from attnlab.models.parallelize import parallelize_model
from attnlab.optim.build import build_lr_schedulers, build_optimizers
from attnlab.trainer.metrics import build_metrics
from attnlab.trainer.validate import PackedValidator

SPEC_NAME = "qwen3_attn"


class _Flavors(dict):
    """The trainer mutates the args it looks up (``update_from_config``): hand out fresh copies."""

    def __getitem__(self, name: str) -> ModelArgs:
        return get_flavor(name)


@functools.cache
def register_train_spec() -> None:
    """Register the spec with torchtitan (once per process)."""
    ts.register_train_spec(SPEC_NAME, ts.TrainSpec(
        model_cls=Transformer, model_args=_Flavors(FLAVORS), parallelize_fn=parallelize_model, pipelining_fn=None,
        build_optimizers_fn=build_optimizers, build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader, build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_cross_entropy_loss, build_validator_fn=PackedValidator,
        build_metrics_processor_fn=build_metrics, state_dict_adapter=AttnLabStateDictAdapter,
    ))
