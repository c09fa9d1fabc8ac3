"""PaTH attention (Yang et al., 2025): softmax attention with a data-dependent Householder position encoding.

    logit_{t,i} = scale · k_i^T (M_{i+1} ··· M_t) q_t,   M_j = I − β_j ν_j ν_j^T,
    β_j = 2 σ(w_β·x_j + b),   ν_j = L2norm(SiLU(ShortConv_3(W_2 W_1 x_j)))          (Variants eq. 33)

fla ``PaTHAttention`` parameterisation: rank-32 projection for ν, a kernel-3 short conv + SiLU on it, then
L2 normalisation (float32); β per kv head; no RoPE (the Householder path is the position encoding);
optional FoX forget gate per query head (PaTH-FoX, gate scaled with the logits as fla does) and QK RMSNorm.
Decoding keeps a cache of *transformed* keys: every new token applies its M_t to all cached keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.base import AttentionArgs, AttentionContext, QKVAttentionBase, causal_pairs, mix_whole_rows
from attnlab.attention.linear_common import ShortConvolution, l2norm
from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.fox import fox_decode
from attnlab.attention.ops.path import IMPLS, householder_update_, path_attention
from attnlab.attention.registry import register_attention


@dataclass
class PathOptions:
    use_low_rank_w: bool = True
    """Project ν through a low-rank W_2 W_1 (fla: on)."""
    w_low_rank_dim: int = field(default=32, metadata={"valid": ">= 1"})
    """Rank of the ν projection (fla: 32)."""
    use_w_shortconv: bool = True
    """Causal short conv + SiLU on ν before the L2 norm (fla: on)."""
    conv_size: int = field(default=3, metadata={"valid": ">= 1"})
    """Kernel size of ν's short conv (fla: 3)."""
    use_forget_gate: bool = False
    """Add FoX's forget gate per query head (PaTH-FoX)."""
    qk_norm: bool = False
    """RMSNorm on q and k per head."""
    block_size: int = field(default=64, metadata={"valid": ">= 1"})
    """Block size of the PyTorch blockwise path."""


@dataclass
class PathCache:
    """k: [B, L, HKV, D] transformed keys; v: [B, L, HKV, D]; c: [B, L, HQ] cumulative log gate;
    conv: [B, HKV·D, conv_size−1] state of ν's short conv; n: tokens cached."""

    k: torch.Tensor
    v: torch.Tensor
    c: torch.Tensor
    conv: torch.Tensor | None = None
    n: int = 0
    extra: dict = field(default_factory=dict)


