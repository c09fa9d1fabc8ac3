"""Validation: torchtitan's ``Validator`` fed by this project's held-out split. Every validation pass reads
the same batches from the start (``validation.steps`` of them, or the whole split with -1), so validation
perplexity is comparable across steps and runs; it also runs at the last training step."""

from __future__ import annotations

from torchtitan.components.validate import Validator

from data.loader import build_validation_dataloader


class PackedValidator(Validator):
    def __init__(self, job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn, validation_context,
                 maybe_enable_amp, metrics_processor, **_pp):
        self.job_config, self.tokenizer, self.parallel_dims, self.loss_fn = job_config, tokenizer, parallel_dims, loss_fn
        self.validation_dataloader = build_validation_dataloader(dp_world_size, dp_rank, tokenizer, job_config)
        self.validation_context, self.maybe_enable_amp = validation_context, maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pp_schedule = self.pp_has_first_stage = self.pp_has_last_stage = None

    def should_validate(self, step: int) -> bool:
        return super().should_validate(step) or step == self.job_config.training.steps

    def post_dataloading_process(self, input_dict, labels, model_parts):
        inputs = input_dict["input"]
        return inputs, labels, {k: v for k, v in input_dict.items() if k != "input"}, {}


def build_validator(**kw) -> PackedValidator:
    return PackedValidator(**kw)
