"""Context parallelism: every sequence of a batch split over the N ranks of a CP group (docs/context_parallel.md).

This module holds the sequence layout and the communication, nothing of any one mechanism; each mechanism's CP
algorithm lives with that mechanism and is built from the primitives below (the contract: ``attention.base``).

Layout (causal load balancing): a row of T tokens is cut into 2N chunks of c = T / (2N) tokens and rank r holds
chunks r and 2N − 1 − r, in that order (its T / N local tokens). Under a causal mask the queries of chunk i see
i + 1 chunks of keys, so each rank's pair sees 2N + 1 chunks: every rank does the same attention work.

The trainer shards the batch (tokens, labels, document positions) with :meth:`ContextParallel.shard`; everything
token-wise (embeddings, MLPs, norms, projections, RoPE at each token's own position, the loss) then runs on the
local tokens unchanged. The mechanisms that mix tokens communicate through :class:`ContextParallel`, every
primitive differentiable (its backward returns each rank the gradient of its own tokens, summed over the ranks
that used them):

- :meth:`~ContextParallel.gather`: the whole row in global order ([B, T, ...] from [B, T / N, ...]), with
  :meth:`~ContextParallel.segments` the attention of each local chunk over it as variable-length segments
  (softmax, Parallax: the keys and values);
- :meth:`~ContextParallel.halo`: each local chunk preceded by the ``width`` tokens before it in the row, with
  :meth:`~ContextParallel.halo_segments` their documents (the short convolutions: the K − 1 inputs of history);
- :meth:`~ContextParallel.states_entering`: every chunk's affine state transition all-gathered and composed in
  chunk order into the state entering each local chunk, with :meth:`~ContextParallel.chunk_segments` the local
  chunks' document pieces and which chunk continues the previous one's document (the delta-rule family).

The segment layouts depend only on the batch's documents, and each needs its segment count and (for
:meth:`~ContextParallel.segments`) its longest lengths on the host. :class:`BatchSegments` keeps them for every layer
of a forward; the trainer builds them on the host from the batch's positions before the batch's copy
(:meth:`BatchSegments.on_host`, :meth:`BatchSegments.to`), so no layer reads a device tensor back.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

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
        as the document positions, no keyword arguments), each [B, T] tensor cut to this rank's [B, T / N] (the
        others, such as the batch's :class:`BatchSegments`, pass as they are)."""
        inputs = {k: self.shard(v) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
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
        # python ints enter the fill kernel as arguments: no host-to-device copy
        end_k, end_q = (torch.full((1,), n, dtype=starts.dtype, device=starts.device) for n in (B * hi, B * c))
        cu_k = torch.cat([starts, end_k]).to(torch.int32)
        cu_q = torch.cat([row * c + (key - lo).clamp(min=0), end_q]).to(torch.int32)
        lens = torch.stack([cu_q.diff(), cu_k.diff()]).amax(1).tolist()  # one host sync per forward
        return Segments(cu_q, cu_k, lens[0], lens[1], hi)

    def halo(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """x [B, 2c, ...], this rank's two chunks -> [B, 2, width + c, ...]: each chunk preceded by the ``width``
        tokens before it in the row (zeros before the row's start). Up to a chunk of history comes from every
        rank's chunk tails (all-gathered, [B, 2N, width, ...]); more (a window wider than a chunk) from the whole
        row (:meth:`gather`). Which of them belong to the chunk's documents: :meth:`halo_segments`."""
        B, L = x.shape[:2]
        c = L // 2
        if c < width:
            row = torch.cat([x.new_zeros(B, width, *x.shape[2:]), self.gather(x, dim=1)], 1)  # [B, width + T, ...]
            return torch.stack([row[:, i * c:i * c + width + c] for i in self.chunks()], 1)
        chunks = x.view(B, 2, c, *x.shape[2:])
        tails = self.gather(chunks[:, :, c - width:], dim=1)  # [B, 2N, width, ...]: the last tokens of every chunk
        before = torch.cat([tails.new_zeros(B, 1, *tails.shape[2:]), tails[:, :-1]], 1)  # the tokens before each
        a, b = self.chunks()
        return torch.cat([torch.stack([before[:, a], before[:, b]], 1), chunks], 2)  # slices: no index copied

    def halo_segments(self, docs: torch.Tensor, width: int) -> torch.Tensor:
        """cu_seqlens [S + 1] int32 over the B·2·(width + c) tokens of :meth:`halo` (flattened): a segment per
        document piece, so a chunk's first tokens see only the history of their own document (the tokens before the
        row's start are a segment of their own). ``docs``: [B, T] document index of every token of the row."""
        c = docs.shape[1] // (2 * self.size)
        offsets = torch.arange(width + c, device=docs.device)
        pos = torch.stack([i * c - width + offsets for i in self.chunks()])  # [2, width + c]
        ext = docs[:, pos.clamp(min=0)].masked_fill(pos < 0, -1)  # [B, 2, width + c]; -1 before the row
        starts = torch.ones_like(ext, dtype=torch.bool)
        starts[..., 1:] = ext[..., 1:] != ext[..., :-1]
        return _segments(starts.reshape(-1, width + c))[0]

    def chunk_segments(self, positions: torch.Tensor, docs: torch.Tensor) -> "ChunkSegments":
        """This rank's two chunks as variable-length segments, one per document piece, cut at the chunk boundary
        too. ``positions``: [B, 2c] the local tokens' positions in their documents; ``docs``: [B, T] document index
        of every token of the row."""
        c = positions.shape[1] // 2
        starts = positions == 0
        starts[:, 0] = starts[:, c] = True  # each chunk is its own stretch of the row
        cu, seg = _segments(starts)
        begins = torch.arange(1, 2 * self.size, device=docs.device) * c  # first token of chunks 1..2N-1
        continues = docs[:, begins] == docs[:, begins - 1]
        first, last = (torch.stack([seg[:, i], seg[:, j]], 1).reshape(-1) for i, j in ((0, c), (c - 1, 2 * c - 1)))
        return ChunkSegments(cu, first, last, continues)

    def row_segments(self, docs: torch.Tensor) -> torch.Tensor:
        """cu_seqlens [S + 1] int32 over the B·T tokens of the whole rows (:meth:`gather` of every token, flattened):
        one segment per document piece of each row, a row's start being a document start. ``docs``: [B, T]
        document index of every token of the row."""
        starts = torch.ones_like(docs, dtype=torch.bool)
        starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
        return _segments(starts)[0]

    def states_entering(self, transitions: torch.Tensor, continues: torch.Tensor) -> torch.Tensor:
        """The state entering each of this rank's chunks of a recurrence whose chunks act on a [K, V] state as an
        affine map h ↦ M h + B. ``transitions``: [B, 2, ..., K, V + K], this rank's two chunks' maps packed as
        [B | M] along the last dim (... any leading state dims, e.g. heads); ``continues``: [B, 2N − 1] bool,
        whether chunk i = 1..2N−1 continues the document of chunk i − 1 (:meth:`chunk_segments`).

        Every chunk's map is all-gathered ([B, 2N, ..., K, V + K]) and composed in chunk order,
        S_i = M_{i−1} S_{i−1} + B_{i−1} from S_0 = 0, reset to 0 where chunk i starts a document: no rank waits
        for another's recurrence. Returns [B, 2, ..., K, V] in the transitions' dtype."""
        V = transitions.shape[-1] - transitions.shape[-2]
        maps = self.gather(transitions, dim=1)
        keep = continues.to(maps.dtype).view(*continues.shape, *[1] * (maps.dim() - 2))
        states = [maps.new_zeros(*maps.shape[:1], *maps.shape[2:-1], V)]
        for i in range(1, max(self.chunks()) + 1):
            b_prev, m_prev = maps[:, i - 1, ..., :V], maps[:, i - 1, ..., V:]
            states.append(keep[:, i - 1] * (m_prev @ states[-1] + b_prev))
        return torch.stack([states[i] for i in self.chunks()], 1)


class BatchSegments:
    """The segment layouts of one batch under context parallelism, each built on first use and kept: one object serves
    every layer of a forward (a plain object, so FSDP's per-block copy of the context's dataclass fields hands every
    block this one). ``docs``: [B, T] int64 document index of every token of the whole row (:func:`documents`);
    ``positions``: [B, 2c] the local tokens' positions in their documents.

    Built from device tensors, each layout reads its segment count back (``nonzero``) and :meth:`segments` its
    longest lengths (``tolist``): host syncs, once per forward. The trainer instead builds every layout on the host
    from the batch's positions (:meth:`on_host`, :meth:`build`) and copies them over (:meth:`to`): the offsets travel
    as int32 tensors, only the longest lengths the kernels take as Python ints."""

    def __init__(self, cp: ContextParallel, docs: torch.Tensor, positions: torch.Tensor):
        self.cp, self.docs, self.positions = cp, docs, positions
        self._built: dict = {}

    @staticmethod
    def on_host(cp: ContextParallel, positions: torch.Tensor | None, shape: tuple[int, int]) -> "BatchSegments":
        """The layouts of a batch of ``shape`` [B, T] (whole rows) from its per-document ``positions`` [B, T] on the
        host (None: one causal sequence per row), for this rank; nothing built yet."""
        B, T = shape
        if positions is None:
            local = cp.global_index(T // cp.size, "cpu").expand(B, T // cp.size)
            return BatchSegments(cp, torch.zeros(B, T, dtype=torch.int64), local)
        return BatchSegments(cp, documents(positions), cp.shard(positions))

    def segments(self, half: int) -> "Segments":
        """:meth:`ContextParallel.segments` of chunk ``half``."""
        return self._get(("segments", half), lambda: self.cp.segments(self.docs, half))

    def halo_segments(self, width: int) -> torch.Tensor:
        """:meth:`ContextParallel.halo_segments` of ``width`` tokens of history."""
        return self._get(("halo", width), lambda: self.cp.halo_segments(self.docs, width))

    def chunk_segments(self) -> "ChunkSegments":
        """:meth:`ContextParallel.chunk_segments`."""
        return self._get("chunks", lambda: self.cp.chunk_segments(self.positions, self.docs))

    def row_segments(self) -> torch.Tensor:
        """:meth:`ContextParallel.row_segments`."""
        return self._get("rows", lambda: self.cp.row_segments(self.docs))

    def build(self, halo_widths=()) -> "BatchSegments":
        """Every layout: both chunks' :meth:`segments`, :meth:`chunk_segments`, :meth:`row_segments` and the
        :meth:`halo_segments` of each of ``halo_widths``. Returns self."""
        for half in (0, 1):
            self.segments(half)
        self.chunk_segments()
        self.row_segments()
        for width in halo_widths:
            self.halo_segments(width)
        return self

    def to(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "BatchSegments":
        """A copy of the built layouts with every tensor replaced by ``move(tensor)`` (the host's copied to the
        device; the Python ints stay). It holds nothing to build from: a layout :meth:`build` did not make fails
        with its name instead of being rebuilt on the device with host syncs."""
        def moved(v):
            if isinstance(v, torch.Tensor):
                return move(v)
            return replace(v, **{f.name: move(getattr(v, f.name)) for f in fields(v)
                                 if isinstance(getattr(v, f.name), torch.Tensor)})

        out = BatchSegments(self.cp, None, None)
        out._built = {k: moved(v) for k, v in self._built.items()}
        return out

    def _get(self, key, build):
        if key not in self._built:
            if self.docs is None:
                raise RuntimeError(f"context parallelism: the segment layout {key!r} was not built on the host "
                                   "(BatchSegments.build; a module's cp_halo_width?)")
            self._built[key] = build()
        return self._built[key]


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


@dataclass
class ChunkSegments:
    """This rank's two chunks as variable-length segments (:meth:`ContextParallel.chunk_segments`)."""

    cu_seqlens: torch.Tensor
    """[S + 1] int32: segment offsets over the B·2c local tokens (one per document piece of each chunk)."""
    first: torch.Tensor
    """[B·2] int64: the segment each chunk starts with (row-major over rows, then the two chunks)."""
    last: torch.Tensor
    """[B·2] int64: the segment each chunk ends with."""
    continues: torch.Tensor
    """[B, 2N − 1] bool: chunk i = 1..2N−1 continues the document of chunk i − 1."""


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
    cu = torch.cat([first, torch.full((1,), flat.numel(), dtype=first.dtype, device=first.device)]).to(torch.int32)
    return cu, (flat.cumsum(0) - 1).view_as(starts)
