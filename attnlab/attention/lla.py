"""Local Linear Attention (Zuo et al., ICLR 2026, arXiv 2510.01450): softmax attention upgraded from a
local-constant to a local-linear (affine) kernel regression at each query (docs/mechanisms.md, "LLA").

Departures from the softmax baseline (same Qwen3 projections ``wq wk wv wo q_norm k_norm``, GQA, RoPE):

- the output is the intercept of a kernel-weighted ridge regression of v on k − q_i (eq. 8), with ρ_i
  solved per query by ``cg_iters`` conjugate-gradient steps (optionally Jacobi-preconditioned);
- a ridge λ, learnable per head or per token (λ_i = λ_min + (λ_max − λ_min)·σ(W_λ x_i), paper eq. 27
  with a floor), in the λω convention of the public FlashLLA code (shift-invariant);
- λ → ∞ is exactly softmax attention.

Kernels (``[attention] impl``): "auto" (Triton on CUDA, else the blockwise PyTorch path), "reference", "chunk",
"triton". Decoding keeps a KV cache (LLA has no recurrent state) and uses a single-pass D×D-accumulator decode
(``attnlab/attention/ops/lla/recurrent.py``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attnlab.attention.base import AttentionArgs, AttentionContext, QKVAttentionBase, causal_pairs, mix_whole_rows
from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.lla import IMPLS as LLA_IMPLS
from attnlab.attention.ops.lla import lla_attention, lla_decode
from attnlab.attention.registry import register_attention

LAMBDA_MODES = ("head", "token")


@dataclass
class LLAOptions:
    cg_iters: int = field(default=16, metadata={"valid": ">= 1"})
    """CG iterations for ρ (and for the adjoint solve in the backward); the paper finds 16 enough in bf16."""
    jacobi: bool = False
    """Jacobi (diagonal) preconditioner for CG."""
    lambda_mode: str = field(default="head", metadata={"valid": "one of head, token"})
    """Ridge λ per head ("head", one learnable scalar each) or per token and head from x ("token", eq. 27)."""
    lambda_init: float = field(default=0.3, metadata={"valid": "> 0"})
    """Initial λ (λω convention: relative to the normalised softmax weights)."""
    lambda_min: float = field(default=0.1, metadata={"valid": ">= 0"})
    """Floor of λ. With RMS-normed q, k at D=128 truncated CG is only trustworthy for λ ≳ 0.1 at 16 iterations
    (≳ 0.05 at 32): the backward differentiates the converged solve, so below that the gradients grow without
    bound on short documents. Lower floors need more ``cg_iters``."""
    lambda_max: float = field(default=1.0, metadata={"valid": "> 0"})
    """Ceiling of λ: λ = λ_min + (λ_max − λ_min)·sigmoid(·) (the paper's sigmoid gives (0, 1))."""
    learn_lambda: bool = True
    """Learn λ; False keeps λ = lambda_init (the paper's fixed-λ ablation)."""
    cg_rtol: float = field(default=1e-6, metadata={"valid": "> 0"})
    """A row's CG stops once ‖residual‖ ≤ cg_rtol·‖rhs‖."""
    qk_norm: bool = True
    """RMSNorm on q and k per head before RoPE (the paper's best pretraining setting)."""


class RidgeLambda(nn.Module):
    """λ = lo + (hi − lo)·sigmoid(θ): θ per head ([HQ]) or θ = W_λ x + b per token ([B, T, HQ])."""

    def __init__(self, dim: int, n_heads: int, mode: str, init: float, lo: float, hi: float, learn: bool, key: str):
        super().__init__()
        if mode not in LAMBDA_MODES:
            raise ValueError(f"{key}.lambda_mode={mode!r}; choose from {list(LAMBDA_MODES)}")
        if not 0 <= lo < init < hi:
            raise ValueError(f"{key}: need 0 <= lambda_min < lambda_init < lambda_max, got {lo}, {init}, {hi}")
        self.mode, self.lo, self.hi, self.init = mode, lo, hi, init
        if mode == "token" and learn:
            self.lam_proj = nn.Linear(dim, n_heads, bias=True)
        elif learn:
            self.lam_logit = nn.Parameter(torch.empty(n_heads))
        else:
            self.register_buffer("lam_logit", torch.empty(n_heads))

    def init_weights(self) -> None:
        f = (self.init - self.lo) / (self.hi - self.lo)
        logit = math.log(f / (1 - f))
        if hasattr(self, "lam_proj"):
            trunc_normal_(self.lam_proj.weight, mean=0.0, std=0.02)
            nn.init.constant_(self.lam_proj.bias, logit)
        else:
            self.lam_logit.fill_(logit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, dim] -> λ: [HQ] or [B, T, HQ], float32."""
        theta = self.lam_proj(x).float() if hasattr(self, "lam_proj") else self.lam_logit.float()
        return self.lo + (self.hi - self.lo) * torch.sigmoid(theta)


@dataclass
class KVCache:
    """Decode cache: k, v [B, max_len, HKV, D] (post-RoPE) and the number of filled positions."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0


@register_attention("lla", options=LLAOptions, description="Local Linear Attention: local affine kernel regression, ρ by CG (Triton fwd/bwd)")
class LocalLinearAttention(QKVAttentionBase):
    """Causal LLA with GQA, q/k RMSNorm, RoPE and a learnable ridge λ (per head or per token)."""

    impls = LLA_IMPLS
    """``[attention] impl`` values this mechanism accepts (``--list-attention`` prints them)."""
    context_parallel = True
    """Runs under context parallelism: q, k, v (and a per-token λ) all-gathered, the whole rows attended
    (:func:`attention.base.mix_whole_rows`)."""
    context_parallel_compiles = True
    """Compiled CP matches eager CP (docs/context_parallel.md, "Compiling")."""

    def __init__(self, args: AttentionArgs, opts: LLAOptions):
        super().__init__(args, opts.qk_norm)
        check_impl(args.impl, self.impls, "lla")
        if opts.cg_iters < 1:
            raise ValueError(f"attention.lla.cg_iters={opts.cg_iters} must be >= 1")
        smallest = opts.lambda_min if opts.learn_lambda else opts.lambda_init  # fixed λ = lambda_init
        if smallest < (0.1 if opts.cg_iters < 32 else 0.05):
            warnings.warn(f"attention.lla: λ down to {smallest} with cg_iters={opts.cg_iters}: truncated CG "
                          "makes the LLA gradients unreliable below λ ≈ 0.1 at 16 iterations (≈ 0.05 at 32); see "
                          "LLAOptions.lambda_min", stacklevel=2)
        self.opts = opts
        self.ridge = RidgeLambda(args.dim, args.n_heads, opts.lambda_mode, opts.lambda_init, opts.lambda_min,
                                 opts.lambda_max, opts.learn_lambda, "attention.lla")

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        self.ridge.init_weights()

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, ctx)
        lam = self.ridge(x)
        kw = dict(cg_iters=self.opts.cg_iters, jacobi=self.opts.jacobi, rtol=self.opts.cg_rtol)
        if ctx.cache is not None:
            o = self._decode(q, k, v, lam, ctx.cache, kw)
        elif ctx.cp is not None:
            per_token = lam if lam.dim() == 3 else None
            o = mix_whole_rows(ctx, lambda q, k, v, lt, cu_seqlens: lla_attention(
                q, k, v, lam if lt is None else lt, cu_seqlens=cu_seqlens, impl=self.args.impl, **kw),
                q, k, v, per_token)
        else:
            o = lla_attention(q, k, v, lam, cu_seqlens=ctx.cu_seqlens, impl=self.args.impl, **kw)
        return self.wo(o.reshape(B, T, -1))

    def _decode(self, q, k, v, lam, cache: KVCache, kw) -> torch.Tensor:
        """Append the new tokens to the cache; an empty cache with T > 1 is a prefill (training path),
        otherwise one single-pass decode per new token."""
        B, T = q.shape[:2]
        p0 = cache.length
        cache.k[:, p0:p0 + T] = k.to(cache.k.dtype)
        cache.v[:, p0:p0 + T] = v.to(cache.v.dtype)
        cache.length = p0 + T
        if p0 == 0 and T > 1:
            impl = "chunk" if self.args.impl == "reference" else self.args.impl
            return lla_attention(q, k, v, lam, impl=impl, **kw)
        lam = lam.expand(B, T, self.n_heads) if lam.dim() == 3 else lam.view(1, 1, -1).expand(B, T, -1)
        outs = [lla_decode(q[:, t], cache.k[:, :p0 + t + 1], cache.v[:, :p0 + t + 1], lam[:, t], **kw)
                for t in range(T)]
        return torch.stack(outs, 1)

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> KVCache:
        shape = (batch_size, max_len, self.n_kv_heads, self.head_dim)
        return KVCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    def flops_per_token(self, seq_len: int) -> int:
        # Key-tile GEMMs per (query, key) pair the causal mask keeps (the kernels skip masked tiles), softmax's
        # being 2: statistics 2 (+1 Jacobi), 3 per CG iteration (q·k recomputed, p·k, (w⊙pk)·k), output 3 (q·k,
        # ρ·k, s·v).
        gemms = 5 + 3 * self.opts.cg_iters + (1 if self.opts.jacobi else 0)
        return 2 * gemms * self.n_heads * self.head_dim * causal_pairs(seq_len) // seq_len
