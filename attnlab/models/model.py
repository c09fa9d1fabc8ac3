"""Qwen3-style decoder with a pluggable attention block.

Pre-norm RMSNorm blocks, SwiGLU MLP (torchtitan's ``FeedForward``), RoPE (θ = 1e6), optional tied
embeddings; the token mixer of each layer comes from the attention registry (``[model] attention`` or
``layer_pattern``). The model never tests mechanism names. Module and parameter names follow torchtitan's
Qwen3 (``tok_embeddings``, ``layers.<i>.attention.wq`` …) so its parallelisation helpers and Hugging Face
state-dict adapter apply.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from torchtitan.models.qwen3.model.model import FeedForward, precompute_rope_cache
from torchtitan.models.utils import trunc_normal_
from torchtitan.protocols.train_spec import ModelProtocol

from attnlab.attention import build_attention
from attnlab.attention.base import AttentionArgs, AttentionContext
from attnlab.attention.cp import BatchSegments, documents
from attnlab.models.args import ModelArgs
from attnlab.models.loss import linear_cross_entropy


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, mechanism: str, args: ModelArgs):
        super().__init__()
        attn_args = AttentionArgs(dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                                  head_dim=args.head_dim, layer_id=layer_id, n_layers=args.n_layers,
                                  norm_eps=args.norm_eps, rope_theta=args.rope_theta,
                                  max_seq_len=args.max_seq_len, impl=args.attn_impl)
        self.attention = build_attention(mechanism, attn_args, args.attention_options.get(mechanism))
        self.feed_forward = FeedForward(dim=args.dim, hidden_dim=args.hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = False  # read by torchtitan's apply_compile / apply_ac
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), ctx)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Head(nn.Linear):
    """The LM head, dim -> vocab without bias. ``head(x)`` gives the logits; ``head(x, labels, chunk_tokens)`` the
    summed cross-entropy of those logits, ``chunk_tokens`` tokens at a time, without holding them
    (:func:`models.loss.linear_cross_entropy`). One module for both, so FSDP's hooks on it, which gather
    ``output.weight`` for the forward and again for the backward when it was resharded, fire on either path."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, chunk_tokens: int = 0) -> torch.Tensor:
        if labels is None:
            return super().forward(x)
        return linear_cross_entropy(x.flatten(0, -2), self.weight, labels.flatten(), chunk_tokens)


