"""GLA: gated linear attention with a per-key-channel (column-wise) forget gate (Yang et al., 2024).

    h_t = diag(α_t) h_{t-1} + k_t v_t^T,  o_t = h_t^T q_t / sqrt(K),  log α_t = logsigmoid(W_2 W_1 x_t + b) / 16

(docs/mechanisms.md, "The linear family"). Parameterisation of fla's ``GatedLinearAttention`` layer:
low-rank (16) gate projection, logit normaliser 16, key dim ``expand_k = 0.5`` of the value dim, no short
conv by default, output ``RMSNorm(o) * swish(W_g x)`` per head. GQA: k/v use ``n_kv_heads`` and are shared
by groups of query heads (gates are per query head).

This file also holds :class:`LinearFamilyAttention`, the shared layer of ``gla``, ``gated_linear`` and
``linear``: projections, optional short convs, the op dispatch (``[attention] impl`` = "auto" | "reference"
| "chunk" | "triton" | "fla"; "triton" has per-head gates only, so ``gla`` does not take it), output gate/norm, and
decoding with a recurrent state cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.base import AttentionArgs, AttentionContext
from attnlab.attention.linear_common import GatedRMSNorm, RecurrentCache, ShortConvolution, linear_recurrence_cp
from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.linear_attn import IMPLS, TRITON_CHUNK_SIZES, gated_linear_attention
from attnlab.attention.registry import register_attention


class LinearFamilyAttention(nn.Module):
    """Shared layer: x -> q, k, v (+ short conv) -> gates -> gated linear attention -> out gate/norm -> o_proj.

    Subclasses set ``self.key_dim`` before calling :meth:`_build` and implement :meth:`gates`
    (and optionally :meth:`feature_map`). ``self.normalize`` adds the Katharopoulos denominator.
    """

    impls = IMPLS
    """``[attention] impl`` values this mechanism accepts (``--list-attention`` prints them)."""
    context_parallel = True
    """Runs under context parallelism (:meth:`_mix_cp`, :meth:`attention.linear_common.ShortConvolution.forward_cp`)."""
    context_parallel_compiles = True
    """Its CP path compiles (``compile.enable``) into the blocks' single graphs (docs/context_parallel.md)."""

    normalize: bool = False

    def _build(self, args: AttentionArgs, opts, key_dim: int, output_norm: bool, output_gate: bool) -> None:
        if args.n_heads % args.n_kv_heads:
            raise ValueError(f"model.n_heads={args.n_heads} must be a multiple of model.n_kv_heads={args.n_kv_heads}")
        check_impl(args.impl, self.impls, self.mechanism)
        if opts.chunk_size < 1 or opts.chunk_size & (opts.chunk_size - 1):
            raise ValueError(f"attention.{self.mechanism}.chunk_size={opts.chunk_size} must be a power of 2")
        if args.impl == "triton" and opts.chunk_size not in TRITON_CHUNK_SIZES:
            raise ValueError(f"attention.{self.mechanism}.chunk_size={opts.chunk_size} must be one of "
                             f"{list(TRITON_CHUNK_SIZES)} with attention.impl='triton'")
        self.args, self.opts = args, opts
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.key_dim, self.value_dim = key_dim, args.head_dim
        H, HKV, K, V = self.n_heads, self.n_kv_heads, key_dim, args.head_dim
        self.q_proj = nn.Linear(args.dim, H * K, bias=False)
        self.k_proj = nn.Linear(args.dim, HKV * K, bias=False)
        self.v_proj = nn.Linear(args.dim, HKV * V, bias=False)
        self.o_proj = nn.Linear(H * V, args.dim, bias=False)
        self.convs = None
        if opts.use_short_conv:
            self.convs = nn.ModuleDict({n: ShortConvolution(c, opts.conv_size, "silu")
                                        for n, c in (("q", H * K), ("k", HKV * K), ("v", HKV * V))})
        self.out_gate = nn.Linear(args.dim, H * V, bias=False) if output_gate else None
        self.o_norm = GatedRMSNorm(V, eps=args.norm_eps, activation="swish") if output_norm else None

    # ---------------------------------------------------------------------------------- hooks
    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x: [B, T, dim] -> (g [B, T, H] | None, gk [B, T, H, K] | None), log space, float32."""
        raise NotImplementedError

    def feature_map(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def _init_extra(self) -> None:
        pass

    # ---------------------------------------------------------------------------------- contract
    def init_weights(self, init_std: float) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj) + ((self.out_gate,) if self.out_gate is not None else ()):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        trunc_normal_(self.o_proj.weight, mean=0.0, std=init_std)
        if self.convs is not None:
            for c in self.convs.values():
                c.reset_parameters()
        if self.o_norm is not None:
            self.o_norm.reset_parameters()
        self._init_extra()

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> RecurrentCache:
        V = self.value_dim + (1 if self.normalize else 0)
        conv = {n: c.init_state(batch_size, device, dtype) for n, c in self.convs.items()} if self.convs is not None else {}
        state = torch.zeros(batch_size, self.n_heads, self.key_dim, V, device=device, dtype=torch.float32)
        return RecurrentCache(conv=conv, state=state)

    def flops_per_token(self, seq_len: int) -> int:
        # Chunked form per head: q·S and the state update (2·K·V each) plus the intra-chunk QK^T and AV
        # over one chunk (2·C·(K+V)); multiply-add = 2 FLOPs.
        K, V, C = self.key_dim, self.value_dim, min(self.opts.chunk_size, seq_len)
        return 2 * self.n_heads * (2 * K * V + C * (K + V))

    def _project(self, x: torch.Tensor, ctx: AttentionContext):
        cache: RecurrentCache | None = ctx.cache
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.convs is not None:
            outs = []
            for name, t in (("q", q), ("k", k), ("v", v)):
                if ctx.cp is not None:
                    t = self.convs[name].forward_cp(t, ctx)
                elif cache is not None:
                    t, cache.conv[name] = self.convs[name](t, state=cache.conv[name])
                else:
                    t, _ = self.convs[name](t, cu_seqlens=ctx.cu_seqlens)
                outs.append(t)
            q, k, v = outs
        return q, k, v

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.key_dim, self.value_dim
        q, k, v = self._project(x, ctx)
        q, k, v = q.view(B, T, H, K), k.view(B, T, -1, K), v.view(B, T, -1, V)
        q, k = self.feature_map(q, k)
        if self.n_kv_heads != H:  # GQA: each kv head serves H / HKV consecutive query heads
            k, v = (t.repeat_interleave(H // self.n_kv_heads, dim=2) for t in (k, v))
        if self.normalize:  # Katharopoulos: the ones column accumulates the normaliser z_t = Σ φ(k_i)
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        g, gk = self.gates(x)
        o = self._mix(q, k, v, g, gk, ctx)
        if self.normalize:
            o = o[..., :V] / (o[..., V:] + 1e-6)
        gate = self.out_gate(x).view(B, T, H, V) if self.out_gate is not None else None
        if self.o_norm is not None:
            o = self.o_norm(o, gate)
        elif gate is not None:
            o = o * F.silu(gate)
        return self.o_proj(o.reshape(B, T, H * V).to(x.dtype))

    def _mix(self, q, k, v, g, gk, ctx: AttentionContext) -> torch.Tensor:
        """q, k: [B, T, H, K]; v: [B, T, H, V'] -> o [B, T, H, V']."""
        T = q.shape[1]
        impl, C = self.args.impl, self.opts.chunk_size
        cache: RecurrentCache | None = ctx.cache
        if ctx.cp is not None:
            return self._mix_cp(q, k, v, g, gk, ctx)
        if cache is not None:
            o, cache.state = gated_linear_attention(
                q, k, v, g, gk, initial_state=cache.state, output_final_state=True, chunk_size=C,
                impl="reference" if T == 1 else impl)
            cache.seen += T
            return o
        o, _ = gated_linear_attention(q, k, v, g, gk, cu_seqlens=ctx.cu_seqlens, chunk_size=C, impl=impl)
        return o

    def _mix_cp(self, q, k, v, g, gk, ctx: AttentionContext) -> torch.Tensor:
        """Under context parallelism (:mod:`attention.cp`): the state h ← diag(α_t) h + k_t v_tᵀ passed between the
        chunks by :func:`attention.linear_common.linear_recurrence_cp`. Shapes as :meth:`_mix`, T = 2c."""
        B, L = q.shape[:2]
        flat = lambda t: None if t is None else t.reshape(1, B * L, *t.shape[2:])  # noqa: E731

        def run(vv, h, final, cu):
            return gated_linear_attention(flat(q), flat(k), vv, flat(g), flat(gk), initial_state=h,
                                          output_final_state=final, cu_seqlens=cu, chunk_size=self.opts.chunk_size,
                                          impl=self.args.impl)

        return linear_recurrence_cp(run, v, self.key_dim, ctx)


@dataclass
class GLAOptions:
    expand_k: float = field(default=0.5, metadata={"valid": "> 0"})
    """Key head dim = expand_k · head_dim (fla GLA: 0.5); the value head dim is head_dim."""
    gate_low_rank_dim: int = field(default=16, metadata={"valid": ">= 1"})
    """Rank of the forget-gate projection W_2 W_1 (fla: 16)."""
    gate_logit_normalizer: float = field(default=16.0, metadata={"valid": "> 0"})
    """log α = logsigmoid(W_2 W_1 x + b) / gate_logit_normalizer (fla: 16)."""
    gate_clamp_min: float = field(default=0.0, metadata={"valid": "<= 0"})
    """If < 0, clamp log α from below at this value (fla's optional clamp_min); 0 = no clamp."""
    use_short_conv: bool = False
    """Causal depthwise conv + SiLU on q, k, v (fla GLA default: off)."""
    conv_size: int = field(default=4, metadata={"valid": ">= 1"})
    """Kernel size of the short convolutions."""
    output_gate: bool = True
    """Output RMSNorm(o) · swish(W_g x) (fla GLA: on); off leaves the plain per-head RMSNorm."""
    chunk_size: int = field(default=64, metadata={"valid": "a power of 2"})
    """Chunk length of the PyTorch chunked path (a power of 2)."""


@register_attention("gla", options=GLAOptions, description="GLA: linear attention with low-rank per-channel forget gates (Yang et al. 2024)")
class GLAAttention(LinearFamilyAttention):
    """Gated linear attention with column-wise (per key channel) data-dependent decay."""

    impls = tuple(i for i in IMPLS if i != "triton")  # the Triton kernel's gates are per head, not per channel

    def __init__(self, args: AttentionArgs, opts: GLAOptions):
        super().__init__()
        key_dim = int(args.head_dim * opts.expand_k)
        if key_dim < 1:
            raise ValueError(f"attention.gla.expand_k={opts.expand_k} gives an empty key dim for head_dim={args.head_dim}")
        self._build(args, opts, key_dim, output_norm=True, output_gate=opts.output_gate)
        self.gk_proj = nn.Sequential(nn.Linear(args.dim, opts.gate_low_rank_dim, bias=False),
                                     nn.Linear(opts.gate_low_rank_dim, self.n_heads * key_dim, bias=True))
        self.param_roles = {"gk_proj": "vector"}  # low-rank gate: not hidden matrices (optim.groups)

    def _init_extra(self) -> None:
        trunc_normal_(self.gk_proj[0].weight, mean=0.0, std=0.02)
        trunc_normal_(self.gk_proj[1].weight, mean=0.0, std=0.02)
        nn.init.zeros_(self.gk_proj[1].bias)

    def gates(self, x):
        B, T, _ = x.shape
        gk = F.logsigmoid(self.gk_proj(x).float()) / self.opts.gate_logit_normalizer
        if self.opts.gate_clamp_min < 0:
            gk = gk.clamp_min(self.opts.gate_clamp_min)
        return None, gk.view(B, T, self.n_heads, self.key_dim)
