"""Softmax attention, Qwen3 style: q/k RMSNorm before RoPE, GQA, optional sliding window.

Parameter names follow torchtitan's Qwen3 (``wq wk wv wo q_norm k_norm``) so its Hugging Face state-dict
adapter applies unchanged. Kernels (``[attention] impl``):

- "auto": the fastest path measured for the call (``benchmarks/bench_softmax_paths.py``). Packed documents on
  CUDA take the project's Triton kernel, GQA native, where it takes the head dim (faster than torch's
  ``varlen_attn``, FlashAttention-2 with the KV heads repeated: benchmarks/README.md), else ``varlen_attn`` (both
  fp16/bf16); plain causal batches take torch's SDPA (cuDNN/flash); on CPU, and for float32
  (e.g. ``attnlab/tools/analyze.py``), a boolean-masked SDPA (exact, O(T²) memory). torch's paths have no
  word of their own in the ``impl`` vocabulary (``attention.ops.common.IMPLS``); Parallax (a probe) resolves "auto"
  per ``attention.ops.parallax``; under context parallelism "auto" is the "triton" kernel on CUDA
  (:func:`attend_chunks`);
- "reference": the PyTorch oracle ``naive_parallax`` (float32, float64 for float64 inputs);
- "triton": the project's streaming kernel (``attnlab/attention/ops/parallax``, probe off).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnlab.attention.base import AttentionArgs, AttentionContext, QKVAttentionBase, causal_pairs
from attnlab.attention.ops.common import check_impl, visibility_mask
from attnlab.attention.ops.parallax import parallax_attention, parallax_decode, resolve_impl
from attnlab.attention.registry import register_attention

SOFTMAX_IMPLS = ("auto", "reference", "triton")


@dataclass
class SoftmaxOptions:
    window_size: int = field(default=0, metadata={"valid": ">= 0"})
    """Sliding-window size in tokens (each query sees this many most recent keys); 0 = full causal."""
    qk_norm: bool = True
    """RMSNorm on q and k per head before RoPE (Qwen3)."""


def _sdpa(q, k, v, ctx: AttentionContext, window: int | None, scale: float) -> torch.Tensor:
    """q: [B, T, HQ, D]; k, v: [B, T, HKV, D] -> [B, T, HQ, D]."""
    B, T, HQ, D = q.shape
    gqa = HQ != k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if ctx.cu_seqlens is None and not window:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = visibility_mask(B, T, q.device, ctx.cu_seqlens, window)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)


_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # varlen_attn's flash kernel; float32 takes the masked SDPA


@functools.cache
def _varlen_params() -> frozenset:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen(q, k, v, ctx: AttentionContext, window: int | None, scale: float) -> torch.Tensor:
    """Packed documents on CUDA through torch's flash varlen kernel (``varlen_attn``), causal within each
    document: q [B, T, HQ, D], k and v [B, T, HKV, D] -> [B, T, HQ, D]."""
    from torch.nn.attention.varlen import varlen_attn

    B, T, HQ, D = q.shape
    q, k, v = (t.reshape(B * T, t.shape[2], D) for t in (q, k, v))
    cu = ctx.cu_seqlens.to(torch.int32)
    params = _varlen_params()
    if "window_size" in params:  # (left, right): (-1, 0) is causal; varlen_attn is NOT causal by default
        kw = {"window_size": (window - 1 if window else -1, 0)}
    else:  # older signature (torch 2.11): a causal flag, no window (``mix`` routes windows elsewhere)
        kw = {"is_causal": True}
    if HQ != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # torch 2.11's varlen_attn has no GQA: repeat the kv heads
            k, v = (t.repeat_interleave(HQ // k.shape[1], dim=1) for t in (k, v))
    o = varlen_attn(q, k, v, cu, cu, ctx.max_seqlen, ctx.max_seqlen, scale=scale, **kw)
    return o.view(B, T, HQ, D)


def attend_chunks(q, k, v, r, ctx: AttentionContext, window: int | None, scale: float, impl: str) -> torch.Tensor:
    """This rank's queries over the whole row's keys under context parallelism. q, r: [B, 2c, HQ, D], the rank's two
    chunks of c tokens per row; k, v: [B, T, HKV, D], the row in global order. Each chunk's queries attend over the
    row's keys up to the chunk's end as variable-length segments, the queries aligned at the end of their keys
    (:meth:`attention.cp.ContextParallel.segments`), through ``parallax_attention`` ("auto": the project's Triton
    kernels on CUDA, the reference on CPU), softmax included: on an H100 its GQA-aware Triton kernel trains softmax
    under CP faster than torch's flash varlen (FA2, which in torch 2.11 also needs the KV heads repeated; numbers in
    benchmarks/README.md). Returns [B, 2c, HQ, D]."""
    B, c = q.shape[0], q.shape[1] // 2
    out = []
    for half in (0, 1):
        seg = ctx.cp_segments.segments(half)
        qh, rh = (None if t is None else t[:, half * c:(half + 1) * c].reshape(B * c, *t.shape[2:]) for t in (q, r))
        kh, vh = (t[:, :seg.keys].reshape(B * seg.keys, *t.shape[2:]) for t in (k, v))
        o = parallax_attention(qh[None], kh[None], vh[None], None if rh is None else rh[None], scale=scale,
                               cu_seqlens=seg.cu_q, max_seqlen=seg.max_q, cu_seqlens_k=seg.cu_k,
                               max_seqlen_k=seg.max_k, window_size=window, impl=impl)
        out.append(o.view(B, c, *o.shape[-2:]))
    return torch.cat(out, 1)


@dataclass
class KVCache:
    """Fixed-shape decode cache of one softmax/Parallax layer.

    k, v:    [B, L, HKV, D] keys (RoPE applied) and values; slots at or beyond ``seqlens[b]`` are unused.
    seqlens: [B] int32 tokens cached per sequence (rows may differ; updated in place, no host sync).
    """

    k: torch.Tensor
    v: torch.Tensor
    seqlens: torch.Tensor


@register_attention("softmax", options=SoftmaxOptions, description="softmax attention (SDPA / varlen / Triton), the Qwen3 baseline")
class SoftmaxAttention(QKVAttentionBase):
    """Multi-head causal softmax attention with GQA, q/k RMSNorm and RoPE."""

    impls = SOFTMAX_IMPLS
    """``[attention] impl`` values this mechanism accepts (``--list-attention`` prints them)."""
    context_parallel = True
    """Runs under context parallelism (:meth:`mix_cp`)."""
    context_parallel_compiles = True
    """Its CP path compiles (``compile.enable``) into the blocks' single graphs (docs/context_parallel.md)."""

    def __init__(self, args: AttentionArgs, opts: SoftmaxOptions):
        check_impl(args.impl, self.impls, self.mechanism)
        super().__init__(args, opts.qk_norm)
        self.opts = opts
        self.scale = args.head_dim**-0.5

    def mix(self, q, k, v, r, ctx: AttentionContext) -> torch.Tensor:
        """Token mixing: [B, T, HQ, D]. ``r`` is the probe (None for softmax)."""
        window = self.opts.window_size or None
        impl = self.args.impl
        if ctx.cp is not None:
            return self.mix_cp(q, k, v, r, ctx, window)
        if r is None and impl == "auto":
            if q.is_cuda and ctx.cu_seqlens is not None and q.dtype in _FLASH_DTYPES:
                # the Triton kernel below where it takes the head dim; torch's varlen_attn otherwise
                if resolve_impl(impl, q) != "triton" and (not window or "window_size" in _varlen_params()):
                    return _varlen(q, k, v, ctx, window, self.scale)
            else:
                return _sdpa(q, k, v, ctx, window, self.scale)
        return parallax_attention(q, k, v, r, scale=self.scale, cu_seqlens=ctx.cu_seqlens, max_seqlen=ctx.max_seqlen,
                                  window_size=window, impl=impl)

    def mix_cp(self, q, k, v, r, ctx: AttentionContext, window: int | None) -> torch.Tensor:
        """Context parallelism (:mod:`attention.cp`): the keys and values of the whole row, all-gathered from the
        CP group ([B, T, HKV, D]), under this rank's queries (:func:`attend_chunks`)."""
        return attend_chunks(q, ctx.cp.gather(k), ctx.cp.gather(v), r, ctx, window, self.scale, self.args.impl)

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> KVCache:
        """Empty cache for ``max_len`` tokens per sequence: k, v [B, max_len, HKV, D], seqlens [B] = 0."""
        kv = lambda: torch.zeros(batch_size, max_len, self.n_kv_heads, self.head_dim, device=device, dtype=dtype)  # noqa: E731
        return KVCache(kv(), kv(), torch.zeros(batch_size, device=device, dtype=torch.int32))

    def decode(self, q, k, v, r, cache: KVCache) -> torch.Tensor:
        """Append the T new keys/values of every row at its ``seqlens`` and attend over the cache.
        q, r: [B, T, HQ, D]; k, v: [B, T, HKV, D] -> [B, T, HQ, D]. The caller keeps seqlens + T ≤ L."""
        B, T = q.shape[:2]
        slot = cache.seqlens.to(torch.int64)[:, None] + torch.arange(T, device=q.device)  # [B, T]
        row = torch.arange(B, device=q.device)[:, None].expand(B, T)  # [B, T]
        cache.k[row, slot] = k.to(cache.k.dtype)
        cache.v[row, slot] = v.to(cache.v.dtype)
        cache.seqlens += T
        o = parallax_decode(q.to(cache.k.dtype), cache.k, cache.v, cache.seqlens,
                            None if r is None else r.to(cache.k.dtype), scale=self.scale,
                            window_size=self.opts.window_size or None, impl=self.args.impl)
        return o.to(q.dtype)

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """x: [B, T, dim] -> [B, T, dim]. With ``ctx.cache`` (a :class:`KVCache`): T new tokens per row at
        absolute ``ctx.positions``, appended to the cache; ρ (Parallax) comes from the new tokens."""
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, ctx)
        r = self.probe(x, ctx)
        if ctx.cache is not None:
            o = self.decode(q, k, v, r, ctx.cache)
        else:
            o = self.mix(q, k, v, r, ctx)
        return self.wo(o.reshape(B, T, -1))

    def probe(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor | None:
        return None

    def flops_per_token(self, seq_len: int) -> int:
        # q·k and p·v, 2 FLOPs per multiply-add, over the keys the causal (sliding-window) mask leaves: (seq_len+1)/2
        # per query on average without a window. Not torchtitan's count, which takes every query over all seq_len.
        return 2 * 2 * self.n_heads * self.head_dim * causal_pairs(seq_len, self.opts.window_size) // seq_len
