"""Muon (Jordan et al., 2024) for 2-D hidden weight matrices, FSDP2-aware, with per-block orthogonalisation.

    B ← μB + (1−μ)G;   U = G + μ(B − G) (Nesterov) or B;   O = NS_k(U);
    W ← W·(1 − lr·λ) − lr·s(shape)·O

NS_k is the Newton–Schulz iteration X ← aX + b(XXᵀ)X + c(XXᵀ)²X on X = U/‖U‖_F, run on the wide
orientation (rows ≤ cols) in bf16 by default. Coefficients: the quintic (3.4445, −4.7750, 2.0315) or the
Polar Express per-step schedule (Amsel et al., 2025, arXiv 2505.16932; modded-nanogpt's 5-step table with its
2 % safety factor). The per-matrix scale s(rows, cols) of a PyTorch weight [out, in] (rows = fan_out,
cols = fan_in) is one of (:data:`UPDATE_SCALES`):

- "sqrt_max1_rows_over_cols": √max(1, rows/cols) (Jordan et al.; ``torch.optim.Muon``'s ``adjust_lr_fn=
  "original"``); "spectral", its former name, stays an alias: checkpoints restore it with
  the param groups on resume, and older configs set it;
- "sqrt_fan_out_over_fan_in": √(rows/cols) (Dion, Ahn et al. 2025, arXiv 2504.05295, "spectral_norm"): the same
  on tall and square matrices, √(rows/cols) < 1 on wide ones (w2; wo when n_heads·d_h > dim; wk/wv when n_kv_heads·d_h < dim);
- "match_rms_adamw": 0.2·√max(rows, cols) (Moonlight, arXiv 2502.16982).

The Parallax paper asks for "spectral scaling" (Appendix F.2) and cites both Muon and Dion without giving a
formula, so its text does not settle which of the first two it means. For a single plain matrix the step is
bit-for-bit ``torch.optim.Muon`` (same EMA momentum form, same op order).

Departures from ``torch.optim.Muon``:
- DTensor (FSDP2) parameters: momentum is kept on the local shard; for orthogonalisation each full matrix
  is gathered on one owner rank of its shard group (owners round-robin over matrices sorted by size),
  orthogonalised there and scattered back, so the result equals single-process Muon. Placements other than
  one ``Shard(0)`` mesh dim plus ``Replicate`` dims fall back to ``full_tensor()`` on every rank.
- ``blocks``: a parameter may be split along one dim into blocks (fused q|k|v projections, or one block per
  attention head) that are orthogonalised and scaled as separate matrices.

``optimizer.name = "muon"`` (:func:`muon_and_adamw`) steps the "matrix" role with Muon and every other role with
AdamW at the paper's lr multipliers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from attnlab.optim.adam import AdamW, adam_stepper
from attnlab.optim.dtensor import local_shard
from attnlab.optim.registry import RoleSettings, Stepper, register_optimizer

QUINTIC = (3.4445, -4.7750, 2.0315)
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
UPDATE_SCALES = ("sqrt_max1_rows_over_cols", "sqrt_fan_out_over_fan_in", "match_rms_adamw")
UPDATE_SCALE_ALIASES = {"spectral": "sqrt_max1_rows_over_cols"}
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_ns_coefficients(spec, ns_steps: int) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """Per-step (a, b, c) for ``ns_steps`` steps and the norm safety factor.

    spec: "quintic" | "polar_express" | "a,b,c[;a,b,c...]" | a sequence of triples (the last one repeats).
    """
    safety = 1.0
    if isinstance(spec, str) and spec == "quintic":
        triples = [QUINTIC]
    elif isinstance(spec, str) and spec == "polar_express":
        if ns_steps > len(POLAR_EXPRESS):
            raise ValueError(f"optimizer.muon_ns_steps={ns_steps}: polar_express has {len(POLAR_EXPRESS)} steps")
        triples, safety = list(POLAR_EXPRESS), 1.02
    else:
        try:
            if isinstance(spec, str):
                triples = [tuple(float(x) for x in t.split(",")) for t in spec.split(";") if t.strip()]
            else:
                triples = [tuple(float(x) for x in t) for t in spec]
            if not triples or any(len(t) != 3 for t in triples):
                raise ValueError
        except (ValueError, TypeError):
            raise ValueError(
                f"optimizer.muon_ns_coefficients={spec!r}; choose 'quintic', 'polar_express' or triples 'a,b,c;a,b,c'"
            ) from None
    if ns_steps < 1:
        raise ValueError(f"optimizer.muon_ns_steps={ns_steps} must be >= 1")
    steps = tuple(tuple(triples[min(i, len(triples) - 1)]) for i in range(ns_steps))
    return steps, safety


def newton_schulz(
    G: Tensor,
    coefficients: tuple[tuple[float, float, float], ...],
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    safety: float = 1.0,
) -> Tensor:
    """Approximate polar factor UVᵀ of G = USVᵀ.

    G: [m, n] or [N, m, n] (a batch of independent matrices). Returns the same shape in ``dtype``; singular
    values land roughly in [0.7, 1.2] for the quintic (it trades accuracy for slope at 0).
    """
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    if X.ndim == 2:  # same ops as torch.optim.Muon so a single matrix matches it bit for bit
        norm = X.norm()
        X = X / (norm * safety if safety != 1.0 else norm).clamp(min=eps)
        for a, b, c in coefficients:
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    else:
        norm = X.norm(dim=(-2, -1), keepdim=True)
        X = X / (norm * safety).clamp(min=eps)
        for a, b, c in coefficients:
            A = X @ X.mT
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
    return X.mT if tall else X


def check_update_scale(kind: str) -> str:
    """The canonical name of ``kind`` (aliases resolved); ValueError naming the key if unknown."""
    kind = UPDATE_SCALE_ALIASES.get(kind, kind)
    if kind not in UPDATE_SCALES:
        raise ValueError(f"optimizer.muon_update_scale={kind!r}; choose from "
                         f"{list(UPDATE_SCALES) + list(UPDATE_SCALE_ALIASES)}")
    return kind


def update_scale(rows: int, cols: int, kind: str) -> float:
    """Per-matrix lr factor s(rows, cols) of a [rows, cols] = [fan_out, fan_in] matrix or head block."""
    kind = check_update_scale(kind)
    if kind == "sqrt_max1_rows_over_cols":
        return math.sqrt(max(1, rows / cols))
    if kind == "sqrt_fan_out_over_fan_in":
        return math.sqrt(rows / cols)
    return 0.2 * math.sqrt(max(rows, cols))


@dataclass(frozen=True)
class Blocks:
    """Split of a parameter along ``dim`` into blocks of ``sizes`` (summing to the parameter's size)."""

    dim: int
    sizes: tuple[int, ...]


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters (plain tensors or FSDP2 DTensors).

    Args:
        params: parameters or param groups (groups may carry their own lr / weight_decay / name).
        lr, weight_decay, momentum, nesterov, ns_steps, eps: as ``torch.optim.Muon``.
        ns_coefficients: "quintic" | "polar_express" | "a,b,c;..." | sequence of triples.
        ns_dtype: "bfloat16" | "float32".
        update_scale: one of :data:`UPDATE_SCALES` (or an alias); blocks are scaled by their own shape.
        blocks: optional ``{param: Blocks}`` for per-block orthogonalisation.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients="quintic",
        ns_steps: int = 5,
        ns_dtype: str = "bfloat16",
        eps: float = 1e-7,
        update_scale: str = "sqrt_max1_rows_over_cols",
        blocks: dict[Tensor, Blocks] | None = None,
    ) -> None:
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"optimizer.muon_ns_dtype={ns_dtype!r}; choose from {list(NS_DTYPES)}")
        update_scale = check_update_scale(update_scale)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"optimizer.muon_momentum={momentum} must be in [0, 1)")
        coeffs, _ = resolve_ns_coefficients(ns_coefficients, ns_steps)
        if not isinstance(ns_coefficients, str):
            ns_coefficients = ";".join(",".join(repr(x) for x in t) for t in coeffs)
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, ns_steps=ns_steps, ns_dtype=ns_dtype, eps=eps,
            update_scale=update_scale,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got shape {tuple(p.shape)}")
        self.blocks = dict(blocks or {})

    # -- orthogonalisation, batched over matrices of one shape -------------------------------------
    def _orthogonalize_many(self, items: list[tuple[Tensor, Tensor, dict]]) -> list[tuple[Tensor, float]]:
        """items: (U full [rows, cols], param, group) -> (O, s) each; O is pre-scaled per block when blocked.

        Every matrix (or block of a blocked parameter) with the same wide-orientation shape and Newton–Schulz
        settings goes through one batched NS call: a tall matrix is transposed into the batch of its wide shape
        (NS runs on the wide orientation anyway), so the 0.6B block's wq (2048×1024) batches with wo (1024×2048)
        and w1/w3 (3072×1024) with w2 (1024×3072): 3 batched NS calls per step instead of 5 (or one per matrix).
        """
        units: dict[tuple, list[tuple[int, int, Tensor, bool]]] = {}  # NS key -> (item, part, wide matrix, tall)
        parts_of: list[list[Tensor | None]] = []
        for i, (U, p, group) in enumerate(items):
            spec = self.blocks.get(p)
            parts = [U] if spec is None else list(torch.split(U, list(spec.sizes), dim=spec.dim))
            parts_of.append([None] * len(parts))
            settings = (group["ns_coefficients"], group["ns_steps"], group["ns_dtype"], group["eps"])
            for j, part in enumerate(parts):
                tall = part.shape[0] > part.shape[1]
                wide = part.mT if tall else part
                units.setdefault((tuple(wide.shape), settings), []).append((i, j, wide, tall))
        for (_, (spec, steps, dtype, eps)), members in units.items():
            coeffs, safety = resolve_ns_coefficients(spec, steps)
            if len(members) == 1:  # the 2-D path: bit-for-bit torch.optim.Muon
                outs = [newton_schulz(members[0][2], coeffs, NS_DTYPES[dtype], eps, safety)]
            else:
                outs = newton_schulz(torch.stack([m[2] for m in members]), coeffs, NS_DTYPES[dtype], eps, safety)
            for (i, j, _, tall), o in zip(members, outs):
                parts_of[i][j] = o.mT if tall else o
        results = []
        for (U, p, group), parts in zip(items, parts_of):
            spec, kind = self.blocks.get(p), group["update_scale"]
            if spec is None:
                results.append((parts[0], update_scale(U.shape[0], U.shape[1], kind)))
            else:
                scaled = [o * update_scale(o.shape[0], o.shape[1], kind) for o in parts]
                results.append((torch.cat(scaled, dim=spec.dim), 1.0))
        return results

    # -- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        jobs = []  # (param, group, local update)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grads = [local_shard(p.grad) for p in params]
            bufs = [local_shard(self.state[p]["momentum_buffer"]) for p in params]
            mu = group["momentum"]
            torch._foreach_lerp_(bufs, grads, 1 - mu)
            updates = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
            jobs.extend((p, group, u) for p, u in zip(params, updates))
        # W <- W(1 - lr·wd) - lr·s·O, as foreach calls per (group, s): one launch per list, not two per matrix
        lists: dict[tuple[int, float], tuple[dict, list, list]] = {}
        for (p, group, _), (o, s) in zip(jobs, self._orthogonalize_all(jobs)):
            _, ws, os_ = lists.setdefault((id(group), s), (group, [], []))
            ws.append(local_shard(p))
            os_.append(o)
        for (_, s), (group, ws, os_) in lists.items():
            lr = group["lr"]
            torch._foreach_mul_(ws, 1 - lr * group["weight_decay"])
            torch._foreach_add_(ws, os_, alpha=-(lr * s))
        return loss

    def _orthogonalize_all(self, jobs) -> list[tuple[Tensor, float]]:
        results: list = [None] * len(jobs)
        local, general = [], []  # job indices: plain tensors / DTensors with other placements
        sharded: dict = {}  # (mesh, shard mesh dim) -> job indices
        for i, (p, group, u) in enumerate(jobs):
            if not isinstance(p, DTensor):
                local.append(i)
                continue
            dims = [d for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
            if len(dims) == 1 and p.placements[dims[0]] == Shard(0):
                sharded.setdefault((p.device_mesh, dims[0]), []).append(i)
            else:
                general.append(i)
        for i, r in zip(local, self._orthogonalize_many([(jobs[i][2], jobs[i][0], jobs[i][1]) for i in local])):
            results[i] = r
        if general:  # general placements: every rank assembles and orthogonalises the full matrices
            fulls = []
            for i in general:
                p, group, u = jobs[i]
                full = DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                fulls.append((full.full_tensor(), p, group))
            for i, (o, s) in zip(general, self._orthogonalize_many(fulls)):
                p = jobs[i][0]
                results[i] = (local_shard(distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None)), s)
        for (mesh, mdim), idx in sharded.items():
            for i, r in zip(idx, self._owner_orthogonalize([jobs[i] for i in idx], mesh.get_group(mdim))):
                results[i] = r
        return results

    def _owner_orthogonalize(self, jobs, pg) -> list[tuple[Tensor, float]]:
        """Row-sharded (Shard(0)) matrices: each is assembled on one owner rank, orthogonalised there (batched
        with the owner's other matrices of its shape) and its rows sent back.

        Owners go round-robin within each shape (largest shapes first), so every rank gets an equal share of
        every shape and the batched NS calls stay balanced. The exchange is pipelined per (NS dtype, shape)
        bucket: the rows of bucket k+1 travel to their owners (async all-to-all) while bucket k is
        orthogonalised, and bucket k's rows travel back while bucket k+1 is — on NCCL the all-to-alls run on
        the communication stream, overlapped with the Newton–Schulz GEMMs.
        """
        ws = dist.get_world_size(pg)
        by_shape: dict[tuple, list[int]] = {}
        for i, (p, _, _) in enumerate(jobs):
            by_shape.setdefault(tuple(p.shape), []).append(i)
        owner, k = {}, 0
        buckets: dict[tuple, list[int]] = {}  # (NS dtype, shape) -> job indices, the same order on every rank
        for shape in sorted(by_shape, key=lambda s: (-s[0] * s[1], s)):
            for i in by_shape[shape]:
                owner[i], k = k % ws, k + 1
                buckets.setdefault((NS_DTYPES[jobs[i][1]["ns_dtype"]], shape), []).append(i)
        exchanges = [_Exchange([jobs[i] for i in idx], [owner[i] for i in idx], dtype, pg)
                     for (dtype, _), idx in buckets.items()]
        if exchanges:
            exchanges[0].start_gather()
        for n, ex in enumerate(exchanges):
            if n + 1 < len(exchanges):
                exchanges[n + 1].start_gather()  # in flight while this bucket is orthogonalised
            ex.start_scatter(self._orthogonalize_many(ex.assembled()))
        results: list = [None] * len(jobs)
        for idx, ex in zip(buckets.values(), exchanges):
            for i, (o, (p, group, _)) in zip(idx, zip(ex.returned(), ex.jobs)):
                results[i] = (o, self._scale_of(p, group))
        return results

    def _scale_of(self, p: Tensor, group: dict) -> float:
        return 1.0 if p in self.blocks else update_scale(p.shape[0], p.shape[1], group["update_scale"])


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _chunk_rows(t: Tensor, chunk: int, ws: int) -> list[Tensor]:
    return [t[min(r * chunk, t.shape[0]) : min((r + 1) * chunk, t.shape[0])] for r in range(ws)]


