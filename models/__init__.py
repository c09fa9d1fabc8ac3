"""The project's model and its torchtitan ``TrainSpec`` ("qwen3_attn")."""

from __future__ import annotations

from models.args import FLAVORS, ModelArgs, get_flavor  # noqa: F401
from models.model import Transformer  # noqa: F401

SPEC_NAME = "qwen3_attn"


class _Flavors(dict):
    """The trainer mutates the args it looks up (``update_from_config``): hand out fresh copies."""

    def __getitem__(self, name: str) -> ModelArgs:
        return get_flavor(name)


def register_train_spec() -> None:
    """Register the model with torchtitan once (idempotent)."""
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.protocols import train_spec as ts

    if SPEC_NAME in ts._extra_train_specs:
        return
    from data.loader import build_dataloader, build_tokenizer
    from models.hf import AttnLabStateDictAdapter
    from models.metrics import build_metrics
    from models.parallelize import parallelize_model
    from models.validate import build_validator
    from optim.build import build_lr_schedulers, build_optimizers

    ts.register_train_spec(SPEC_NAME, ts.TrainSpec(
        model_cls=Transformer, model_args=_Flavors(FLAVORS), parallelize_fn=parallelize_model, pipelining_fn=None,
        build_optimizers_fn=build_optimizers, build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader, build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_cross_entropy_loss, build_validator_fn=build_validator,
        build_metrics_processor_fn=build_metrics, state_dict_adapter=AttnLabStateDictAdapter,
    ))
