"""Context-Aggregated Linear Attention (CALA; Morgan 2025; docs/mechanisms.md, "CALA").

Linear attention whose queries and keys are first enriched with their local causal context:

    C_Q, C_K = sliding-window softmax aggregation over the w preceding tokens (query i excluded; φ_loc = elu+1
               scores, original Q and K as values — App. A "Option A")
    Q'' = φ(LayerNorm(Q + C_Q)),  K'' = φ(LayerNorm(K + C_K))
    o_i = Σ_{j≤i} (Q''_i·K''_j) v_j / (Σ_{j≤i} Q''_i·K''_j + ε)

The paper is a proposal without experiments or hyperparameters; the window, feature map (elu+1, relu or
FAVOR+ positive random features, inputs scaled by D^-1/4 so that they do not underflow after LayerNorm) and
feature dimension are options. The local step reuses the project's sliding-window softmax path
(``attention.ops.parallax``), the global step the HLA primitive (Triton chunked linear attention).
Departures: LayerNorm is per head (shared over heads, one for q and one for k); GQA repeats k and v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


from attnlab.attention.base import AttentionArgs, AttentionContext, QKVAttentionBase, causal_pairs
from attnlab.attention.linear_common import linear_recurrence_cp
from attnlab.attention.ops.cala import divide_by_normaliser, local_context, normalized_linear_attention
from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.linear_attn import gated_linear_attention
from attnlab.attention.registry import register_attention

FEATURE_MAPS = ("elu", "relu", "favor")
CALA_IMPLS = ("auto", "reference", "chunk", "triton")


@dataclass
class CALAOptions:
    window_size: int = field(default=64, metadata={"valid": ">= 1"})
    """w: number of preceding tokens aggregated into each q and k (the token itself excluded)."""
    local_feature_map: str = field(default="elu", metadata={"valid": "one of elu, softplus"})
    """φ_loc of the local softmax scores: "elu" (elu+1, paper) or "softplus" (both strictly positive)."""
    feature_map: str = field(default="elu", metadata={"valid": "one of elu, relu, favor"})
    """φ_glob of the linear attention: "elu" (elu+1), "relu" or "favor" (FAVOR+ positive random features)."""
    feature_dim: int = field(default=0, metadata={"valid": ">= 0"})
    """FAVOR+ feature count d' (0 = head_dim); ignored by the other maps."""
    eps: float = field(default=1e-6, metadata={"valid": "> 0"})
    """ε of the normaliser (paper: 1e-6)."""


@dataclass
class CALACache:
    """Decode cache: raw q, k history [B, max_len, H, D] (for the local window), tokens seen, and the linear
    attention state [B, H, F, D+1] (numerator and denominator)."""

    q: torch.Tensor
    k: torch.Tensor
    n: int
    state: torch.Tensor | None = None


