"""FoX: the Forgetting Transformer (Lin et al., ICLR 2025) — softmax attention with a forget gate.

    o_t = Σ_{i<=t} softmax_i( q_t·k_i / sqrt(D) + Σ_{j=i+1}^{t} log f_j ) v_i,   f_j = σ(w_h·x_j + b_h)

(Variants eq. 31; fla ``ForgettingAttention``). One forget gate per query head; no RoPE by default (the gate
already encodes recency). Options give the paper's "Pro" block pieces: QK-norm, output gate σ(W_g x) and
output RMSNorm (``pro = true`` switches on all three; the Pro block's KV-shift is not implemented).
Decoding uses a KV cache plus the cumulative log gate per query head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.base import (AttentionArgs, AttentionContext, QKVAttentionBase, apply_rope, causal_pairs,
                                    mix_whole_rows)
from attnlab.attention.linear_common import GatedRMSNorm
from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.fox import IMPLS, forgetting_attention, fox_decode
from attnlab.attention.registry import register_attention


@dataclass
class FoxOptions:
    INIT_ONLY: ClassVar[tuple[str, ...]] = ("forget_bias_init",)
    """Options that only set initial weights (the forget gate's bias): a resume loads them, so it may change them
    (checkpoint.dcp.INIT_ONLY_FIELDS)."""

    qk_norm: bool = False
    """RMSNorm on q and k per head (FoX Pro)."""
    output_gate: bool = False
    """Multiply the output by σ(W_g x) per channel (FoX Pro; fla use_output_gate)."""
    output_norm: bool = False
    """RMSNorm per head on the attention output before the output gate (FoX Pro)."""
    pro: bool = False
    """Shorthand for qk_norm, output_gate and output_norm all on (the paper's Pro block minus KV-shift)."""
    rope: bool = False
    """Also apply RoPE to q and k (FoX uses none)."""
    forget_bias_init: float = field(default=0.0, metadata={"valid": "any: a bias; σ(bias) is the initial retention"})
    """Initial bias of the forget-gate projection (σ(bias) is the initial per-token retention)."""
    block_size: int = field(default=64, metadata={"valid": ">= 1"})
    """Block size of the PyTorch blockwise path."""


@dataclass
class FoxCache:
    """k, v: [B, L, HKV, D]; c: [B, L, HQ] float32 cumulative log forget gate; n: tokens cached."""

    k: torch.Tensor
    v: torch.Tensor
    c: torch.Tensor
    n: int = 0


@register_attention("fox", options=FoxOptions, description="FoX: softmax attention with a data-dependent forget gate (Lin et al. 2025)")
class ForgettingAttention(QKVAttentionBase):
    """Causal softmax attention whose logits are biased by cumulative log forget gates."""

    impls = IMPLS
    """``[attention] impl`` values this mechanism accepts (``--list-attention`` prints them)."""
    context_parallel = True
    """Runs under context parallelism: q, k, v and the log forget gates all-gathered, the whole rows attended
    (:func:`attention.base.mix_whole_rows`): each query's gate sums run over the row's gates."""
    context_parallel_compiles = True
    """Its CP path compiles (``compile.enable``) into the blocks' single graphs (docs/context_parallel.md)."""

    def __init__(self, args: AttentionArgs, opts: FoxOptions):
        check_impl(args.impl, self.impls, "fox")
        qk_norm, out_gate, out_norm = (opts.qk_norm or opts.pro, opts.output_gate or opts.pro, opts.output_norm or opts.pro)
        super().__init__(args, qk_norm, rope=False)
        self.opts = opts
        H, D = args.n_heads, args.head_dim
        self.f_proj = nn.Linear(args.dim, H, bias=True)
        self.param_roles = {"f_proj": "vector"}  # forget gate per head: not a hidden matrix (optim.groups)
        self.out_gate = nn.Linear(args.dim, H * D, bias=False) if out_gate else None
        self.o_norm = GatedRMSNorm(D, eps=args.norm_eps, activation="sigmoid") if out_norm else None

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        for lin in (self.f_proj,) + ((self.out_gate,) if self.out_gate is not None else ()):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.constant_(self.f_proj.bias, self.opts.forget_bias_init)
        if self.o_norm is not None:
            self.o_norm.reset_parameters()

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> FoxCache:
        kv = lambda: torch.zeros(batch_size, max_len, self.n_kv_heads, self.head_dim, device=device, dtype=dtype)  # noqa: E731
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        return FoxCache(kv(), kv(), torch.zeros(batch_size, max_len, self.n_heads, device=device, dtype=cdt))

    def flops_per_token(self, seq_len: int) -> int:
        # as softmax attention: q·k and p·v over the causal keys (the block mask skips the tiles above the diagonal)
        return 2 * 2 * self.n_heads * self.head_dim * causal_pairs(seq_len) // seq_len

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        q = self.wq(x).view(B, T, H, D)
        k = self.wk(x).view(B, T, -1, D)
        v = self.wv(x).view(B, T, -1, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.opts.rope:
            cos, sin = ctx.rope(D)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        g = F.logsigmoid(self.f_proj(x).float())  # [B, T, H] log forget gate
        cache: FoxCache | None = ctx.cache
        if cache is not None:
            n = cache.n
            cache.k[:, n:n + T], cache.v[:, n:n + T] = k.to(cache.k.dtype), v.to(cache.v.dtype)
            c0 = cache.c[:, n - 1:n] if n > 0 else torch.zeros_like(cache.c[:, :1])
            cache.c[:, n:n + T] = c0 + g.to(cache.c.dtype).cumsum(1)
            o = fox_decode(q, cache.k, cache.v, cache.c, n)
            cache.n = n + T
        elif ctx.cp is not None:
            o = mix_whole_rows(ctx, lambda q, k, v, g, cu_seqlens: forgetting_attention(
                q, k, v, g, cu_seqlens=cu_seqlens, block_size=self.opts.block_size, impl=self.args.impl), q, k, v, g)
        else:
            o = forgetting_attention(q, k, v, g, cu_seqlens=ctx.cu_seqlens, block_size=self.opts.block_size, impl=self.args.impl)
        gate = self.out_gate(x).view(B, T, H, D) if self.out_gate is not None else None
        if self.o_norm is not None:
            o = self.o_norm(o, gate)
        elif gate is not None:
            o = o * torch.sigmoid(gate)
        return self.wo(o.reshape(B, T, H * D).to(x.dtype))
