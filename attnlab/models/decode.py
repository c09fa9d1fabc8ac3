"""Model-level incremental decoding: per-layer caches, prefill + one-token steps, sampling.

Every layer's attention module builds its own cache through ``init_cache(batch_size, max_len, device, dtype)``
(softmax/Parallax: a fixed-shape KV cache with per-sequence lengths; the linear family: recurrent states).
A forward over new tokens sets ``ctx.cache`` to the layer's cache and ``ctx.positions`` to absolute positions,
so each module reads and updates its cache in place. All rows of a batch advance together here (prompts of one
length); the KV cache itself supports rows of different lengths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from attnlab.attention.base import AttentionContext
from attnlab.models.model import Transformer


@dataclass
class DecodeState:
    """caches: one per layer; pos: tokens consumed so far (same for every row); max_len: cache capacity."""

    caches: list
    pos: int
    max_len: int


def init_caches(model: Transformer, batch_size: int, max_len: int, device=None, dtype=None) -> DecodeState:
    """One cache per layer; fails naming the mechanism when a layer cannot decode incrementally."""
    p = next(model.parameters())
    device, dtype = device or p.device, dtype or p.dtype
    caches = []
    for i, layer in model.layers.items():
        attn = layer.attention
        if not hasattr(attn, "init_cache"):
            raise ValueError(f"layer {i}: attention {type(attn).__name__} has no init_cache; it cannot decode with a cache")
        caches.append(attn.init_cache(batch_size, max_len, device, dtype))
    return DecodeState(caches, 0, max_len)


@torch.no_grad()
def forward_cached(model: Transformer, tokens: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """tokens: [B, T] new tokens -> logits [B, T, vocab]; appends them to every layer's cache."""
    B, T = tokens.shape
    if state.pos + T > state.max_len:
        raise ValueError(f"decode cache holds {state.max_len} tokens; {state.pos} used, {T} more requested")
    positions = torch.arange(state.pos, state.pos + T, device=tokens.device).expand(B, T)
    ctx = AttentionContext(positions=positions, rope_theta=model.model_args.rope_theta, max_position=state.pos + T)
    model.fill_rope(ctx, state.max_len, tokens.device)  # the cached table, not one of pos + T rows per step
    h = model.tok_embeddings(tokens)
    for layer, cache in zip(model.layers.values(), state.caches):
        ctx.cache = cache
        h = layer(h, ctx)
    state.pos += T
    return model.output(model.norm(h))


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           greedy: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, V] -> next tokens [B]. Greedy (or temperature 0) takes the argmax; otherwise temperature,
    then top-k, then nucleus (top-p) filtering, then a multinomial draw."""
    if greedy or temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, prompt + new]
    new_tokens: int
    prefill_s: float
    decode_s: float
    step_logits: list = field(default_factory=list)  # [B, V] per generated token when keep_logits

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of decoding (all rows, prefill excluded)."""
        n = self.tokens.shape[0] * max(self.new_tokens - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else float("nan")


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, greedy: bool = False, eos_id: int | None = None,
             generator: torch.Generator | None = None, keep_logits: bool = False,
             cache_dtype: torch.dtype | None = None) -> GenerationResult:
    """prompt: [B, T0] -> tokens [B, T0 + n]: one prefill over the prompt, then one cached step per token.
    Stops early when every row has produced ``eos_id``."""
    B, T0 = prompt.shape
    state = init_caches(model, B, T0 + max_new_tokens, prompt.device, cache_dtype)
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    t0 = time.perf_counter()
    logits = forward_cached(model, prompt, state)[:, -1]
    sync()
    t1 = time.perf_counter()
    out, kept, done = [prompt], [], torch.zeros(B, dtype=torch.bool, device=prompt.device)
    for i in range(max_new_tokens):
        if keep_logits:
            kept.append(logits.float().clone())
        nxt = sample(logits, temperature, top_k, top_p, greedy, generator)
        out.append(nxt[:, None])
        if eos_id is not None:
            done |= nxt == eos_id
            if bool(done.all()):
                break
        if i + 1 < max_new_tokens:
            logits = forward_cached(model, nxt[:, None], state)[:, -1]
    sync()
    t2 = time.perf_counter()
    return GenerationResult(torch.cat(out, 1), len(out) - 1, t1 - t0, t2 - t1, kept)
