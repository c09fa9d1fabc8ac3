"""The contract between the model and every attention mechanism.

A mechanism is an ``nn.Module`` registered with :func:`attention.registry.register_attention`.
The model builds it as ``cls(args, opts)`` and calls ``module(x, ctx)``:

- ``args`` (:class:`AttentionArgs`): sizes shared by every mechanism (dim, heads, head dim, layer index).
- ``opts``: the mechanism's own options dataclass, filled from ``[attention.<name>]`` in the TOML.
- ``x``: ``[B, T, dim]`` hidden states (already normed by the block).
- ``ctx`` (:class:`AttentionContext`): token positions, document boundaries, the RoPE table and,
  when decoding, the per-layer cache.

Every mechanism module implements

- ``forward(x, ctx) -> [B, T, dim]``;
- ``init_weights(init_std)``: called under ``torch.no_grad()`` after meta-device construction; output
  projections use ``init_std`` (depth-scaled), input projections 0.02 (torchtitan's convention). Under FSDP the
  parameters are sharded DTensors: write them in place (``nn.init``, ``fill_``, ``uniform_``) or, for values
  computed as a whole tensor, through :func:`copy_full_`;
- ``flops_per_token(seq_len) -> int``: forward FLOPs per token of the parameter-free token mixing, averaged over
  the tokens of one causal sequence (one document) of ``seq_len`` tokens: the work the mask leaves, so a
  softmax query sees (seq_len + 1) / 2 keys on average (:func:`causal_pairs`); chunked forms count the chunk
  blocks they compute. Matmuls with weights are counted by the model as 6·N; the model multiplies this by 3
  for fwd+bwd and sums it over documents (``models.args.ModelArgs.training_flops``);
- ``init_cache(batch_size, max_len, device, dtype)`` (optional): a cache object for decoding.
  During decoding ``ctx.cache`` is this layer's cache and ``ctx.positions`` holds absolute positions.

Context parallelism (:mod:`attention.cp`, docs/context_parallel.md): a mechanism that runs under it sets the class
attribute ``context_parallel = True`` (the configuration refuses the others). Then, for training and validation
(no cache):

- it receives ``x`` [B, 2c, dim], this rank's two chunks of every row (chunks r and 2N − 1 − r of 2N chunks of
  c = T / (2N) tokens, in that order); ``ctx.cp``, this rank's :class:`attention.cp.ContextParallel`;
  ``ctx.positions`` [B, 2c], the local tokens' positions in their documents (RoPE as usual); ``ctx.cp_docs``
  [B, T] int64, the document index of every token of the whole row in global order; ``ctx.cu_seqlens`` None;
- it returns [B, 2c, dim]: the one-process output at its local tokens, documents respected across the chunks;
- it communicates only through the primitives of ``ContextParallel``, each differentiable (the backward sums every
  token's gradient back to the rank holding it): ``gather`` with ``segments`` (the whole row, attention over it as
  variable-length segments), ``halo`` with ``halo_segments`` (the tokens before each chunk), ``states_entering``
  with ``chunk_segments`` (a chunked affine recurrence's state entering each chunk). The segments depend only on the
  batch: a mechanism takes them from ``ctx.cp_segments`` (:class:`attention.cp.BatchSegments`, built once per step on
  the host by the trainer); a module whose CP path takes ``halo_segments(width)`` names that width in its attribute
  ``cp_halo_width``, so the trainer builds those too. A pattern none of them covers is added there, named
  for what it communicates, not for the mechanism;
- its algorithm lives with it, a ``*_cp`` method beside the one-process path it replaces, chosen on ``ctx.cp``:
  ``SoftmaxAttention.mix_cp``, ``DeltaRuleAttention._mix_cp``, and ``ShortConvolution.forward_cp`` for the
  convolution the linear family shares. Not in ``attention.cp`` (layout and communication only) and not in
  ``attention.ops``: the kernels know nothing of ranks; the algorithm hands them segments and initial states.

``tests/test_context_parallel.py`` checks the layout and the primitives in one process, and trains every mechanism
that sets ``context_parallel = True`` on 2 gloo processes (CP = 2) against one process, documents crossing the
chunks: training and validation losses within 1e-4, and the CP checkpoint resumed on one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.models.qwen3.model.model import precompute_rope_cache, rotate_half
from torchtitan.models.utils import trunc_normal_

from attnlab.attention.cp import BatchSegments


@dataclass
class AttentionArgs:
    """Sizes every mechanism receives. ``impl`` is ``[attention] impl`` ("auto" picks per device)."""

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    layer_id: int = 0
    n_layers: int = 1
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_seq_len: int = 4096
    impl: str = "auto"


@dataclass
class AttentionContext:
    """Per-forward information shared by all layers.

    positions:  [B, T] int64, position of each token inside its document (restarts at 0 after a
                document boundary when documents are packed), absolute positions when decoding.
    cu_seqlens: [N + 1] int32 offsets of the N documents in the flattened ``B*T`` token stream
                (fla's varlen convention; each batch row boundary is also a document boundary), or
                None when every row is one causal sequence.
    max_seqlen: longest document (int), valid when ``cu_seqlens`` is set.
    rope_theta: RoPE base; ``rope(head_dim)`` returns the cos/sin table for that head dim.
    cache:      the layer's decode cache (set by the model per layer), or None when training.
    cp:         under context parallelism (:mod:`attention.cp`), this rank's :class:`attention.cp.ContextParallel`:
                ``positions`` are then the local tokens' (T / N of each row) and ``cu_seqlens`` is None.
    cp_docs:    with ``cp``: [B, T] int64 document index of every token of the whole row, in global order.
    cp_segments: with ``cp``: the batch's segment layouts (:class:`attention.cp.BatchSegments`): given (the trainer
                builds them on the host), or built from ``cp_docs`` on first use.
    """

    positions: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    rope_theta: float = 1e6
    cache: Any = None
    max_position: int = 0
    cp: Any = None
    cp_docs: torch.Tensor | None = None
    cp_segments: Any = None
    _rope: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.cp is not None and self.cp_segments is None:
            self.cp_segments = BatchSegments(self.cp, self.cp_docs, self.positions)

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def rope(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [B, T, 1, head_dim] float32 for ``self.positions`` (HF/Qwen3 half-rotation layout).
        The model fills the cache for its head dim before the (compiled) blocks run; other head dims are
        computed on the fly inside compiled code (no cache mutation, no host sync there)."""
        if head_dim in self._rope:
            return self._rope[head_dim]
        n = self.max_position or int(self.positions.max().item()) + 1
        table = precompute_rope_cache(head_dim, n, self.rope_theta).to(self.positions.device)
        t = table[self.positions]  # [B, T, 2*head_dim]
        cos_sin = (t[..., None, :head_dim], t[..., None, head_dim:])
        if not torch.compiler.is_compiling():
            self._rope[head_dim] = cos_sin
        return cos_sin

    def use_rope_table(self, table: torch.Tensor) -> None:
        """Fill the cos/sin of head dim ``table.shape[-1] // 2`` from a precomputed table (torchtitan's
        ``precompute_rope_cache`` layout, [L, 2 * head_dim], L > every position, on the positions' device):
        one gather, no host work that grows with T."""
        head_dim = table.shape[-1] // 2
        t = table[self.positions]  # [B, T, 2*head_dim]
        self._rope[head_dim] = (t[..., None, :head_dim], t[..., None, head_dim:])

    @staticmethod
    def document_offsets(positions: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The packed documents of ``positions`` [B, T] (a new document wherever ``positions == 0`` and at every row
        start) as (cu_seqlens [n_docs + 1] int32 offsets into the B·T flattened tokens, the longest document's
        length), on ``positions``' device: O(B·T) host work and no sync on the host, where the trainer computes
        them before the batch's copy (:mod:`attnlab.trainer.step`); two reads back from a GPU."""
        B, T = positions.shape
        starts = positions.reshape(-1) == 0
        starts[::T] = True  # every row starts a document
        first = starts.nonzero().flatten()  # document starts, ascending
        cu = torch.cat([first, torch.full((1,), B * T, device=positions.device)]).to(torch.int32)
        return cu, int((cu[1:] - cu[:-1]).max())

    @staticmethod
    def from_positions(positions: torch.Tensor, block_causal: bool, rope_theta: float,
                       documents: tuple[torch.Tensor, int] | None = None) -> "AttentionContext":
        """Build the context for a training batch. With ``block_causal`` the documents are
        :meth:`document_offsets` of ``positions``, or ``documents`` when the caller computed them already.

        Host syncs: none for causal rows (positions restart in every row, so they are < T) or given ``documents``;
        otherwise :meth:`document_offsets`' two reads on a GPU."""
        T = positions.shape[1]
        if not block_causal:
            return AttentionContext(positions=positions, rope_theta=rope_theta, max_position=T)
        cu, max_seqlen = documents if documents is not None else AttentionContext.document_offsets(positions)
        return AttentionContext(positions=positions, cu_seqlens=cu, max_seqlen=max_seqlen, rope_theta=rope_theta,
                                max_position=T)


def mix_whole_rows(ctx: AttentionContext, mix, *xs: torch.Tensor | None) -> torch.Tensor:
    """Under context parallelism: a one-process token mixer over the whole rows, this rank's tokens of its output.
    ``xs``: token-wise inputs [B, 2c, ...] (this rank's two chunks; None passes through), each all-gathered into
    the row's [B, T, ...] (:meth:`attention.cp.ContextParallel.gather`); ``mix(*rows, cu_seqlens=...)`` runs on
    them with the rows' documents as segments over the B·T tokens
    (:meth:`attention.cp.ContextParallel.row_segments`) and returns [B, T, ...]; the result is cut back to
    [B, 2c, ...]. Exact for any causal mixer; each rank computes the mixing of the whole row (the projections,
    MLPs and loss around it stay divided over the ranks)."""
    cp = ctx.cp
    cu = ctx.cp_segments.row_segments()
    rows = [None if x is None else cp.gather(x, 1) for x in xs]
    return cp.shard(mix(*rows, cu_seqlens=cu), 1)


def causal_pairs(seq_len: int, window: int = 0) -> int:
    """(query, key) pairs a causal mask keeps over one sequence of ``seq_len`` tokens: query i (1-based) sees keys
    1..i, or only the last ``window`` of them when ``window`` > 0, so Σ_i min(i, window); seq_len·(seq_len+1)/2
    without a window."""
    w = min(window, seq_len) if window > 0 else seq_len
    return w * (w + 1) // 2 + (seq_len - w) * w


@torch.no_grad()
def copy_full_(p: torch.Tensor, full: torch.Tensor) -> None:
    """Write ``full`` (the whole, unsharded value, ``p.shape``) into parameter ``p``, plain or FSDP2 DTensor.

    A DTensor takes its own shard of ``full`` (``src_data_rank=None``: every rank slices the tensor it computed,
    no communication), so ``full`` must be the same on every rank or, when drawn at random, any draw of it.
    """
    full = full.to(device=p.device, dtype=p.dtype)
    if isinstance(p, DTensor):
        full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    p.copy_(full)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-rotation layout (Qwen3/HF). x: [B, T, H, D]; cos, sin: [B, T, 1, D]."""
    return (x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)).type_as(x)


class QKVAttentionBase(nn.Module):
    """Qwen3-style q/k/v/o projections (torchtitan Qwen3 names: wq wk wv wo q_norm k_norm) with optional
    q/k RMSNorm and RoPE: the front end shared by softmax, Parallax, LLA and the affine family."""

    def __init__(self, args: AttentionArgs, qk_norm: bool, rope: bool = True):
        super().__init__()
        if args.n_heads % args.n_kv_heads:
            raise ValueError(f"model.n_heads={args.n_heads} must be a multiple of model.n_kv_heads={args.n_kv_heads}")
        self.args = args
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.rope = rope
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if qk_norm else None

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def project_qkv(self, x: torch.Tensor, ctx: AttentionContext):
        """x: [B, T, dim] -> q [B, T, HQ, D], k, v [B, T, HKV, D] (q/k normed and RoPE'd)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            cos, sin = ctx.rope(self.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v
