"""Higher-order Linear Attention (HLA; Zhang, Qin, Gu 2025, arXiv:2510.27258) as an attention sublayer.

Token mixing (docs/mechanisms.md, "HLA"; ops in ``attnlab/attention/ops/hla``):

- order 2, "symmetric" (masked HLA, eq. 3):  o_t = Σ_{i≤j≤t} b(i,t) b(j,t) (q_t·k_i)(k_i·q_j) v_j
- order 2, "asymmetric" (AHLA, eq. 7):        o = (A_γ A_γ) V,  A_γ[t,i] = b(i,t) q_t·k_i
- order 3 (masked third order)

with b(i,t) = γ^{t−i} (decay "fixed" or "learnable" per head; "none": γ = 1), each factor decaying by its own
age, so a chunk scan and the recurrence agree.

Departures from the paper (which has no experiments and prescribes no module): q and k are L2-normalised per
head (or RMSNorm'd and scaled by D^-1/2) because unnormalised HLA grows like t²|q|²|k|²; an RMSNorm
per head on the output (as GLA/RetNet) and an optional sigmoid output gate; optional RoPE; GQA by repeating
k and v over the query heads. Optional normalisation divides by the same operator applied to v ≡ 1 with a
sign-safe ε. Decoding keeps the compact states of ``attnlab/attention/ops/hla/recurrent.py`` in the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.base import AttentionArgs, AttentionContext, QKVAttentionBase, apply_rope, copy_full_
from attnlab.attention.linear_common import linear_recurrence_cp
from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.linear_attn import gated_linear_attention
from attnlab.attention.ops.hla import IMPLS, hla, init_state, resolve_impl
from attnlab.attention.ops.hla.chunk import compose_hla
from attnlab.attention.ops.hla.recurrent import hla_step
from attnlab.attention.registry import register_attention

DECAYS = ("none", "fixed", "learnable")
QK_NORMS = ("l2", "rms", "none")


@dataclass
class HLAOptions:
    order: int = field(default=2, metadata={"valid": "one of 2, 3"})
    """2 (second order) or 3 (corrected masked third order; symmetric only)."""
    variant: str = field(default="symmetric", metadata={"valid": "one of symmetric, asymmetric"})
    """"symmetric" (HLA, A Aᵀ V) or "asymmetric" (AHLA, A A V; order 2 only)."""
    decay: str = field(default="learnable", metadata={"valid": "one of none, fixed, learnable"})
    """"none" (γ = 1), "fixed" (γ = gamma_init per head) or "learnable" (per head, log γ = −exp(θ))."""
    gamma_init: float = field(default=0.99, metadata={"valid": "in (0, 1]"})
    """Initial γ of the slowest head; see gamma_init_min."""
    gamma_init_min: float = field(default=0.0, metadata={"valid": "in [0, 1)"})
    """If in (0, gamma_init): heads get γ spread log-uniformly in (1 − γ) between gamma_init_min and gamma_init."""
    normalize: bool = False
    """Divide by the same operator applied to v ≡ 1 (paper eq. 4), sign-safe ε (its sign is not fixed when masked)."""
    eps: float = field(default=1e-6, metadata={"valid": "> 0"})
    """ε of the normalisation."""
    qk_norm: str = field(default="l2", metadata={"valid": "one of l2, rms, none"})
    """Per-head normalisation of q and k: "l2", "rms" (RMSNorm then ×D^-1/2) or "none" (×D^-1/2)."""
    rope: bool = False
    """Apply RoPE to q and k."""
    output_norm: bool = True
    """RMSNorm per head on the mixer output."""
    output_gate: bool = False
    """Sigmoid gate per channel on the output, from x (GLA-style)."""
    chunk_size: int = field(default=64, metadata={"valid": "a power of 2"})
    """Chunk width of the chunked paths (16, 32, 64 or 128 for Triton)."""


@dataclass
class HLACache:
    """Decode state: the tuple of ``attention.ops.hla.recurrent`` ((S, U) | (P, E) | (S, P, Y)), fp32 [B, H, *, *]."""

    state: tuple


@register_attention("hla", options=HLAOptions, description="Higher-order Linear Attention (2nd/3rd order, AHLA), decayed, chunked Triton")
class HigherOrderLinearAttention(QKVAttentionBase):
    """Masked higher-order linear attention with per-head decay, q/k normalisation and output norm."""

    impls = IMPLS
    """``[attention] impl`` values this mechanism accepts (``--list-attention`` prints them)."""
    context_parallel = True
    """Runs under context parallelism (:meth:`_mix_cp`)."""
    context_parallel_compiles = True
    """Its CP path compiles (``compile.enable``) into the blocks' single graphs (docs/context_parallel.md)."""

    def __init__(self, args: AttentionArgs, opts: HLAOptions):
        if opts.order not in (2, 3):
            raise ValueError(f"attention.hla.order={opts.order!r}; choose from [2, 3]")
        if opts.variant not in ("symmetric", "asymmetric"):
            raise ValueError(f"attention.hla.variant={opts.variant!r}; choose from ['symmetric', 'asymmetric']")
        if opts.variant == "asymmetric" and opts.order != 2:
            raise ValueError(f"attention.hla.variant='asymmetric' needs attention.hla.order=2, got {opts.order}")
        if opts.decay not in DECAYS:
            raise ValueError(f"attention.hla.decay={opts.decay!r}; choose from {list(DECAYS)}")
        if opts.qk_norm not in QK_NORMS:
            raise ValueError(f"attention.hla.qk_norm={opts.qk_norm!r}; choose from {list(QK_NORMS)}")
        if opts.decay != "none" and not 0.0 < opts.gamma_init < 1.0:
            raise ValueError(f"attention.hla.gamma_init={opts.gamma_init} must be in (0, 1)")
        check_impl(args.impl, self.impls, "hla")
        super().__init__(args, opts.qk_norm == "rms", rope=opts.rope)
        self.opts = opts
        D = args.head_dim
        self.o_norm = nn.RMSNorm(D, eps=args.norm_eps) if opts.output_norm else None
        self.g_proj = nn.Linear(args.dim, args.n_heads * D, bias=False) if opts.output_gate else None
        if opts.decay == "learnable":
            self.decay_log = nn.Parameter(torch.empty(args.n_heads))  # log γ = −exp(decay_log)
            self.param_roles = {"decay_log": "vector"}  # a scalar per head, not a hidden matrix (optim.groups)
        elif opts.decay == "fixed":
            self.register_buffer("log_gamma", torch.empty(args.n_heads), persistent=False)

    # ------------------------------------------------------------------ parameters
    def _init_gammas(self) -> torch.Tensor:
        """[H] initial γ per head."""
        H, o = self.n_heads, self.opts
        if 0.0 < o.gamma_init_min < o.gamma_init and H > 1:
            lo, hi = math.log(1 - o.gamma_init), math.log(1 - o.gamma_init_min)
            return 1 - torch.exp(torch.linspace(lo, hi, H))
        return torch.full((H,), o.gamma_init)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        if self.g_proj is not None:
            trunc_normal_(self.g_proj.weight, mean=0.0, std=0.02)
        if self.o_norm is not None:
            self.o_norm.reset_parameters()
        if self.opts.decay == "learnable":
            copy_full_(self.decay_log, torch.log(-torch.log(self._init_gammas())))
        elif self.opts.decay == "fixed":
            self.log_gamma.copy_(torch.log(self._init_gammas()))

    def log_gamma_per_head(self) -> torch.Tensor | None:
        """[H] log γ (fp32) or None when there is no decay."""
        if self.opts.decay == "learnable":
            return -torch.exp(self.decay_log.float())
        if self.opts.decay == "fixed":
            return self.log_gamma.float()
        return None

    # ------------------------------------------------------------------ forward
    def project(self, x: torch.Tensor, ctx: AttentionContext):
        """x: [B, T, dim] -> q, k, v: [B, T, H, D] (k, v repeated over GQA groups), q/k normalised."""
        B, T, _ = x.shape
        D = self.head_dim
        q = self.wq(x).view(B, T, -1, D)
        k = self.wk(x).view(B, T, -1, D)
        v = self.wv(x).view(B, T, -1, D)
        if self.opts.rope:
            cos, sin = ctx.rope(D)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.opts.qk_norm == "l2":
            q = F.normalize(q.float(), dim=-1, eps=1e-6).to(q.dtype)
            k = F.normalize(k.float(), dim=-1, eps=1e-6).to(k.dtype)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q * D**-0.5, k * D**-0.5
        G = self.n_heads // self.n_kv_heads
        if G > 1:
            k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
        return q, k, v

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x, ctx)
        lg = self.log_gamma_per_head()
        g = None if lg is None else lg.view(1, 1, -1).expand(B, T, -1)
        kw = dict(order=self.opts.order, variant=self.opts.variant, normalize=self.opts.normalize, eps=self.opts.eps)
        if ctx.cache is not None:
            o = self._decode(q, k, v, g, ctx.cache, kw)
        elif ctx.cp is not None:
            o = self._mix_cp(q, k, v, g, ctx, kw)
        else:
            o = hla(q, k, v, g, cu_seqlens=ctx.cu_seqlens, chunk_size=self.opts.chunk_size, impl=self.args.impl, **kw)
        if self.o_norm is not None:
            o = self.o_norm(o)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x).view(B, T, -1, self.head_dim))
        return self.wo(o.reshape(B, T, -1))

    def _mix_cp(self, q, k, v, g, ctx: AttentionContext, kw) -> torch.Tensor:
        """Under context parallelism (:mod:`attention.cp`): q, k, v [B, 2c, H, D], g [B, 2c, H] or None -> o
        [B, 2c, H, D]. HLA is a chain of gated linear attentions (:func:`attention.ops.hla.chunk.compose_hla`;
        second order: R = GLA(q, k, k; γ) with state S = Σ k kᵀ, then O = GLA(q, R, v; γ²) with state U), each a
        recurrence linear in its state: each pass's state is passed between the chunks by
        :func:`attention.linear_common.linear_recurrence_cp`, so the next pass reads exact inputs."""
        B, L = q.shape[:2]
        impl = resolve_impl(self.args.impl, q.device, stateful=True)
        flat = lambda t: None if t is None else t.reshape(1, B * L, *t.shape[2:])  # noqa: E731

        def gla_cp(a, b, c, gg, initial_state=None, output_final_state=False):
            def run(vv, h, final, cu):
                return gated_linear_attention(flat(a), flat(b), vv, flat(gg), scale=1.0, initial_state=h,
                                              output_final_state=final, cu_seqlens=cu,
                                              chunk_size=self.opts.chunk_size, impl=impl)

            return linear_recurrence_cp(run, c, b.shape[-1], ctx), None

        return compose_hla(gla_cp, q, k, v, g, **kw)

    def _decode(self, q, k, v, g, cache: HLACache, kw) -> torch.Tensor:
        """New tokens with the cached state: a recurrence step for T == 1, else the chunk path (prefill)."""
        if q.shape[1] > 1:
            o, cache.state = hla(q, k, v, g, chunk_size=self.opts.chunk_size, impl="chunk", initial_state=cache.state,
                                 output_final_state=True, **kw)
            return o
        vv = torch.cat([v, torch.ones_like(v[..., :1])], -1) if kw["normalize"] else v
        o, cache.state = hla_step(cache.state, q[:, 0], k[:, 0], vv[:, 0], None if g is None else g[:, 0],
                                  kw["order"], kw["variant"])
        if kw["normalize"]:
            den = o[..., -1]
            o = o[..., :-1] / torch.where(den >= 0, den + kw["eps"], den - kw["eps"]).unsqueeze(-1)
        return o[:, None].to(q.dtype)

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> HLACache:
        V = self.head_dim + (1 if self.opts.normalize else 0)
        return HLACache(init_state(self.opts.order, self.opts.variant, batch_size, self.n_heads, self.head_dim, V,
                                   device, torch.float32))

    def flops_per_token(self, seq_len: int) -> int:
        # Chunked form: each gated-linear-attention pass costs 2C(K+V) (intra-chunk, C = chunk) + 4KV (state read
        # and update) per token and head; second order and AHLA run two passes, third order three.
        D, C = self.head_dim, min(self.opts.chunk_size, seq_len)
        passes = 3 if self.opts.order == 3 else 2
        return passes * self.n_heads * (2 * C * 2 * D + 4 * D * D)