class _Exchange:
    """The two all-to-alls of one bucket of row-sharded matrices (async; NS dtype ``dtype``).

    ``start_gather``: every rank sends each matrix's (padded) local rows to the matrix's owner;
    ``assembled``: waits, returns the owner's full matrices as ``(U, param, group)``; ``start_scatter``: the
    owner sends each orthogonalised matrix's rows back; ``returned``: waits, returns this rank's rows of every
    matrix of the bucket (in ``jobs`` order). FSDP2/DTensor Shard(0) splits rows like ``torch.chunk``.
    """

    def __init__(self, jobs, owners, dtype, pg):
        self.jobs, self.dtype, self.pg = jobs, dtype, pg
        self.ws, self.me = dist.get_world_size(pg), dist.get_rank(pg)
        self.chunks = [-(-p.shape[0] // self.ws) for p, _, _ in jobs]
        self.owned = [[i for i in range(len(jobs)) if owners[i] == r] for r in range(self.ws)]
        self.sizes = [sum(self.chunks[i] * jobs[i][0].shape[1] for i in self.owned[r]) for r in range(self.ws)]
        self.device = jobs[0][2].device

    def _cat(self, pieces: list[Tensor]) -> Tensor:
        return torch.cat(pieces or [torch.empty(0, dtype=self.dtype, device=self.device)])

    def start_gather(self) -> None:
        ws, me, sizes = self.ws, self.me, self.sizes
        # one cast per bucket (not per matrix): the exchange is launch-bound at 0.6B's ~200 matrices
        send = self._cat([_pad_rows(self.jobs[i][2], self.chunks[i]).flatten()
                          for r in range(ws) for i in self.owned[r]]).to(self.dtype)
        self._recv = torch.empty(ws * sizes[me], dtype=self.dtype, device=self.device)
        self._send = send  # alive until the collective finished
        self._work = dist.all_to_all_single(self._recv, send, [sizes[me]] * ws, sizes, group=self.pg, async_op=True)

    def assembled(self) -> list[tuple[Tensor, Tensor, dict]]:
        self._work.wait()
        ws, me, n_me = self.ws, self.me, self.sizes[self.me]
        recv = self._recv.view(ws, n_me)
        fulls, off = [], 0
        for i in self.owned[me]:
            p, group, _ = self.jobs[i]
            n = self.chunks[i] * p.shape[1]
            fulls.append((recv[:, off : off + n].reshape(ws * self.chunks[i], p.shape[1])[: p.shape[0]], p, group))
            off += n
        return fulls

    def start_scatter(self, outs: list[tuple[Tensor, float]]) -> None:
        ws, me, sizes = self.ws, self.me, self.sizes
        back = [[_pad_rows(c, self.chunks[i]).flatten() for c in _chunk_rows(o.to(self.dtype), self.chunks[i], ws)]
                for i, (o, _) in zip(self.owned[me], outs)]
        send = self._cat([b[r] for r in range(ws) for b in back])
        self._recv = torch.empty(sum(sizes), dtype=self.dtype, device=self.device)
        self._send = send
        self._work = dist.all_to_all_single(self._recv, send, sizes, [sizes[me]] * ws, group=self.pg, async_op=True)

    def returned(self) -> list[Tensor]:
        self._work.wait()
        self._send = None
        out: list = [None] * len(self.jobs)
        off = 0
        for r in range(self.ws):
            for i in self.owned[r]:
                p, _, u = self.jobs[i]
                n = self.chunks[i] * p.shape[1]
                out[i] = self._recv[off : off + n].view(self.chunks[i], p.shape[1])[: u.shape[0]]
                off += n
        return out


@register_optimizer("muon")
def muon_and_adamw(cfg) -> list[Stepper]:
    """Muon at optimizer.lr / weight_decay for "matrix"; AdamW (adam_beta1/adam_beta2/adam_eps) for the other roles
    at lr × adam_<role>_lr_mult (Table 2b), weight decay on embeddings and an untied head with embed_weight_decay."""
    lr, wd = cfg.lr, cfg.weight_decay
    embed_wd = wd if cfg.embed_weight_decay else 0.0

    def make(param_groups: list[dict], routes) -> Muon:
        return Muon(
            param_groups, lr=lr, weight_decay=wd, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
            ns_coefficients=cfg.muon_ns_coefficients, ns_steps=cfg.muon_ns_steps, ns_dtype=cfg.muon_ns_dtype,
            eps=cfg.muon_eps, update_scale=cfg.muon_update_scale,
            blocks={r.param: r.blocks for r in routes if r.blocks is not None},
        )

    fallback = {
        "embed": RoleSettings(lr * cfg.adam_embed_lr_mult, embed_wd),
        "head": RoleSettings(lr * cfg.adam_head_lr_mult, embed_wd),
        "norm": RoleSettings(lr * cfg.adam_norm_lr_mult, 0.0),
        "vector": RoleSettings(lr * cfg.adam_vector_lr_mult, 0.0),
    }
    return [Stepper({"matrix": RoleSettings(lr, wd)}, make),
            adam_stepper(AdamW, cfg, fallback, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_eps)]
