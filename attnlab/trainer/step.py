"""One training step without a host sync before the forward: torchtitan 0.2.2's ``Trainer.train_step`` (no pipeline
parallelism, which this framework does not run), changed where it made the host wait for the GPU.

torchtitan moves each microbatch, and the step's token count, with blocking ``.to(device)`` copies, and sums the
token count over the data-parallel ranks with ``dist_sum``, which returns a Python float (``.item()``). Each of those
waits for all GPU work queued before it, so at the start of every step the GPU finished the previous step and sat
idle while the host prepared the next batch; a document-masked batch then read its document count and longest
document back from the GPU (:meth:`attention.base.AttentionContext.from_positions`). Here:

- the tokens are counted on the host, as in torchtitan, and summed over the ranks on the device (a functional
  all-reduce, no read back);
- each microbatch moves from pinned memory with ``non_blocking=True`` (:func:`batch_to_device`);
- the document offsets of a ``block_causal`` batch are computed on the host from its positions before the copy
  (:meth:`attention.base.AttentionContext.document_offsets`) and handed to the model as ``documents``; under context
  parallelism every segment layout of the rank's chunks likewise (:meth:`models.model.Transformer.cp_segments`),
  handed over as ``cp_segments``.

The host then runs ahead of the GPU into the next step, as it does within a step. Loss, gradient clipping, optimizer,
schedulers and the logged metrics are torchtitan's, unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils

from attnlab.attention.base import AttentionContext


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device`` without the host waiting: from pinned memory to a GPU (the pinned buffer
    stays reserved until the copy ran: torch's caching host allocator); on the CPU ``t`` itself."""
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def batch_to_device(input_dict: dict, labels: torch.Tensor, device: torch.device, documents: bool,
                    cp_segments=None):
    """A microbatch from the data loader, on ``device`` without blocking. With ``documents`` (a ``block_causal`` run
    outside context parallelism) ``input_dict`` gains ``"documents"``: (cu_seqlens [n_docs + 1] int32 on ``device``,
    the longest document), computed from the host's ``positions`` [B, T]. Under context parallelism ``cp_segments``
    (the model's :meth:`models.model.Transformer.cp_segments`) builds the batch's segment layouts from the host's
    positions (None without) and ``input_dict`` gains them, copied to ``device``, as ``"cp_segments"``."""
    out = {k: to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
    if documents and "positions" in input_dict:
        cu, longest = AttentionContext.document_offsets(input_dict["positions"])
        out["documents"] = (to_device(cu, device), longest)
    if cp_segments is not None:
        segments = cp_segments(input_dict.get("positions"), tuple(input_dict["input"].shape))
        out["cp_segments"] = segments.to(lambda t: _varying(to_device(t, device)))
    return out, to_device(labels, device)


def _varying(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its length marked as varying by batch for torch.compile when it is 1-D (segment offsets): the
    compiled blocks take it as a dynamic size from the first batch instead of recompiling at the first change."""
    if t.dim() == 1:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return t


def run_step(trainer, data_iterator, documents: bool) -> None:
    """One optimizer step of ``trainer`` (an ``AttnTrainer``) over its gradient-accumulation microbatches from
    ``data_iterator`` (torchtitan's ``batch_generator``: host tensors); ``documents`` as in :func:`batch_to_device`."""
    trainer.optimizers.zero_grad()
    lr = trainer.lr_schedulers.schedulers[0].get_last_lr()[0]
    microbatches = [next(data_iterator) for _ in range(trainer.gradient_accumulation_steps)]
    valid = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches)
    local_valid_tokens = to_device(torch.tensor(valid, dtype=torch.int64), trainer.device)
    dims = trainer.parallel_dims
    if dims.dp_enabled:
        global_valid_tokens = funcol.all_reduce(local_valid_tokens.float(), "sum", dims.get_mesh("batch"))
    else:
        global_valid_tokens = local_valid_tokens.float()
    model = trainer.model_parts[0]
    cp_segments = model.cp_segments if model.cp is not None else None
    losses = []
    for input_dict, labels in microbatches:
        input_dict, labels = batch_to_device(input_dict, labels, trainer.device, documents, cp_segments)
        loss = trainer.forward_backward_step(input_dict=input_dict, labels=labels,
                                             global_valid_tokens=global_valid_tokens)
        losses.append(loss.detach())
    grad_norm = dist_utils.clip_grad_norm_([p for m in trainer.model_parts for p in m.parameters()],
                                           trainer.job_config.training.max_norm, foreach=True, pp_mesh=None,
                                           ep_enabled=dims.ep_enabled)
    trainer.checkpointer.maybe_wait_for_staging()
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    if trainer.metrics_processor.should_log(trainer.step):
        log_step(trainer, torch.sum(torch.stack(losses)), global_valid_tokens, local_valid_tokens, grad_norm, lr)


def log_step(trainer, loss, global_valid_tokens, local_valid_tokens, grad_norm, lr) -> None:
    """torchtitan's metrics of a log step: the global mean loss, the largest rank-mean loss and the tokens seen
    (reduced over the data-parallel and context-parallel ranks), the gradient norm and the lr; then the non-finite
    guard's check of them and of the first bad step any rank saw (``NonFiniteGuard.first_bad``). All of it is read
    back in one host sync (torchtitan reads each with its own ``.item()``)."""
    dims = trainer.parallel_dims
    seen = trainer.ntokens_seen
    values = [loss, loss, grad_norm, trainer.nonfinite.first_bad()]
    if dims.dp_cp_enabled:
        mesh = dims.get_optional_mesh("loss")
        local_avg_loss = loss * global_valid_tokens / local_valid_tokens
        tokens = torch.full((), seen, dtype=torch.int64, device=loss.device)  # no host-to-device copy
        values[:2] = funcol.all_reduce(loss, "sum", mesh), funcol.all_reduce(local_avg_loss, "max", mesh)
        values.append(funcol.all_reduce(tokens, "sum", mesh))
    read = torch.stack([v.to(torch.float64).reshape(()) for v in values]).tolist()  # the step's one host sync
    global_avg_loss, global_max_loss, norm, first_bad = read[:4]
    trainer.metrics_processor.log(trainer.step, global_avg_loss, global_max_loss, norm,
                                  extra_metrics={"n_tokens_seen": int(read[4]) if dims.dp_cp_enabled else seen,
                                                 "lr": lr})
    trainer.nonfinite.check(trainer.step, global_avg_loss, norm, first_bad=int(first_bad))
