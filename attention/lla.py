"""Local Linear Attention (Zuo et al., ICLR 2026, arXiv 2510.01450): softmax attention upgraded from a
local-constant to a local-linear (affine) kernel regression at each query (spec ``lla.md``).

Departures from the softmax baseline (same Qwen3 projections ``wq wk wv wo q_norm k_norm``, GQA, RoPE):

- the output is the intercept of a kernel-weighted ridge regression of v on k − q_i (eq. 8), with ρ_i
  solved per query by ``cg_iters`` conjugate-gradient steps (optionally Jacobi-preconditioned);
- a ridge λ, learnable per head or per token (λ_i = λ_min + (λ_max − λ_min)·σ(W_λ x_i), paper eq. 27
  with a floor), in the λω convention of the public FlashLLA code (shift-invariant, spec §5.3);
- λ → ∞ is exactly softmax attention.

Kernels (``[attention] impl``): "auto" (Triton on CUDA, else the blockwise PyTorch path), "triton",
"chunked", "reference"; ``[attention.lla] kernel`` picks the Triton version ("v0", "v1", "v2"). Decoding keeps a
KV cache (LLA has no recurrent state) and uses the single-pass D×D-accumulator decode of spec §8.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan.models.utils import trunc_normal_

from attention.base import AttentionArgs, AttentionContext, QKVAttentionBase
from attention.ops.lla import DEFAULT_KERNEL, check_kernel
from attention.ops.lla import IMPLS as LLA_IMPLS
from attention.ops.lla import lla_attention, lla_decode
from attention.registry import register_attention

LAMBDA_MODES = ("head", "token")


@dataclass
class LLAOptions:
    cg_iters: int = 16
    """CG iterations for ρ (and for the adjoint solve in the backward); the paper finds 16 enough in bf16."""
    jacobi: bool = False
    """Jacobi (diagonal) preconditioner for CG."""
    lambda_mode: str = "head"
    """Ridge λ per head ("head", one learnable scalar each) or per token and head from x ("token", eq. 27)."""
    lambda_init: float = 0.3
    """Initial λ (λω convention: relative to the normalised softmax weights)."""
    lambda_min: float = 0.1
    """Floor of λ. With RMS-normed q, k at D=128 truncated CG is only trustworthy for λ ≳ 0.1 at 16 iterations
    (≳ 0.05 at 32): the backward differentiates the converged solve, and fp32 dk came out 1.25× / 4× / 21× the
    exact norm at λ = 0.1 / 0.05 / 0.02 with 16 iterations (T=384, short documents); with a floor of 1e-3 the
    0.6B config's gradient norm was 1.7e14 in the first step on an H100. Lower floors need more ``cg_iters``."""
    lambda_max: float = 1.0
    """Ceiling of λ: λ = λ_min + (λ_max − λ_min)·sigmoid(·) (the paper's sigmoid gives (0, 1))."""
    learn_lambda: bool = True
    """Learn λ; False keeps λ = lambda_init (the paper's fixed-λ ablation)."""
    cg_rtol: float = 1e-6
    """A row's CG stops once ‖residual‖ ≤ cg_rtol·‖rhs‖."""
    qk_norm: bool = True
    """RMSNorm on q and k per head before RoPE (the paper's best pretraining setting)."""
    kernel: str = DEFAULT_KERNEL
    """Which Triton kernels impl "triton" / "auto" on CUDA runs (the chunked and reference paths ignore it):
    "v0" (``attention/ops/lla/triton_v0.py``: fp32/TF32 tiles) is the more accurate (bf16, D = 128: dk 6.6e-3
    vs 2.2e-2); "v1" (``triton.py``: bf16 tensor-core operands, autotuned tiles) is 3.8x faster fwd+bwd on an
    H100 at equal forward error in the truncated-CG regime. Measured on an H100 (session 8, torch 2.11,
    Triton 3.6):

    - ``scripts/bench_lla.py --quick --variant v0,v1 --tiles none`` (B4 T4096 H16/8 D128 bf16, λ = 0.1, 8 CG):
      ms fwd / fwd+bwd SDPA 0.49 / 2.01, v0 73.3 / 226.4 (112x SDPA), v1 21.6 / 59.3 (29x); o vs the exact
      float64 solve (all rows / rows ≥ 2D) v0 0.283 / 0.050, v1 0.295 / 0.051. Truncated CG dominates both.
    - ``test_triton_gpu_matches_chunked`` (λ = 1, T = 1000, GQA, varlen, 16 CG, D = 128) vs float64, bf16:
      v0 o 5.6e-3, dq 6.6e-3, dk 6.6e-3, dv 6.2e-3, dλ 2.3e-2; v1 o 6.4e-3, dq 1.0e-2, dk 2.2e-2, dv 1.5e-2,
      dλ 2.9e-2, within the bf16 budgets of the Triton attention kernels (test_parallax_kernels: 2e-2 forward,
      4e-2 gradients). fp32 inputs: v1 (32-row tiles) o 1.5e-3, dλ 1.3e-2; v0 (TF32) o 5.8e-3, dλ 3.7e-2.

    v1 was opt-in because its bf16 roundings were amplified by Σ|a|/δ on ill-conditioned rows; CG on the
    k̄-centred Σ_c (``naive.from_centred``) removed the 1/δ from the output pass. It is the default since a
    GPU training smoke (0.6B LLA config, 20 steps, H100): loss 6.53 at step 20 with v1 (v0: 6.49),
    5,277 tok/s (v0: 1,905).

    "v2" (``triton_v2.py``, the default since session 11) runs v1's math with one launch per CG iteration and
    the CG state in global memory, so no key loop carries it in registers, and a new dk/dv kernel (bench as
    above plus ``--variant v1,v2``, H100, one run): v1 21.76 / 59.82 ms (29.8x SDPA), v2 11.86 / 29.50 ms (14.7x),
    same forward error;
    peak memory 1.5 -> 2.1 GiB. Since session 14 its CG steps keep a history of the directions and form x once in
    the last step: 27.7 ms (13.6x) against 29.6-30.2 in the same run, peak memory +0.45-0.48 GiB. Session 17 (a
    two-product last step, two passes' products before their exponentials): 26.3 ms (12.9x SDPA). Switching back
    is ``attention.lla.kernel = "v1"`` (or "v0"), or
    ``attention.ops.lla.DEFAULT_KERNEL``."""


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

    def __init__(self, args: AttentionArgs, opts: LLAOptions):
        super().__init__(args, opts.qk_norm)
        if args.impl not in LLA_IMPLS:
            raise ValueError(f"attention.impl={args.impl!r} is not valid for lla; choose from {list(LLA_IMPLS)}")
        if opts.cg_iters < 1:
            raise ValueError(f"attention.lla.cg_iters={opts.cg_iters} must be >= 1")
        check_kernel(opts.kernel)  # at construction: a bad config fails before training
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
        else:
            o = lla_attention(q, k, v, lam, cu_seqlens=ctx.cu_seqlens, impl=self.args.impl, kernel=self.opts.kernel,
                              **kw)
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
            impl = "chunked" if self.args.impl == "reference" else self.args.impl
            return lla_attention(q, k, v, lam, impl=impl, kernel=self.opts.kernel, **kw)
        lam = lam.expand(B, T, self.n_heads) if lam.dim() == 3 else lam.view(1, 1, -1).expand(B, T, -1)
        outs = [lla_decode(q[:, t], cache.k[:, :p0 + t + 1], cache.v[:, :p0 + t + 1], lam[:, t], **kw)
                for t in range(T)]
        return torch.stack(outs, 1)

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> KVCache:
        shape = (batch_size, max_len, self.n_kv_heads, self.head_dim)
        return KVCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    def flops_per_token(self, seq_len: int) -> int:
        # Key-tile GEMMs per query (non-causal count like softmax's 2): statistics 2 (+1 Jacobi),
        # 3 per CG iteration (q·k recomputed, p·k, (w⊙pk)·k), output 3 (q·k, ρ·k, s·v).
        gemms = 5 + 3 * self.opts.cg_iters + (1 if self.opts.jacobi else 0)
        return 2 * gemms * self.n_heads * self.head_dim * seq_len
