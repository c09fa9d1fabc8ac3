"""Validation: torchtitan's ``Validator`` fed by this project's held-out split. Every validation pass reads
the same batches from the start (``validation.steps`` of them, or the whole split with -1), so validation
perplexity is comparable across steps and runs; it also runs at the last training step.

Data-parallel ranks read interleaved shards of the split, which can hold different numbers of batches; every
collective of a validation batch must be entered by every rank, so all ranks stop at the first batch that some
rank does not have (:class:`RankAlignedLoader`), and a split that gives some rank no batch at all is an error at
start."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan.components.validate import Validator

from attnlab.data.loader import build_validation_dataloader


class RankAlignedLoader:
    """Iterates ``loader`` while every rank of ``group`` still has a batch: before each batch the ranks
    all-reduce (MIN) whether they have one. One scalar all-reduce and host sync per validation batch."""

    def __init__(self, loader, group, device: torch.device | str):
        self.loader, self.group, self.device = loader, group, device

    def all_have(self, has: bool) -> bool:
        if self.group is None:  # one rank: nothing to agree on, no sync
            return has
        flag = torch.tensor(int(has), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def __iter__(self):
        it = iter(self.loader)
        while True:
            batch = next(it, None)
            if not self.all_have(batch is not None):
                return
            yield batch


class PackedValidator(Validator):
    """torchtitan's validator (TrainSpec ``build_validator_fn``) reading the held-out split of ``data.loader``
    through :class:`RankAlignedLoader`; it also validates at the last training step."""

    def __init__(self, job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn, validation_context,
                 maybe_enable_amp, metrics_processor, **_pp):
        from torchtitan.tools import utils

        self.job_config, self.tokenizer, self.parallel_dims, self.loss_fn = job_config, tokenizer, parallel_dims, loss_fn
        loader = build_validation_dataloader(dp_world_size, dp_rank, tokenizer, job_config)
        group = parallel_dims.get_mesh("batch").get_group() if parallel_dims.dp_enabled else None
        self.validation_dataloader = RankAlignedLoader(loader, group, utils.device_type)
        self.validation_context, self.maybe_enable_amp = validation_context, maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pp_schedule = self.pp_has_first_stage = self.pp_has_last_stage = None
        if not self.validation_dataloader.all_have(next(iter(loader), None) is not None):
            v = job_config.validation
            raise ValueError(f"the validation split ({v.dataset_path or 'held out from the training data'}) gives "
                             f"some of the {dp_world_size} data-parallel ranks no batch of validation.local_batch_size"
                             f"={v.local_batch_size} rows of validation.seq_len={v.seq_len} tokens; add validation "
                             "documents, lower those, or set validation.enable = false")

    def should_validate(self, step: int) -> bool:
        return super().should_validate(step) or step == self.job_config.training.steps

    @torch.no_grad()
    def validate(self, model_parts, step: int) -> None:
        """torchtitan's validation loop, except under context parallelism: there each rank holds 1/N of every row,
        so every batch's loss sum and token count are summed over the data × context ranks (torchtitan counts
        tokens over the data ranks only, and its CP context wants a ``freqs_cis`` buffer this model lacks)."""
        if not self.parallel_dims.cp_enabled:
            return super().validate(model_parts, step)
        from torchtitan.components.loss import IGNORE_INDEX
        from torchtitan.tools import utils

        model, losses, limit = model_parts[0], [], self.job_config.validation.steps
        model.eval()
        for input_dict, labels in self.validation_dataloader:
            if 0 <= limit <= len(losses):
                break
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            input_dict = {k: v.to(utils.device_type) for k, v in input_dict.items()}
            inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
                input_dict, labels.to(utils.device_type), model_parts)
            with self.validation_context(), self.maybe_enable_amp:
                loss_sum = self.loss_fn(model(inputs, **extra_inputs, **extra_kwargs), labels)
            total = torch.stack([loss_sum.detach().float(), (labels != IGNORE_INDEX).sum().float()])
            dist.all_reduce(total, group=self.parallel_dims.get_mesh("loss").get_group())
            losses.append(total[0] / total[1])
        self.metrics_processor.log_validation(loss=torch.stack(losses).mean().item(), step=step)
        model.train()

    def post_dataloading_process(self, input_dict, labels, model_parts):
        if model_parts[0].cp is not None:  # context parallelism: this rank's shard of every row
            return model_parts[0].cp.shard_batch(input_dict, labels)
        inputs = input_dict["input"]
        return inputs, labels, {k: v for k, v in input_dict.items() if k != "input"}, {}