@register_attention("cala", options=CALAOptions, description="CALA: sliding-window context aggregation into q/k, LayerNorm, normalised linear attention")
class ContextAggregatedLinearAttention(QKVAttentionBase):
    """CALA: local softmax context aggregation into q and k, LayerNorm, feature map, normalised linear attention."""

    impls = CALA_IMPLS
    """``[attention] impl`` values this mechanism accepts (``--list-attention`` prints them)."""
    context_parallel = True
    """Runs under context parallelism (:meth:`_mix_cp`)."""
    context_parallel_compiles = True
    """Its CP path compiles (``compile.enable``) into the blocks' single graphs (docs/context_parallel.md)."""

    @property
    def cp_halo_width(self) -> int:
        """Tokens of history :meth:`_mix_cp` puts before each chunk (``BatchSegments.halo_segments``' width)."""
        return self.opts.window_size

    def __init__(self, args: AttentionArgs, opts: CALAOptions):
        if opts.feature_map not in FEATURE_MAPS:
            raise ValueError(f"attention.cala.feature_map={opts.feature_map!r}; choose from {list(FEATURE_MAPS)}")
        if opts.local_feature_map not in ("elu", "softplus"):
            raise ValueError(f"attention.cala.local_feature_map={opts.local_feature_map!r}; choose from ['elu', 'softplus']")
        if opts.window_size < 1:
            raise ValueError(f"attention.cala.window_size={opts.window_size} must be >= 1")
        check_impl(args.impl, self.impls, "cala")
        super().__init__(args, qk_norm=False, rope=False)  # CALA normalises q/k with LayerNorm after aggregation
        self.opts = opts
        D = args.head_dim
        self.q_ln = nn.LayerNorm(D, eps=args.norm_eps)
        self.k_ln = nn.LayerNorm(D, eps=args.norm_eps)
        self.feature_dim = (opts.feature_dim or D) if opts.feature_map == "favor" else D
        if opts.feature_map == "favor":
            self.register_buffer("omega", torch.empty(self.feature_dim, D))

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        self.q_ln.reset_parameters()
        self.k_ln.reset_parameters()
        if self.opts.feature_map == "favor":
            self.omega.normal_()

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        """Global feature map: [..., D] -> [..., F] (float32 for FAVOR+)."""
        if self.opts.feature_map == "elu":
            return F.elu(x) + 1
        if self.opts.feature_map == "relu":
            return F.relu(x)
        xs = x.float() * self.head_dim**-0.25
        proj = xs @ self.omega.float().T  # [..., F]
        return (torch.exp(proj - 0.5 * (xs * xs).sum(-1, keepdim=True)) / math.sqrt(self.feature_dim)).to(x.dtype)

    def project(self, x: torch.Tensor):
        B, T, _ = x.shape
        D, G = self.head_dim, self.n_heads // self.n_kv_heads
        q = self.wq(x).view(B, T, -1, D)
        k = self.wk(x).view(B, T, -1, D)
        v = self.wv(x).view(B, T, -1, D)
        if G > 1:
            k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
        return q, k, v

    def _impls(self) -> tuple[str, str]:
        """(softmax path impl, linear path impl) from ``attention.impl``."""
        impl = self.args.impl
        if impl == "reference":
            return "reference", "chunk"
        return ("auto", impl)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x)
        s_impl, l_impl = self._impls()
        if ctx.cache is not None:
            return self.wo(self._decode(q, k, v, ctx.cache, s_impl).reshape(B, T, -1))
        if ctx.cp is not None:
            return self.wo(self._mix_cp(q, k, v, ctx, s_impl).reshape(B, T, -1))
        cq, ck = local_context(q, k, self.opts.window_size, cu_seqlens=ctx.cu_seqlens, max_seqlen=ctx.max_seqlen,
                               local_map=self.opts.local_feature_map, impl=s_impl)
        qf, kf = self.phi(self.q_ln(q + cq)), self.phi(self.k_ln(k + ck))
        o = normalized_linear_attention(qf, kf, v, eps=self.opts.eps, cu_seqlens=ctx.cu_seqlens, impl=l_impl)
        return self.wo(o.reshape(B, T, -1))

    def _mix_cp(self, q, k, v, ctx: AttentionContext, s_impl: str) -> torch.Tensor:
        """Under context parallelism (:mod:`attention.cp`): q, k, v [B, 2c, H, D], this rank's two chunks -> o
        [B, 2c, H, D]. The local step sees each chunk extended by the w tokens before it
        (:meth:`attention.cp.ContextParallel.halo`, documents from ``halo_segments``); the normalised linear
        attention's state [F, D + 1] (numerator and denominator, no decay) is passed between the chunks by
        :func:`attention.linear_common.linear_recurrence_cp`."""
        cp, w = ctx.cp, self.opts.window_size
        B, L, H, D = q.shape
        c = L // 2
        cu = ctx.cp_segments.halo_segments(w)
        ext = lambda t: cp.halo(t, w).reshape(1, 2 * B * (w + c), H, D)  # noqa: E731
        cq, ck = local_context(ext(q), ext(k), w, cu_seqlens=cu, max_seqlen=w + c,
                               local_map=self.opts.local_feature_map, impl=s_impl)
        cut = lambda t: t.view(B, 2, w + c, H, D)[:, :, w:].reshape(B, L, H, D).to(q.dtype)  # noqa: E731
        qf, kf = self.phi(self.q_ln(q + cut(cq))), self.phi(self.k_ln(k + cut(ck)))
        qf, kf = qf.to(v.dtype), kf.to(v.dtype)
        va = torch.cat([v, torch.ones_like(v[..., :1])], -1)
        flat = lambda t: t.reshape(1, B * L, *t.shape[2:])  # noqa: E731

        def run(vv, h, final, cu_seqlens):
            return gated_linear_attention(flat(qf), flat(kf), vv, scale=1.0, initial_state=h,
                                          output_final_state=final, cu_seqlens=cu_seqlens, impl="chunk")

        return divide_by_normaliser(linear_recurrence_cp(run, va, self.feature_dim, ctx), self.opts.eps, v.dtype)

    def _decode(self, q, k, v, cache: CALACache, s_impl: str) -> torch.Tensor:
        T, n, w = q.shape[1], cache.n, self.opts.window_size
        cache.q[:, n:n + T] = q.to(cache.q.dtype)
        cache.k[:, n:n + T] = k.to(cache.k.dtype)
        s = max(0, n - w)  # rows >= n see only tokens >= n - w: the slice start acts as a harmless pad
        cq, ck = local_context(cache.q[:, s:n + T], cache.k[:, s:n + T], w, local_map=self.opts.local_feature_map,
                               impl=s_impl)
        cache.n = n + T
        qf = self.phi(self.q_ln(q + cq[:, -T:].to(q.dtype)))
        kf = self.phi(self.k_ln(k + ck[:, -T:].to(k.dtype)))
        o, cache.state = normalized_linear_attention(qf, kf, v, eps=self.opts.eps, impl="chunk",
                                                     initial_state=cache.state, output_final_state=True)
        return o

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> CALACache:
        shape = (batch_size, max_len, self.n_heads, self.head_dim)
        return CALACache(q=torch.zeros(shape, device=device, dtype=dtype), k=torch.zeros(shape, device=device, dtype=dtype), n=0)

    def flops_per_token(self, seq_len: int) -> int:
        # Local step: two softmax streams (scores + values, 2 FLOPs per MAC) over the keys of a causal window of w
        # (min(i, w) for the i-th token); global step: the chunked linear attention, 2C(F+D) + 4FD per token (C = 64).
        D, Fd, C = self.head_dim, self.feature_dim, min(64, seq_len)
        local = 2 * 2 * 2 * D * causal_pairs(seq_len, self.opts.window_size) // seq_len
        return self.n_heads * (local + 2 * C * (Fd + D + 1) + 4 * Fd * (D + 1))
