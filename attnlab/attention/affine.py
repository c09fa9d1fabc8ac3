"""The affine (uniform-weight) attention family of the Parallax paper (Zuo et al., 2026, §3.2, Fig. 1):
the h → ∞ limits of softmax, Parallax and LLA, and MesaNet without decay (docs/mechanisms.md).

    value_avg      o_i = v̄_i                                  probe zero        (eq. 11)
    affine_linear  o_i = v̄_i − S̃_i ρ_i, ρ_i = W_R x_i         probe learned     (eq. 12)
    mesa           o_i = S_i H_i⁻¹ q_i                        probe solved, no intercept (eq. 5)
    affine_mesa    o_i = v̄_i − S̃_i H̃_i⁻¹(k̄_i − q_i)           probe solved      (eq. 13)

Means run over the query's document (states reset at document starts). Same Qwen3 projections as softmax
(q/k RMSNorm, RoPE, GQA); for affine_linear the q projection is the probe ρ (RMSNorm'd like Parallax's).
mesa/affine_mesa solve by CG with a learnable ridge λ (per head or per token, like ``lla``) and an exact
implicit gradient. Kernels: chunked PyTorch ("auto"/"chunk") or the explicit reference ("reference").
Decoding keeps running sums (``attnlab/attention/ops/affine/recurrent.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.base import AttentionArgs, AttentionContext, mix_whole_rows
from attnlab.attention.base import QKVAttentionBase
from attnlab.attention.lla import RidgeLambda
from attnlab.attention.ops.affine import IMPLS as AFFINE_IMPLS
from attnlab.attention.ops.affine import AffineState, affine_attention, affine_step
from attnlab.attention.ops.common import check_impl
from attnlab.attention.registry import register_attention


@dataclass
class ValueAvgOptions:
    chunk_size: int = field(default=64, metadata={"valid": ">= 1"})
    """Unused by value averaging (kept so every affine mechanism has the same table shape)."""


@dataclass
class AffineLinearOptions:
    qk_norm: bool = True
    """RMSNorm per head on ρ and k."""
    rope: bool = True
    """RoPE on ρ and k (ρ·k then depends on relative position)."""
    rho_scale: bool = True
    """Multiply ρ by head_dim**-0.5 so ρ·k is O(1) at initialisation (False: the paper's unscaled probe)."""
    chunk_size: int = field(default=64, metadata={"valid": ">= 1"})
    """Chunk width of the chunked linear-attention path."""


@dataclass
class MesaOptions:
    qk_norm: bool = True
    """RMSNorm per head on q and k."""
    rope: bool = True
    """RoPE on q and k."""
    cg_iters: int = field(default=16, metadata={"valid": ">= 1"})
    """CG iterations for the probe solve (and the adjoint solve in the backward)."""
    jacobi: bool = False
    """Jacobi-preconditioned CG."""
    lambda_mode: str = field(default="head", metadata={"valid": "one of head, token"})
    """Ridge λ per head ("head") or per token and head from x ("token")."""
    lambda_init: float = field(default=1.0, metadata={"valid": "> 0"})
    """Initial λ (added to the mean k kᵀ, whose eigenvalues are ~1 for RMSNorm'd keys)."""
    lambda_min: float = field(default=0.01, metadata={"valid": ">= 0"})
    """Floor of λ."""
    lambda_max: float = field(default=4.0, metadata={"valid": "> 0"})
    """Ceiling of λ: λ = λ_min + (λ_max − λ_min)·sigmoid(·)."""
    learn_lambda: bool = True
    """Learn λ; False keeps λ = lambda_init."""
    cg_rtol: float = field(default=1e-6, metadata={"valid": "> 0"})
    """A row's CG stops once ‖residual‖ ≤ cg_rtol·‖rhs‖."""
    chunk_size: int = field(default=64, metadata={"valid": ">= 1"})
    """Chunk width of the chunked linear-attention path."""


@dataclass
class AffineCache:
    """Decode state (running sums, see ``AffineState``)."""

    state: AffineState


class _AffineBase(QKVAttentionBase):
    """Shared forward/decode of affine_linear, mesa and affine_mesa."""

    impls = AFFINE_IMPLS
    """``[attention] impl`` values this mechanism accepts (``--list-attention`` prints them)."""
    context_parallel = True
    """Runs under context parallelism: q, k, v (and a per-token λ) all-gathered, the whole rows mixed
    (:func:`attention.base.mix_whole_rows`)."""

    name = ""

    def __init__(self, args: AttentionArgs, opts):
        super().__init__(args, opts.qk_norm, opts.rope)
        check_impl(args.impl, self.impls, self.name)
        self.opts = opts
        self.ridge = None

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        if self.ridge is not None:
            self.ridge.init_weights()

    def _probe_input(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def _kw(self) -> dict:
        return {}

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, ctx)
        q = self._probe_input(q)
        lam = self.ridge(x) if self.ridge is not None else None
        if ctx.cache is not None:
            o = self._decode(q, k, v, lam, ctx.cache)
        elif ctx.cp is not None:
            per_token = lam if lam is not None and lam.dim() == 3 else None
            o = mix_whole_rows(ctx, lambda q, k, v, lt, cu_seqlens: affine_attention(
                self.name, q, k, v, lam if lt is None else lt, cu_seqlens=cu_seqlens, chunk=self.opts.chunk_size,
                impl=self.args.impl, **self._kw()), q, k, v, per_token)
        else:
            o = affine_attention(self.name, q, k, v, lam, cu_seqlens=ctx.cu_seqlens, chunk=self.opts.chunk_size,
                                 impl=self.args.impl, **self._kw())
        return self.wo(o.reshape(B, T, -1))

    def _decode(self, q, k, v, lam, cache: AffineCache) -> torch.Tensor:
        B, T = q.shape[:2]
        if cache.state.n == 0 and T > 1:  # prefill: the chunked path, then the sums
            o = affine_attention(self.name, q, k, v, lam, chunk=self.opts.chunk_size, **self._kw())
            cache.state.extend(k, v)
            return o
        if lam is not None:
            lam = lam.expand(B, T, self.n_heads) if lam.dim() == 3 else lam.view(1, 1, -1).expand(B, T, -1)
        outs = [affine_step(self.name, cache.state, q[:, t], k[:, t], v[:, t], None if lam is None else lam[:, t],
                            **self._kw()) for t in range(T)]
        return torch.stack(outs, 1)

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> AffineCache:
        return AffineCache(AffineState.zeros(batch_size, self.n_kv_heads, self.head_dim, device))

    def _linear_flops(self, calls: int, seq_len: int) -> int:
        # one chunked linear-attention pass per token and head: intra-chunk scores and outputs (2·C·D
        # multiply-adds) plus the D×D state read and update (2·D²), 2 FLOPs each.
        C, D = min(self.opts.chunk_size, seq_len), self.head_dim
        return calls * self.n_heads * 2 * (2 * C * D + 2 * D * D)


@register_attention("value_avg", options=ValueAvgOptions, description="value averaging: running mean of v (affine family, probe zero)")
class ValueAveraging(nn.Module):
    """o_i = mean of v over the document so far (softmax attention at h → ∞)."""

    impls = AFFINE_IMPLS
    """``[attention] impl`` values this mechanism accepts (``--list-attention`` prints them)."""
    context_parallel = True
    """Runs under context parallelism: v all-gathered, the whole rows averaged (:func:`attention.base.mix_whole_rows`)."""
    context_parallel_compiles = True
    """Its CP path compiles (``compile.enable``) into the blocks' single graphs (docs/context_parallel.md)."""

    name = "value_avg"

    def __init__(self, args: AttentionArgs, opts: ValueAvgOptions):
        super().__init__()
        check_impl(args.impl, self.impls, self.name)
        self.args, self.opts = args, opts
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.wv.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q = v.new_zeros(B, T, self.n_heads, self.head_dim)  # no query in this mechanism
        if ctx.cache is not None:
            st = ctx.cache.state
            n = st.n + 1 + torch.arange(T, device=x.device, dtype=torch.float32)  # tokens seen by each new row
            csum = st.sum_v[:, None] + torch.cumsum(v.float(), 1)  # [B, T, HKV, D]
            st.extend(torch.zeros_like(v), v)
            o = (csum / n[None, :, None, None]).repeat_interleave(self.n_heads // self.n_kv_heads, 2).to(v.dtype)
        elif ctx.cp is not None:
            o = mix_whole_rows(ctx, lambda v, cu_seqlens: affine_attention(
                self.name, v.new_zeros(*v.shape[:2], self.n_heads, self.head_dim), v, v, cu_seqlens=cu_seqlens,
                impl=self.args.impl), v)
        else:
            o = affine_attention(self.name, q, v, v, cu_seqlens=ctx.cu_seqlens, impl=self.args.impl)
        return self.wo(o.reshape(B, T, -1))

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> AffineCache:
        return AffineCache(AffineState.zeros(batch_size, self.n_kv_heads, self.head_dim, device))

    def flops_per_token(self, seq_len: int) -> int:
        return 2 * self.n_heads * self.head_dim  # a running sum and a division


@register_attention("affine_linear", options=AffineLinearOptions, description="affine linear attention v̄ − S̃ρ with a learned probe ρ (affine family)")
class AffineLinearAttention(_AffineBase):
    """o_i = v̄_i − S̃_i ρ_i with ρ_i = RMSNorm(W_q x_i) (Parallax at h → ∞)."""
    context_parallel_compiles = True
    """Its CP path compiles (``compile.enable``) into the blocks' single graphs (docs/context_parallel.md)."""

    name = "affine_linear"

    def _probe_input(self, q: torch.Tensor) -> torch.Tensor:
        return q * self.head_dim**-0.5 if self.opts.rho_scale else q

    def flops_per_token(self, seq_len: int) -> int:
        return self._linear_flops(1, seq_len)


class _MesaBase(_AffineBase):
    def __init__(self, args: AttentionArgs, opts: MesaOptions):
        super().__init__(args, opts)
        if opts.cg_iters < 1:
            raise ValueError(f"attention.{self.name}.cg_iters={opts.cg_iters} must be >= 1")
        self.ridge = RidgeLambda(args.dim, args.n_heads, opts.lambda_mode, opts.lambda_init, opts.lambda_min,
                                 opts.lambda_max, opts.learn_lambda, f"attention.{self.name}")

    def _kw(self) -> dict:
        return dict(cg_iters=self.opts.cg_iters, jacobi=self.opts.jacobi, rtol=self.opts.cg_rtol)

    def flops_per_token(self, seq_len: int) -> int:
        return self._linear_flops(self.opts.cg_iters + 1, seq_len)


@register_attention("mesa", options=MesaOptions, description="MesaNet (uniform weights): S H⁻¹ q with a CG ridge solve")
class MesaAttention(_MesaBase):
    """o_i = S_i H_i⁻¹ q_i, means over the document, ridge λ learnable (Parallax paper eq. 5)."""
    context_parallel_compiles = True
    """Its CP path compiles (``compile.enable``) into the blocks' single graphs (docs/context_parallel.md)."""

    name = "mesa"


@register_attention("affine_mesa", options=MesaOptions, description="affine MesaNet v̄ − S̃ H̃⁻¹(k̄ − q): LLA at h → ∞ (affine family)",
                    reference_only="no fast path; the 0.6B config trained at 81-103 tok/s on one H100 (softmax ~17k "
                                   "in the same smoke run): small-scale studies only")
class AffineMesaAttention(_MesaBase):
    """o_i = v̄_i − S̃_i H̃_i⁻¹ (k̄_i − q_i): a uniform-weight affine ridge fit evaluated at q_i."""

    name = "affine_mesa"