@register_attention("path", options=PathOptions, description="PaTH: softmax attention with data-dependent Householder position encoding (Yang et al. 2025)")
class PathAttention(QKVAttentionBase):
    """Softmax attention whose q·k passes through a cumulative product of generalised Householder matrices."""

    impls = IMPLS
    """``[attention] impl`` values this mechanism accepts (``--list-attention`` prints them)."""
    context_parallel = True
    """Runs under context parallelism: ν's short convolution with the history before each chunk
    (:meth:`attention.linear_common.ShortConvolution.forward_cp`), then q, k, v, ν, β (and the forget gates)
    all-gathered and the whole rows attended (:func:`attention.base.mix_whole_rows`): the Householder products
    between a query and its keys run over the row."""
    context_parallel_compiles = True
    """Its CP path compiles (``compile.enable``) into the blocks' single graphs (docs/context_parallel.md)."""

    def __init__(self, args: AttentionArgs, opts: PathOptions):
        check_impl(args.impl, self.impls, "path")
        super().__init__(args, opts.qk_norm, rope=False)
        self.opts = opts
        H, HKV, D = args.n_heads, args.n_kv_heads, args.head_dim
        if opts.use_low_rank_w:
            self.w_proj = nn.Sequential(nn.Linear(args.dim, opts.w_low_rank_dim, bias=False),
                                        nn.Linear(opts.w_low_rank_dim, HKV * D, bias=False))
        else:
            self.w_proj = nn.Linear(args.dim, HKV * D, bias=False)
        self.w_conv = ShortConvolution(HKV * D, opts.conv_size, "silu") if opts.use_w_shortconv else None
        self.bt_proj = nn.Linear(args.dim, HKV, bias=True)
        self.f_proj = nn.Linear(args.dim, H, bias=True) if opts.use_forget_gate else None
        # β and forget gates, and the thin low-rank factors of w: not hidden matrices (optim.groups)
        self.param_roles = {"bt_proj": "vector"}
        if self.f_proj is not None:
            self.param_roles["f_proj"] = "vector"
        if opts.use_low_rank_w:
            self.param_roles["w_proj"] = "vector"

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        lins = [self.bt_proj] + ([self.f_proj] if self.f_proj is not None else [])
        lins += list(self.w_proj) if self.opts.use_low_rank_w else [self.w_proj]
        for lin in lins:
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.w_conv is not None:
            self.w_conv.reset_parameters()

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> PathCache:
        kv = lambda: torch.zeros(batch_size, max_len, self.n_kv_heads, self.head_dim, device=device, dtype=dtype)  # noqa: E731
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        conv = self.w_conv.init_state(batch_size, device, dtype) if self.w_conv is not None else None
        return PathCache(kv(), kv(), torch.zeros(batch_size, max_len, self.n_heads, device=device, dtype=cdt), conv)

    def flops_per_token(self, seq_len: int) -> int:
        # softmax attention's q·k and p·v, plus the rank-m key/query transforms (about 2 more GEMMs of
        # the same size in the blockwise form), over the causal (query, key) pairs.
        return 2 * 2 * 2 * self.n_heads * self.head_dim * causal_pairs(seq_len) // seq_len

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        cache: PathCache | None = ctx.cache
        q = self.wq(x).view(B, T, H, D)
        k = self.wk(x).view(B, T, -1, D)
        v = self.wv(x).view(B, T, -1, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        w = self.w_proj(x)
        if self.w_conv is not None:
            if ctx.cp is not None:
                w = self.w_conv.forward_cp(w, ctx)
            elif cache is not None:
                w, cache.conv = self.w_conv(w, state=cache.conv)
            else:
                w, _ = self.w_conv(w, cu_seqlens=ctx.cu_seqlens)
        fdt = torch.float64 if x.dtype == torch.float64 else torch.float32  # fla wants float32 ν, β, g
        w = l2norm(w.view(B, T, -1, D).to(fdt))  # ν: [B, T, HKV, D]
        beta = 2 * torch.sigmoid(self.bt_proj(x).to(fdt))  # [B, T, HKV] in (0, 2)
        g = F.logsigmoid(self.f_proj(x).to(fdt)) if self.f_proj is not None else None
        if cache is not None:
            o = self._decode(q, k, v, w, beta, g, cache)
        elif ctx.cp is not None:
            o = mix_whole_rows(ctx, lambda q, k, v, w, beta, g, cu_seqlens: path_attention(
                q, k, v, w, beta, g, cu_seqlens=cu_seqlens, block_size=self.opts.block_size, impl=self.args.impl),
                q, k, v, w, beta, g)
        else:
            o = path_attention(q, k, v, w, beta, g, cu_seqlens=ctx.cu_seqlens, block_size=self.opts.block_size,
                               impl=self.args.impl)
        return self.wo(o.reshape(B, T, H * D).to(x.dtype))

    def _decode(self, q, k, v, w, beta, g, cache: PathCache) -> torch.Tensor:
        """Token by token: transform cached keys by M_t, append k_t, attend (logits scaled with the gate)."""
        T, D = q.shape[1], self.head_dim
        scale = D**-0.5
        outs = []
        for j in range(T):
            n = cache.n
            householder_update_(cache.k, w[:, j], beta[:, j], n)
            cache.k[:, n], cache.v[:, n] = k[:, j].to(cache.k.dtype), v[:, j].to(cache.v.dtype)
            gj = g[:, j].to(cache.c.dtype) if g is not None else torch.zeros_like(cache.c[:, 0])
            cache.c[:, n] = (cache.c[:, n - 1] if n > 0 else 0) + gj
            outs.append(fox_decode(q[:, j:j + 1], cache.k, cache.v, cache.c * scale, n, scale=scale))
            cache.n = n + 1
        return torch.cat(outs, dim=1)
