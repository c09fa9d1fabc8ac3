"""Cross-entropy of the LM head computed a chunk of tokens at a time, so the [T, V] logits never exist.

torchtitan's loss (``torchtitan.components.loss.cross_entropy_loss``) takes the logits: at 65,536 tokens a step and
Qwen3's 151,936-entry head the bf16 logits alone take 18.5 GiB, their fp32 upcast and its gradient twice that each.
Here the rows of the final hidden states are taken N at a time (``chunk_tokens``); for each chunk

    logits = h[chunk] @ Wᵀ                          # [N, V], compute dtype, then upcast to fp32
    loss  += Σ_counted rows (logsumexp(logits) − logits[label])
    g      = softmax(logits) − onehot(label)        # d loss / d logits, 0 on ignored rows
    grad_h[chunk] = g @ W,   grad_W += gᵀ @ h[chunk]

so the forward computes the gradients as it goes and leaves only grad_h [T, D] and grad_W [V, D] (fp32) for the
backward, which scales them by the incoming gradient (torchtitan's 1 / global token count). Peak extra memory is
O(N·V), about 6·N·V bytes in bf16 (the chunk's fp32 logits and their bf16 gradient), and the head runs its three
matmuls once, where recomputing each chunk's logits in the backward (activation checkpointing) would run the
forward matmul twice. This is liger-kernel's FusedLinearCrossEntropy
(Hsu et al., "Liger Kernel: Efficient Triton Kernels for LLM Training", 2024) in plain PyTorch.
"""

from __future__ import annotations

import torch

from torchtitan.components.loss import IGNORE_INDEX


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(h, W)`` computes in: autocast's when it is on for ``h``'s device, else ``h``'s."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


def _chunk(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, ignore_index: int,
           grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: (summed loss [] fp32, d loss / d logits [n, V] in ``h``'s dtype, or None without ``grad``).
    h: [n, D] and w: [V, D] in the compute dtype, labels: [n]. Works in place on the one fp32 [n, V] buffer
    (``torch.logsumexp`` would allocate a second)."""
    logits = (h @ w.t()).float()  # [n, V]
    valid = (labels != ignore_index).unsqueeze(1)  # [n, 1]
    target = labels.unsqueeze(1).where(valid, 0)  # [n, 1]
    picked = logits.gather(1, target)  # [n, 1] the labels' logits
    top = logits.amax(1, keepdim=True)  # [n, 1]
    e = logits.sub_(top).exp_()  # [n, V] exp(logits − max)
    total = e.sum(1, keepdim=True)  # [n, 1]
    loss = (top + total.log() - picked).where(valid, 0).sum()  # logsumexp − the label's logit
    if not grad:
        return loss, None
    p = e.mul_(total.reciprocal().where(valid, 0))  # softmax; an ignored row is 0: no gradient
    p.scatter_add_(1, target, -valid.to(p.dtype))  # minus the one-hot of each counted label
    return loss, p.to(h.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk_tokens, ignore_index, dtype):
        need_h, need_w = ctx.needs_input_grad[:2]
        hc, wc = h.to(dtype), weight.to(dtype)
        grad_h = torch.empty_like(hc) if need_h else None  # [T, D]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None  # [V, D]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):  # the operands are in the compute dtype already
            for start in range(0, h.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                chunk_loss, g = _chunk(hc[rows], wc, labels[rows], ignore_index, grad=True)
                loss += chunk_loss
                if need_h:
                    torch.mm(g, wc, out=grad_h[rows])
                if need_w:
                    grad_w += g.t() @ hc[rows]  # each chunk's [V, D] in the compute dtype, summed in fp32
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = h.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (None if grad_h is None else (grad_h * grad_loss).to(h_dtype),
                None if grad_w is None else (grad_w * grad_loss).to(w_dtype), None, None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed cross-entropy of the logits ``h @ weightᵀ`` against ``labels``, ``chunk_tokens`` rows at a time.

    h: [T, D] (the normed final hidden states, flattened over the batch); weight: [V, D] (the head, tied to the
    embedding or not); labels: [T] int64, rows equal to ``ignore_index`` count nothing. Returns an fp32 scalar with
    the value and the gradients (for h and weight) of torchtitan's ``cross_entropy_loss(F.linear(h, weight),
    labels)``: logits in the compute dtype (:func:`compute_dtype`) upcast to fp32, sum reduction. No more than
    ``chunk_tokens`` × V logits exist at once; without autograd (``torch.no_grad``, or nothing requiring grad) only
    the loss is computed."""
    if h.ndim != 2 or weight.ndim != 2 or weight.shape[1] != h.shape[1] or labels.shape != h.shape[:1]:
        raise ValueError(f"linear_cross_entropy: expected h [T, D], weight [V, D], labels [T]; got h "
                         f"{list(h.shape)}, weight {list(weight.shape)}, labels {list(labels.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"linear_cross_entropy: chunk_tokens={chunk_tokens}: must be > 0")
    dtype = compute_dtype(h)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, labels, chunk_tokens, ignore_index, dtype)
    hc, wc = h.to(dtype), weight.to(dtype)
    with torch.autocast(h.device.type, enabled=False):
        return sum((_chunk(hc[s:s + chunk_tokens], wc, labels[s:s + chunk_tokens], ignore_index, grad=False)[0]
                    for s in range(0, h.shape[0], chunk_tokens)), torch.zeros((), device=h.device))
