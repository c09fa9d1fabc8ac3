"""attnlab's Qwen3-style decoder as a ``transformers`` model, in plain PyTorch: softmax and Parallax attention.

    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

Each layer: ``h = h + Attn(RMSNorm(h))``, ``h = h + MLP(RMSNorm(h))`` with a SwiGLU MLP
``down(silu(gate(x)) * up(x))``. Attention (per head, GQA: query head h reads key/value head h // (HQ/HKV)):

    q_i = RoPE(RMSNorm(W_Q x_i)),  k_j = RoPE(RMSNorm(W_K x_j)),  v_j = W_V x_j    (RMSNorm if qk_norm)
    p_ij = softmax_j(q_i·k_j / sqrt(D))   over visible keys j (causal, and i - j < window when set)
    softmax:  o_i = Σ_j p_ij v_j
    Parallax: ρ_i = RMSNorm(W_R x_i) [· σ(w_g·x_i + b_g) if rho_gate] [RoPE'd if rope_on_rho]
              t_ij = ρ_i·k_j,  t̄_i = Σ_j p_ij t_ij
              o_i = Σ_j p_ij (1 + t̄_i − t_ij) v_j  = v̄_i − Σ_KV(i) ρ_i   (Zuo et al., 2026, eq. 8)

RoPE uses the half-rotation layout (``rotate_half``) with base ``rope_theta``. No KV cache: ``generate`` re-runs
the whole prefix each step (correct, slower). ``attention_mask`` (1 = token, 0 = padding) hides padded keys and
numbers positions from each row's first token, so left-padded batches give each row's unpadded result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_attnlab import AttnLabConfig

SUPPORTED = ("softmax", "parallax")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, 1, head_dim] (float32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos()[:, :, None], angles.sin()[:, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]."""
    return (x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)).type_as(x)


class Attention(nn.Module):
    """Softmax attention, or Parallax when ``parallax`` (extra parameters r_proj, r_norm, optional r_gate)."""

    def __init__(self, arch: dict, mechanism: str, opts: dict):
        super().__init__()
        dim, self.n_heads, self.n_kv_heads, self.head_dim = arch["dim"], arch["n_heads"], arch["n_kv_heads"], arch["head_dim"]
        eps = arch["norm_eps"]
        self.window = opts.get("window_size", 0) or 0
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        qk_norm = opts.get("qk_norm", True)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=eps) if qk_norm else None
        self.parallax = mechanism == "parallax"
        if self.parallax:
            self.rope_on_rho = opts.get("rope_on_rho", True)
            self.r_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
            self.r_norm = nn.RMSNorm(self.head_dim, eps=eps)
            self.r_gate = nn.Linear(dim, self.n_heads, bias=True) if opts.get("rho_gate", False) else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim]; visible [B, 1, T, T] bool (key j visible from query i) -> [B, T, dim]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.n_heads // self.n_kv_heads
        q = q.transpose(1, 2)  # [B, HQ, T, D]
        k = k.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, HQ, T, D]
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5  # [B, HQ, T, T]
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        if self.parallax:
            rho = self.r_norm(self.r_proj(x).view(B, T, self.n_heads, self.head_dim))
            if self.r_gate is not None:
                rho = rho * torch.sigmoid(self.r_gate(x)).unsqueeze(-1)
            if self.rope_on_rho:
                rho = apply_rope(rho, cos, sin)
            t = rho.transpose(1, 2) @ k.transpose(-1, -2)  # [B, HQ, T, T], t_ij = ρ_i·k_j
            t_bar = (p * t).sum(-1, keepdim=True)
            p = p * (1 + t_bar - t)
        o = (p @ v).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: dict, mechanism: str):
        super().__init__()
        self.self_attn = Attention(arch, mechanism, arch.get("attention_options", {}).get(mechanism, {}))
        self.mlp = MLP(arch["dim"], arch["hidden_dim"])
        self.input_layernorm = nn.RMSNorm(arch["dim"], eps=arch["norm_eps"])
        self.post_attention_layernorm = nn.RMSNorm(arch["dim"], eps=arch["norm_eps"])

    def forward(self, h, cos, sin, visible):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, visible)
        return h + self.mlp(self.post_attention_layernorm(h))


class AttnLabPreTrainedModel(PreTrainedModel):
    config_class = AttnLabConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def _init_weights(self, module):  # weights always come from the checkpoint
        pass


class AttnLabModel(AttnLabPreTrainedModel):
    def __init__(self, config: AttnLabConfig):
        super().__init__(config)
        arch = config.attnlab
        mechanisms = arch["layer_pattern"]
        unsupported = sorted(set(mechanisms) - set(SUPPORTED))
        if unsupported:
            raise ValueError(f"this remote-code model implements {list(SUPPORTED)}; the checkpoint uses {unsupported}")
        self.head_dim, self.rope_theta = arch["head_dim"], arch["rope_theta"]
        self.embed_tokens = nn.Embedding(arch["vocab_size"], arch["dim"])
        self.layers = nn.ModuleList(DecoderLayer(arch, m) for m in mechanisms)
        self.norm = nn.RMSNorm(arch["dim"], eps=arch["norm_eps"])
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final hidden states [B, T, dim]."""
        B, T = input_ids.shape
        i = torch.arange(T, device=input_ids.device)
        visible = i[:, None] >= i[None, :]  # causal [T, T]
        if attention_mask is None:
            positions = i.expand(B, T)
            key_ok = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
        else:
            key_ok = attention_mask.bool()
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        # a padded query sees itself only, so its (unused) row stays finite
        base = (visible[None] & key_ok[:, None, :]) | torch.eye(T, dtype=torch.bool, device=input_ids.device)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        dist = positions[:, :, None] - positions[:, None, :]
        windows = {layer.self_attn.window for layer in self.layers}
        masks = {w: (base & (dist < w) if w else base)[:, None] for w in windows}  # one per distinct window
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, masks[layer.self_attn.window])
        return self.norm(h)


class AttnLabForCausalLM(AttnLabPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AttnLabConfig):
        super().__init__(config)
        self.model = AttnLabModel(config)
        self.lm_head = nn.Linear(config.attnlab["dim"], config.attnlab["vocab_size"], bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        """Logits [B, T, vocab]; with ``labels`` also the mean next-token cross-entropy (-100 ignored)."""
        logits = self.lm_head(self.model(input_ids, attention_mask))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
