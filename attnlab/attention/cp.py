"""Context parallelism: every sequence of a batch split over the N ranks of a CP group (docs/context_parallel.md).

Layout (causal load balancing): a row of T tokens is cut into 2N chunks of c = T / (2N) tokens and rank r holds
chunks r and 2N − 1 − r, in that order (its T / N local tokens). Under a causal mask the queries of chunk i see
i + 1 chunks of keys, so each rank's pair sees 2N + 1 chunks: every rank does the same attention work.

The trainer shards the batch (tokens, labels, document positions) with :meth:`ContextParallel.shard`; everything
token-wise (embeddings, MLPs, norms, projections, RoPE at each token's own position, the loss) then runs on the
local tokens unchanged. The mechanisms that mix tokens communicate (``context_parallel = True`` on the mechanism
class; the configuration refuses the others):

- softmax / Parallax: the keys and values of every rank, all-gathered into global order ([B, T, HKV, D] each,
  :meth:`ContextParallel.gather`); in the backward each rank receives the summed gradient of its own keys and
  values (a reduce-scatter). Queries, and Parallax's probe ρ (one per query), stay local. Each chunk's queries
  attend over the row's keys up to the chunk's end as variable-length segments, one per document piece, queries
  aligned at their segment's end (:meth:`ContextParallel.segments`): the document mask spans the shards, and the
  attention kernels (the project's Triton kernels, the reference) run unchanged.
- the delta-rule family (DeltaNet, GDN, KDA): the state entering each chunk (:func:`delta_rule_cp`). Each rank runs
  its chunks once more from the identity to get their transitions, all-gathers them ([B, 2N, H, K, V + K]) and
  composes the states entering its chunks; no rank waits for another's recurrence.
- their short convolutions: the K − 1 inputs before each chunk (:func:`short_conv_cp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class ContextParallel:
    """One rank's view of its CP group: ``size`` ranks, this one ``rank``, collectives over ``group``."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    @staticmethod
    def from_mesh(mesh) -> "ContextParallel":
        """The CP group of a one-dimensional device mesh (torchtitan's ``parallel_dims.get_mesh("cp")``)."""
        return ContextParallel(mesh.get_group(), mesh.size(), mesh.get_local_rank())

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunks (of 2N) this rank (or ``rank``) holds, in local order."""
        rank = self.rank if rank is None else rank
        return rank, 2 * self.size - 1 - rank

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's T / N tokens of ``x`` (T along ``dim``, a multiple of 2N): chunks r and 2N − 1 − r."""
        if x.shape[dim] % (2 * self.size):
            raise ValueError(f"context parallelism over {self.size} ranks needs sequences of a multiple of "
                             f"{2 * self.size} tokens, got {x.shape[dim]}")
        parts = x.chunk(2 * self.size, dim)
        a, b = self.chunks()
        return torch.cat([parts[a], parts[b]], dim)

    def by_rank(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``x`` with ``dim`` moved first and its 2N chunks reordered by the rank that holds them (rank 0's two, then
        rank 1's, ...), contiguous: the input of a reduce-scatter whose r-th piece is :meth:`shard` of rank r with
        ``dim`` first. One copy."""
        parts = x.movedim(dim, 0).chunk(2 * self.size, 0)
        return torch.cat([parts[i] for r in range(self.size) for i in self.chunks(r)], 0)

    def global_index(self, local_len: int, device) -> torch.Tensor:
        """[local_len] int64: the global position in the row of each local token."""
        c = local_len // 2
        a, b = self.chunks()
        o = torch.arange(c, device=device)
        return torch.cat([a * c + o, b * c + o])

    def assemble(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Every rank's local tensor (``parts[r]``, as :meth:`shard` cut it) back in global order along ``dim``."""
        halves = [p.chunk(2, dim) for p in parts]
        n = self.size
        return torch.cat([halves[i][0] for i in range(n)] + [halves[2 * n - 1 - i][1] for i in range(n, 2 * n)], dim)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """All ranks' ``x`` in global order along ``dim`` (local length × N). Differentiable: the backward gives
        each rank the gradient of its own tokens summed over the ranks that used them."""
        return _Gather.apply(x, self, dim)

    def shard_batch(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        """torchtitan's ``post_dataloading_process`` result for this rank: (tokens, labels, the other inputs such
        as the document positions, no keyword arguments), each [B, T] cut to this rank's [B, T / N]."""
        inputs = {k: self.shard(v) for k, v in input_dict.items()}
        return inputs.pop("input"), self.shard(labels), inputs, {}

    def segments(self, docs: torch.Tensor, half: int) -> "Segments":
        """The attention of this rank's chunk ``half`` (0: chunk r, 1: chunk 2N − 1 − r; c tokens per row) as
        variable-length segments with queries at the end of their keys. ``docs``: [B, T] document index of every
        token of the row in global order (:func:`documents`; 0 everywhere for one causal sequence per row).

        The chunk's queries, flattened over the B rows ([B·c]), see the row's keys up to the chunk's end
        (hi = (chunk + 1)·c of each row, flattened: [B·hi]). Per row the keys split at the start of the document
        holding the chunk's first token and at every document start inside the chunk; each piece is a segment whose
        queries are the chunk's tokens in it, the last of its keys (a query at key position j of its segment sees
        keys 0..j, flash-attention's bottom-right causal alignment). The keys before the first document are a
        segment without queries."""
        B, T = docs.shape
        c = T // (2 * self.size)
        chunk = self.chunks()[half]
        lo, hi = chunk * c, (chunk + 1) * c
        d = docs[:, :hi]
        is_start = torch.ones_like(d, dtype=torch.bool)
        is_start[:, 1:] = d[:, 1:] != d[:, :-1]
        pos = torch.arange(hi, device=d.device)
        first = torch.where(is_start, pos, 0).cummax(1).values[:, lo]  # [B] start of the chunk's first document
        bound = torch.zeros_like(is_start)
        bound[:, 0] = True
        bound[:, lo + 1:] = is_start[:, lo + 1:]
        bound[torch.arange(B, device=d.device), first] = True
        starts = bound.reshape(-1).nonzero().flatten()  # segment starts over the B·hi keys
        row, key = starts // hi, starts % hi
        end_k, end_q = starts.new_tensor([B * hi]), starts.new_tensor([B * c])
        cu_k = torch.cat([starts, end_k]).to(torch.int32)
        cu_q = torch.cat([row * c + (key - lo).clamp(min=0), end_q]).to(torch.int32)
        lens = torch.stack([cu_q.diff(), cu_k.diff()]).amax(1).tolist()  # one host sync per forward
        return Segments(cu_q, cu_k, lens[0], lens[1], hi)


@dataclass
class Segments:
    """One chunk's attention as variable-length segments (:meth:`ContextParallel.segments`)."""

    cu_q: torch.Tensor
    """[S + 1] int32: segment offsets over the chunk's B·c queries (a segment may have none)."""
    cu_k: torch.Tensor
    """[S + 1] int32: segment offsets over the B·keys keys, the first ``keys`` of each row."""
    max_q: int
    max_k: int
    keys: int
    """Keys per row the chunk sees: the row's tokens up to the chunk's end."""


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: ContextParallel, dim: int) -> torch.Tensor:
        ctx.cp, ctx.dim = cp, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x, group=cp.group)
        return cp.assemble(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every rank holds the gradient of all T tokens from its own queries: sum over the group, keep our tokens.
        # NCCL reduce-scatters (each rank's two chunks put next to each other first, ``by_rank``); gloo (no
        # reduce-scatter) all-reduces and cuts out its own.
        cp, dim = ctx.cp, ctx.dim
        if dist.get_backend(cp.group) != "nccl":
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=cp.group)
            return cp.shard(grad, dim), None, None
        by_rank = cp.by_rank(grad, dim)
        out = by_rank.new_empty(by_rank.shape[0] // cp.size, *by_rank.shape[1:])
        dist.reduce_scatter_tensor(out, by_rank, group=cp.group)
        return out.movedim(0, dim), None, None


def documents(positions: torch.Tensor) -> torch.Tensor:
    """[B, T] document index of every token of each row from its per-document ``positions`` (a document starts
    where the position is 0, and at every row start)."""
    starts = positions == 0
    starts[:, 0] = True
    return starts.cumsum(1)


def _segments(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``starts`` [R, L] bool, True at the first token of every segment (column 0 included) -> (cu_seqlens [S + 1]
    int32 over the R·L flattened tokens, [R, L] int64 segment index of every token)."""
    flat = starts.reshape(-1)
    first = flat.nonzero().flatten()
    cu = torch.cat([first, first.new_tensor([flat.numel()])]).to(torch.int32)
    return cu, (flat.cumsum(0) - 1).view_as(starts)


def short_conv_cp(conv, x: torch.Tensor, ctx) -> torch.Tensor:
    """A causal short convolution (``attention.linear_common.ShortConvolution``) of this rank's two chunks
    x [B, 2c, C] under context parallelism: each chunk is extended by the K − 1 inputs before it in the row (every
    rank's chunk tails, all-gathered), which count only where they belong to the same document."""
    cp = ctx.cp
    B, L, C = x.shape
    c, k1 = L // 2, conv.kernel_size - 1
    if c < k1:
        raise ValueError(f"context parallelism over {cp.size} ranks cuts sequences into chunks of {c} tokens, fewer "
                         f"than the short convolution's {k1} inputs of history; use longer sequences")
    chunks = x.view(B, 2, c, C)
    tails = cp.gather(chunks[:, :, c - k1:], dim=1)  # [B, 2N, K-1, C]: the last inputs of every chunk
    before = torch.cat([x.new_zeros(B, 1, k1, C), tails[:, :-1]], 1)  # the K-1 inputs before each chunk
    ext = torch.cat([before[:, list(cp.chunks())], chunks], 2)  # [B, 2, K-1+c, C]
    cu = ctx.once(("cp_conv_segments", k1), lambda: _extended_segments(ctx, c, k1))
    y, _ = conv(ext.reshape(1, 2 * B * (k1 + c), C), cu_seqlens=cu)
    return y.view(B, 2, k1 + c, C)[:, :, k1:].reshape(B, L, C)


def _extended_segments(ctx, c: int, k1: int) -> torch.Tensor:
    """cu_seqlens of this rank's two chunks, each with the ``k1`` tokens before it in the row: a segment per
    document (the tokens before the row's start are one of their own)."""
    a, b = ctx.cp.chunks()
    pos = torch.stack([i * c - k1 + torch.arange(k1 + c, device=ctx.cp_docs.device) for i in (a, b)])  # [2, K-1+c]
    docs = ctx.cp_docs[:, pos.clamp(min=0)].masked_fill(pos < 0, -1)  # [B, 2, K-1+c]; -1 before the row
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[..., 1:] = docs[..., 1:] != docs[..., :-1]
    return _segments(starts.reshape(-1, k1 + c))[0]


def delta_rule_cp(q, k, v, beta, g, ctx, **kw) -> torch.Tensor:
    """The delta rule (``attention.ops.delta_rule.delta_rule``, any impl; ``kw`` its options) over this rank's two
    chunks under context parallelism. q, k: [B, 2c, H, K]; v: [B, 2c, H, V]; beta: [B, 2c, H]; g: None,
    [B, 2c, H] or [B, 2c, H, K]; returns o [B, 2c, H, V].

    The state h [K, V] changes as h ← A_t h + β_t k_t v_tᵀ with A_t = (I − β_t k_t k_tᵀ) D_t, linear in h column by
    column, so a chunk maps the state h entering it to M h + B (M = its A_t multiplied out, K × K). Started from
    [0 | I] with values [v | 0], the chunk's final state is [B | M]: one run of the same kernel over V + K columns.
    The ranks all-gather every chunk's (B, M) and each composes the states entering its own chunks,
    S_i = M_{i−1} S_{i−1} + B_{i−1} from S_0 = 0 (0 again where chunk i starts a document), then runs its chunks from
    them. Documents inside a chunk are separate segments (the kernel's varlen form); a chunk whose last document
    starts inside it has M = 0."""
    from attnlab.attention.ops.delta_rule import delta_rule

    cp = ctx.cp
    B, L, H, K = q.shape
    V, c = v.shape[-1], L // 2
    cu, first, last, cont = ctx.once("cp_chunk_segments", lambda: _chunk_segments(ctx, c))
    flat = lambda t: None if t is None else t.reshape(1, B * L, *t.shape[2:])  # noqa: E731
    segments = cu.numel() - 1
    h0 = torch.zeros(segments, H, K, V + K, device=q.device)
    h0[first, :, :, V:] = torch.eye(K, device=q.device)
    v_ext = torch.cat([v, v.new_zeros(B, L, H, K)], -1)
    _, final = delta_rule(flat(q), flat(k), flat(v_ext), flat(beta), flat(g), initial_state=h0,
                          output_final_state=True, cu_seqlens=cu, **kw)
    maps = cp.gather(final[last].view(B, 2, H, K, V + K), dim=1)  # [B, 2N, H, K, V+K]: every chunk's [B | M]
    states = [torch.zeros(B, H, K, V, device=q.device)]
    for i in range(1, max(cp.chunks()) + 1):
        b_prev, m_prev = maps[:, i - 1, ..., :V], maps[:, i - 1, ..., V:]
        states.append(cont[:, i - 1] * (m_prev @ states[-1] + b_prev))
    entering = torch.stack([states[i] for i in cp.chunks()], 1).reshape(B * 2, H, K, V)
    h_in = torch.zeros(segments, H, K, V, device=q.device).index_put((first,), entering)
    o, _ = delta_rule(flat(q), flat(k), flat(v), flat(beta), flat(g), initial_state=h_in, cu_seqlens=cu, **kw)
    return o.view(B, L, H, V)


def _chunk_segments(ctx, c: int):
    """This rank's two chunks of ``c`` tokens per row as variable-length segments, one per document piece:
    (cu_seqlens, the segment [B·2] each chunk starts with, the one it ends with, [B, 2N−1, 1, 1, 1] 1.0 where chunk
    i = 1..2N−1 continues the document of chunk i − 1, else 0.0)."""
    starts = ctx.positions == 0
    starts[:, [0, c]] = True  # each chunk is its own stretch of the row
    cu, seg = _segments(starts)
    ends = torch.arange(1, 2 * ctx.cp.size, device=starts.device) * c  # first token of chunks 1..2N-1
    cont = (ctx.cp_docs[:, ends] == ctx.cp_docs[:, ends - 1]).float()[:, :, None, None, None]
    return cu, seg[:, [0, c]].reshape(-1), seg[:, [c - 1, 2 * c - 1]].reshape(-1), cont
