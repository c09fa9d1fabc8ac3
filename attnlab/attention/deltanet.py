"""DeltaNet (Schlag et al. 2021; Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule").

    S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t q_t     (docs/mechanisms.md, "Delta rule")

Parameterisation of fla-core's ``DeltaNet`` layer: q/k/v projections, a short causal depthwise conv (kernel 4)
with SiLU on each, L2-normalised q and k, ``beta = sigmoid(b_proj x)`` (x2 with ``allow_neg_eigval``, giving
eigenvalues in [-1, 1]), per-head RMSNorm on the output (optionally gated), output projection. No RoPE: the
recurrence is position-aware by itself.

:class:`DeltaRuleAttention` is the shared module of the delta-rule family; Gated DeltaNet (``gdn.py``) and
KDA (``kda.py``) subclass it and only add a decay gate (``log_decay``) and their output-gate flavour.

Compute paths (``[attention] impl``): "auto" (fla-core on CUDA when safe, else "chunk"), "chunk" (PyTorch
WY/UT form, torch.compile-able), "reference" (token loop, the oracle), "fla" (fla-core, error if unavailable),
"triton" (fla-core with our Hopper-safe dqkwg backward kernel; "auto" picks it on Hopper + Triton < 3.7.1).
Decoding keeps a :class:`~attention.linear_common.RecurrentCache` (conv states + [B, H, K, V] float32 state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.base import AttentionArgs, AttentionContext
from attnlab.attention.linear_common import (GatedRMSNorm, RecurrentCache, ShortConvolution, acc_dtype, l2norm,
                                             linear_recurrence_cp)
from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.delta_rule import DELTA_RULE_IMPLS, delta_rule
from attnlab.attention.registry import register_attention


@dataclass
class DeltaNetOptions:
    num_heads: int = field(default=0, metadata={"valid": ">= 0"})
    """Number of heads; 0 = ``model`` n_heads."""
    head_k_dim: int = field(default=0, metadata={"valid": ">= 0"})
    """Key/query dim per head; 0 = ``model`` head_dim."""
    expand_v: float = field(default=1.0, metadata={"valid": "> 0"})
    """Value head dim = expand_v * head_k_dim (fla DeltaNet: 1)."""
    use_short_conv: bool = True
    """Short causal depthwise conv + SiLU on q, k, v (without it: SiLU only)."""
    conv_size: int = field(default=4, metadata={"valid": ">= 1"})
    """Kernel size of the short convolutions."""
    use_output_gate: bool = False
    """Output = RMSNorm(o) * swish(g_proj x) (fla ``use_gate``); off = plain RMSNorm."""
    allow_neg_eigval: bool = False
    """beta = 2 sigmoid(.) in (0, 2): transition eigenvalues in [-1, 1] (Grazzi et al. 2025)."""
    chunk_size: int = field(default=64, metadata={"valid": ">= 1"})
    """Chunk length of the chunked (WY) path."""
    norm_eps: float = field(default=1e-5, metadata={"valid": "> 0"})
    """Epsilon of the output RMSNorm."""


class DeltaRuleAttention(nn.Module):
    """Shared delta-rule layer: projections, short convs, L2 q/k, beta, optional decay gate, gated norm."""

    impls = DELTA_RULE_IMPLS
    """``[attention] impl`` values this mechanism accepts (``--list-attention`` prints them)."""
    context_parallel = True
    """Runs under context parallelism (:meth:`_mix_cp`, :meth:`attention.linear_common.ShortConvolution.forward_cp`)."""
    context_parallel_compiles = True
    """Its CP path compiles (``compile.enable``) into the blocks' single graphs (docs/context_parallel.md)."""

    gate_activation = "swish"  # output-gate nonlinearity (KDA: sigmoid)
    gate_lower_bound: float | None = None  # KDA's bounded gate: every log decay >= it (fla's safe_gate kernels)

    def __init__(self, args: AttentionArgs, opts):
        super().__init__()
        name = getattr(self, "mechanism", type(self).__name__)
        check_impl(args.impl, self.impls, name)
        H = opts.num_heads or args.n_heads
        K = opts.head_k_dim or args.head_dim
        V = int(round(K * opts.expand_v))
        if H <= 0 or K <= 0 or V <= 0:
            raise ValueError(f"attention.{name}: num_heads={H}, head_k_dim={K}, expand_v={opts.expand_v} must give positive sizes")
        if opts.chunk_size < 1:
            raise ValueError(f"attention.{name}.chunk_size={opts.chunk_size} must be >= 1")
        self.args, self.opts = args, opts
        self.n_heads, self.head_k_dim, self.head_v_dim = H, K, V
        self.key_dim, self.value_dim = H * K, H * V
        self.q_proj = nn.Linear(args.dim, self.key_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, self.key_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, self.value_dim, bias=False)
        self.b_proj = nn.Linear(args.dim, H, bias=False)
        self.param_roles = {"b_proj": "vector"}  # β per head: not a hidden matrix (optim.groups)
        if opts.use_short_conv:
            self.conv_q = ShortConvolution(self.key_dim, opts.conv_size)
            self.conv_k = ShortConvolution(self.key_dim, opts.conv_size)
            self.conv_v = ShortConvolution(self.value_dim, opts.conv_size)
        self.g_proj = self.build_output_gate() if opts.use_output_gate else None
        self.o_norm = GatedRMSNorm(V, eps=opts.norm_eps, activation=self.gate_activation)
        self.o_proj = nn.Linear(self.value_dim, args.dim, bias=False)

    # ---------------------------------------------------------------- hooks for the gated variants
    def build_output_gate(self) -> nn.Module:
        return nn.Linear(self.args.dim, self.value_dim, bias=False)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor | None:
        """Log-space decay: None (DeltaNet), [B, T, H] (GDN) or [B, T, H, K] (KDA), float32."""
        return None

    def reset_gate_parameters(self) -> None:
        pass

    # ---------------------------------------------------------------- contract
    def init_weights(self, init_std: float) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.b_proj):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        for m in (self.g_proj.modules() if self.g_proj is not None else ()):
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        trunc_normal_(self.o_proj.weight, mean=0.0, std=init_std)
        if self.opts.use_short_conv:
            for conv in (self.conv_q, self.conv_k, self.conv_v):
                conv.reset_parameters()
        self.o_norm.reset_parameters()
        self.reset_gate_parameters()

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> RecurrentCache:
        cache = RecurrentCache(state=torch.zeros(batch_size, self.n_heads, self.head_k_dim, self.head_v_dim,
                                                 device=device, dtype=torch.float32))
        if self.opts.use_short_conv:
            for name, conv in (("q", self.conv_q), ("k", self.conv_k), ("v", self.conv_v)):
                cache.conv[name] = conv.init_state(batch_size, device, dtype)
        return cache

    def flops_per_token(self, seq_len: int) -> int:
        # Chunked form per token and head (C = chunk): Akk and Aqk rows 2*C*K each, the triangular solve
        # C*(K+V), W h, q h and the state update 2*K*V each, Aqk vnew 2*C*V.
        C, K, V = min(self.opts.chunk_size, seq_len), self.head_k_dim, self.head_v_dim
        return self.n_heads * (4 * C * K + C * (K + V) + 6 * K * V + 2 * C * V)

    def _conv(self, name: str, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        cache = ctx.cache
        conv = getattr(self, f"conv_{name}")
        if ctx.cp is not None:
            return conv.forward_cp(x, ctx)
        y, state = conv(x, cu_seqlens=None if cache is not None else ctx.cu_seqlens,
                        state=None if cache is None else cache.conv[name])
        if cache is not None:
            cache.conv[name] = state
        return y

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """x: [B, T, dim] -> [B, T, dim]. With ``ctx.cache``: T new tokens continuing the cached state."""
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_k_dim, self.head_v_dim
        cache = ctx.cache
        if cache is not None and ctx.cu_seqlens is not None:
            raise ValueError(f"{self.mechanism}: decoding with a cache does not support packed documents (cu_seqlens)")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.opts.use_short_conv:
            q, k, v = self._conv("q", q, ctx), self._conv("k", k, ctx), self._conv("v", v, ctx)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q, k = l2norm(q.view(B, T, H, K)), l2norm(k.view(B, T, H, K))
        v = v.view(B, T, H, V)
        beta = torch.sigmoid(self.b_proj(x).to(acc_dtype(x)))  # [B, T, H]
        if self.opts.allow_neg_eigval:
            beta = beta * 2.0
        g = self.log_decay(x)
        o = self._mix(q, k, v, beta, g, ctx)  # [B, T, H, V]
        gate = None if self.g_proj is None else self.g_proj(x).view(B, T, H, V)
        o = self.o_norm(o, gate)
        return self.o_proj(o.reshape(B, T, self.value_dim))

    def _mix(self, q, k, v, beta, g, ctx: AttentionContext) -> torch.Tensor:
        B, T = q.shape[:2]
        kw = dict(chunk_size=self.opts.chunk_size, impl=self.args.impl, gate_lower_bound=self.gate_lower_bound)
        if ctx.cp is not None:
            return self._mix_cp(q, k, v, beta, g, ctx, **kw)
        if ctx.cache is not None:
            o, ctx.cache.state = delta_rule(q, k, v, beta, g, initial_state=ctx.cache.state, output_final_state=True, **kw)
            ctx.cache.seen += T
            return o
        if ctx.cu_seqlens is None:
            return delta_rule(q, k, v, beta, g, **kw)[0]
        flat = lambda t: None if t is None else t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
        o, _ = delta_rule(flat(q), flat(k), flat(v), flat(beta), flat(g), cu_seqlens=ctx.cu_seqlens, **kw)
        return o.view(B, T, *o.shape[2:])

    def _mix_cp(self, q, k, v, beta, g, ctx: AttentionContext, **kw) -> torch.Tensor:
        """The delta rule (``kw``: :func:`attention.ops.delta_rule.delta_rule`'s options, any impl) over this rank's
        two chunks under context parallelism (:mod:`attention.cp`). q, k: [B, 2c, H, K]; v: [B, 2c, H, V];
        beta: [B, 2c, H]; g: None, [B, 2c, H] or [B, 2c, H, K]; returns o [B, 2c, H, V].

        The state h [K, V] changes as h ← A_t h + β_t k_t v_tᵀ with A_t = (I − β_t k_t k_tᵀ) D_t, linear in h
        column by column, so a chunk maps the state entering it to M h + B (M = its A_t multiplied out, K × K).
        Started from [0 | I] with values [v | 0], the chunk's final state is [B | M]: one run of the same kernel over
        V + K columns gives the chunk's transition, from which :meth:`attention.cp.ContextParallel.states_entering`
        composes the states entering this rank's chunks; the chunks then run from them
        (:func:`attention.linear_common.linear_recurrence_cp`). Documents inside a chunk are separate segments (the
        kernel's varlen form); a chunk whose last document starts inside it has M = 0."""
        B, L = q.shape[:2]
        flat = lambda t: None if t is None else t.reshape(1, B * L, *t.shape[2:])  # noqa: E731

        def run(vv, h, final, cu):
            return delta_rule(flat(q), flat(k), vv, flat(beta), flat(g), initial_state=h, output_final_state=final,
                              cu_seqlens=cu, **kw)

        return linear_recurrence_cp(run, v, q.shape[-1], ctx)


@register_attention("deltanet", options=DeltaNetOptions,
                    description="DeltaNet: delta-rule linear attention (short conv, L2 q/k, sigmoid beta)")
class DeltaNetAttention(DeltaRuleAttention):
    """DeltaNet layer (fla ``DeltaNet`` parameterisation)."""