class Transformer(ModelProtocol):
    def __init__(self, model_args: ModelArgs):
        super().__init__(model_args)
        self.model_args = args = model_args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, mech, args) for i, mech in enumerate(args.layer_mechanisms())}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = Head(args.dim, args.vocab_size, bias=False)
        if args.enable_weight_tying:
            self.output.weight = self.tok_embeddings.weight
        self._rope_tables: dict[tuple[int, int, torch.device], torch.Tensor] = {}  # not state: rebuilt on demand
        self.cp = None  # attention.cp.ContextParallel under context parallelism (models.parallelize sets it)

    def rope_table(self, head_dim: int, length: int, device: torch.device) -> torch.Tensor:
        """torchtitan's RoPE table [length, 2 * head_dim] (cos | sin) on ``device``, built once per
        (head dim, length, device) and kept, so no host work per step grows with T (rebuilding it per step left
        the GPU idle at every step's start). Computed on the CPU as torchtitan does, so the values equal its."""
        key = (head_dim, length, torch.device(device))
        if key not in self._rope_tables:
            self._rope_tables[key] = precompute_rope_cache(head_dim, length, self.model_args.rope_theta).to(device)
        return self._rope_tables[key]

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        if self.model_args.enable_weight_tying:
            self.output.weight = self.tok_embeddings.weight  # re-tie after meta-device construction
        std = self.model_args.dim**-0.5
        trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def context(self, tokens: torch.Tensor, positions: torch.Tensor | None,
                documents: tuple[torch.Tensor, int] | None = None,
                cp_segments: BatchSegments | None = None) -> AttentionContext:
        """Positions restart at every document when ``attn_mask_type = "block_causal"``; otherwise each row
        is one causal sequence and ``positions`` from the data loader are ignored. ``documents``: the documents'
        offsets, already computed from ``positions`` (:meth:`AttentionContext.document_offsets`); ``cp_segments``
        likewise under context parallelism (:meth:`cp_segments`)."""
        block = self.model_args.attn_mask_type == "block_causal"
        if self.cp is not None:
            return self.cp_context(tokens, positions if block else None, cp_segments)
        if positions is None or not block:
            B, T = tokens.shape
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        ctx = AttentionContext.from_positions(positions, block, self.model_args.rope_theta, documents)
        # positions restart in every row (< T)
        self.fill_rope(ctx, tokens.shape[1], tokens.device)
        return ctx

    def cp_context(self, tokens: torch.Tensor, positions: torch.Tensor | None,
                   segments: BatchSegments | None = None) -> AttentionContext:
        """The context under context parallelism: ``tokens`` [B, T/N] and the documents' ``positions`` are this
        rank's shard of each row (:meth:`attention.cp.ContextParallel.shard`); the document index of every token of
        the row comes from ``segments`` (:meth:`cp_segments`, built by the trainer) or else from all ranks'
        positions (None: one causal sequence per row)."""
        cp = self.cp
        B, n = tokens.shape
        if segments is not None:
            docs = None  # the layouts are built (BatchSegments.to)
        elif positions is None:
            docs = torch.zeros(B, n * cp.size, dtype=torch.int64, device=tokens.device)
        else:
            docs = documents(cp.gather(positions))
        if positions is None:
            positions = cp.global_index(n, tokens.device).expand(B, n)
        ctx = AttentionContext(positions=positions, rope_theta=self.model_args.rope_theta, max_position=n * cp.size,
                               cp=cp, cp_docs=docs, cp_segments=segments)
        self.fill_rope(ctx, n * cp.size, tokens.device)
        return ctx

    def cp_segments(self, positions: torch.Tensor | None, shape: tuple[int, int]) -> BatchSegments:
        """Under context parallelism: every segment layout this rank's layers take of a batch of ``shape`` [B, T]
        (whole rows), built from its per-document ``positions`` [B, T] on the host, before the batch's copy (the
        trainer, :mod:`attnlab.trainer.step`), so no layer reads them back from the device. The halo widths are the
        ``cp_halo_width`` of the modules that have one."""
        block = self.model_args.attn_mask_type == "block_causal"
        return BatchSegments.on_host(self.cp, positions if block else None, shape).build(self._cp_halo_widths)

    @functools.cached_property
    def _cp_halo_widths(self) -> list[int]:
        """The ``cp_halo_width`` of the modules that have one (asked once, not per batch)."""
        return sorted({m.cp_halo_width for m in self.modules() if hasattr(m, "cp_halo_width")})

    def fill_rope(self, ctx: AttentionContext, length: int, device: torch.device) -> None:
        """Give ``ctx`` the cos/sin of its positions (all < ``length``) from the cached table of
        max(max_seq_len, length) rows, so one table serves every batch and every decode step."""
        length = max(self.model_args.max_seq_len, length)
        ctx.use_rope_table(self.rope_table(self.model_args.head_dim, length, device))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                ctx: AttentionContext | None = None, labels: torch.Tensor | None = None,
                loss_chunk_tokens: int = 0, documents: tuple[torch.Tensor, int] | None = None,
                cp_segments: BatchSegments | None = None) -> torch.Tensor:
        """tokens: [B, T] int64 -> logits [B, T, vocab]. ``ctx`` overrides the context (decoding). With ``labels``
        [B, T] (training under ``training.loss_chunk_tokens``): the summed cross-entropy over the labels that are not
        torchtitan's IGNORE_INDEX instead, an fp32 scalar, computed ``loss_chunk_tokens`` tokens at a time without
        the [B, T, vocab] logits (:class:`Head`). ``documents``: (cu_seqlens [n_docs + 1] int32, the longest
        document) of ``positions``, computed by the trainer on the host (:mod:`attnlab.trainer.step`); ``cp_segments``
        likewise under context parallelism (:meth:`cp_segments`)."""
        ctx = ctx if ctx is not None else self.context(tokens, positions, documents, cp_segments)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, ctx)
        if labels is None:  # x alone: a head a float8/MX converter swapped in is a plain Linear
            return self.output(self.norm(h))
        return self.output(self.norm(h), labels, loss_chunk_tokens)
