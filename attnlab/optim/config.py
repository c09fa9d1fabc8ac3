"""``[optimizer]`` and ``[lr_scheduler]`` sections: torchtitan 0.2.2's dataclasses plus our fields.

Both subclass torchtitan's (``torchtitan.config.job_config.Optimizer`` / ``LRScheduler``), so every
torchtitan key keeps its name and default; the lead's ``JobConfig`` extension merges them field-wise.
Defaults of the new fields are the Parallax paper's Muon recipe (Table 2b, Appendix F.2).
No ``from __future__ import annotations`` here: torchtitan's config merge and tyro need real types.
"""

from dataclasses import dataclass, field

from torchtitan.config.job_config import LRScheduler as _TTLRScheduler
from torchtitan.config.job_config import Optimizer as _TTOptimizer

ROLES = ("matrix", "embed", "head", "norm", "vector")
"""Parameter roles (:mod:`optim.groups`): hidden 2-D matrices, token embeddings, an untied LM head, norm gains, and
everything else that is not a hidden matrix (biases, gates and decay parameters, conv kernels, scalars)."""


@dataclass
class Optimizer(_TTOptimizer):
    # name / lr / beta1 / beta2 / eps / weight_decay / implementation come from torchtitan; name is an entry of
    # optim.registry ("muon", "adamw", "adam", any case). With name = "muon": lr and weight_decay are Muon's (2-D
    # hidden matrices); the Adam-style fallback uses lr × adam_*_lr_mult and adam_beta1/adam_beta2/adam_eps. With
    # name = "adamw": every group uses lr, beta1, beta2, eps; weight decay is off for norms and vectors (and
    # embeddings unless embed_weight_decay).

    muon_momentum: float = 0.95
    """Muon momentum μ (EMA form as torch.optim.Muon: B ← μB + (1−μ)G)."""
    muon_nesterov: bool = True
    """Nesterov momentum for Muon (update G + μ(B − G) instead of B)."""
    muon_ns_steps: int = 5
    """Newton–Schulz iterations."""
    muon_ns_coefficients: str = "quintic"
    """Newton–Schulz polynomial: "quintic" (3.4445, −4.7750, 2.0315 every step), "polar_express"
    (Amsel et al. 2025, per-step coefficients, 5 steps max), or explicit triples "a,b,c" / "a,b,c;a,b,c;..."
    (one per step; the last repeats)."""
    muon_ns_dtype: str = "bfloat16"
    """Dtype of the Newton–Schulz iteration: "bfloat16" or "float32"."""
    muon_eps: float = 1e-7
    """Lower clamp of the Frobenius norm before Newton–Schulz."""
    muon_update_scale: str = "sqrt_max1_rows_over_cols"
    """Per-matrix update scale, rows × cols = fan_out × fan_in of the [out, in] weight (or of each head block
    under muon_per_head): "sqrt_max1_rows_over_cols" √max(1, rows/cols) (Jordan's, torch.optim.Muon's
    "original"; alias "spectral"), "sqrt_fan_out_over_fan_in" √(rows/cols) (Dion's "spectral_norm"; smaller on
    wide matrices such as wo, w2) or "match_rms_adamw" 0.2·√max(rows, cols) (Moonlight; reuses AdamW lr/wd).
    The Parallax paper says "spectral scaling" (Appendix F.2) without a formula: it does not settle which of
    the first two it means."""
    muon_per_head: bool = False
    """Orthogonalise attention input projections per head: each head's block of rows is its own matrix."""
    muon_per_head_patterns: list[str] = field(default_factory=lambda: [r"\.(wq|wk|wv|wr)\.weight$"])
    """Regexes (re.search on the parameter name) of the projections split per head when muon_per_head;
    the head size is the `head_dim` attribute of the nearest enclosing module (or its `muon_heads` hint)."""
    muon_min_dim: int = 16
    """2-D weights whose smaller side is below this are treated as stacks of vectors (role "vector", Adam-style)."""

    adam_beta1: float = 0.8
    """β1 of Muon's Adam-style fallback."""
    adam_beta2: float = 0.95
    """β2 of Muon's Adam-style fallback."""
    adam_eps: float = 1e-7
    """ε of Muon's Adam-style fallback."""
    adam_embed_lr_mult: float = 0.3
    """Muon fallback: lr multiplier of the embeddings (× optimizer.lr)."""
    adam_head_lr_mult: float = 0.3
    """Muon fallback: lr multiplier of an untied output head."""
    adam_norm_lr_mult: float = 0.015
    """Muon fallback: lr multiplier of norm weights."""
    adam_vector_lr_mult: float = 1.0
    """Muon fallback: lr multiplier of biases, gates, conv kernels, A_log, dt_bias and other vectors."""

    embed_weight_decay: bool = True
    """Apply weight decay to the embeddings (and an untied head). Norms and vectors never get it."""

    embed_patterns: list[str] = field(default_factory=lambda: [r"tok_embeddings"])
    """Regexes (re.search on the parameter name) of parameters with the role "embed"."""
    head_patterns: list[str] = field(default_factory=lambda: [r"^output\."])
    """Regexes of parameters with the role "head" (the LM head when it is not tied)."""
    norm_patterns: list[str] = field(default_factory=lambda: [r"norm"])
    """Regexes of parameters with the role "norm"."""
    vector_patterns: list[str] = field(
        default_factory=lambda: [
            r"\.bias$", r"conv", r"A_log", r"dt_bias", r"r_gate", r"b_proj", r"a_proj", r"gk_proj", r"f_proj",
        ]
    )
    """Regexes of parameters with the role "vector" (biases, depthwise convs, decay parameters, gates; Adam-style).
    Tensors that are not 2-D always have it unless their module declares another role; full-width output gates
    (`g_proj`) are ordinary matrices and go to Muon."""

    lr_mult_patterns: list[str] = field(default_factory=list)
    """Per-parameter lr overrides "REGEX=MULT" (re.search on the parameter name, first match wins): a match gets
    lr = optimizer.lr × MULT instead of its group's multiplier, in its own param group "<role>[REGEX]" (role,
    optimizer and weight decay unchanged). E.g. ["\\.r_norm\\.=1"] trains Parallax's ρ-norm gain at the base
    lr instead of the norm group's adam_norm_lr_mult (0.015× under Muon, Table 2b)."""
    lr_warmup_patterns: list[str] = field(default_factory=list)
    """Regexes of parameters with an extra lr warmup (own param groups, "<role>_warmup"), e.g. ["\\.wr\\."]
    when fine-tuning a converted Parallax model whose W_R starts at zero."""
    lr_warmup_steps: int = 0
    """Steps of the extra linear lr warmup of `lr_warmup_patterns` (multiplies the main schedule)."""


@dataclass
class LRScheduler(_TTLRScheduler):
    # warmup_steps / total_steps / decay_ratio / decay_type / min_lr_factor come from torchtitan.
    # decay_type is the decay shape (linear | cosine | sqrt); min_lr_factor is the final lr factor.

    schedule: str = "wsd"
    """"wsd" (warmup, stable, decay from decay_start), "cosine" (warmup, cosine to min_lr_factor) or "constant"."""
    warmup_fraction: float | None = None
    """Warmup as a fraction of total steps; wins over warmup_steps when set (paper's cosine: 0.01)."""
    decay_start: float | None = None
    """WSD: fraction of total steps where decay starts (paper: 0.8). Alternative to decay_ratio = 1 − decay_start;
    neither set ⇒ decay right after warmup."""
    wd_anneal_gamma: float = 0.0
    """Weight-decay annealing λ(t) = λ·(1 − t)^γ over the decay stage (eq. 42); 0 = constant weight decay."""
