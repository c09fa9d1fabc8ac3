"""``[optimizer]`` and ``[lr_scheduler]`` sections: torchtitan 0.2.2's dataclasses plus our fields.

Both subclass torchtitan's (``torchtitan.config.job_config.Optimizer`` / ``LRScheduler``), so every
torchtitan key keeps its name and default; the lead's ``JobConfig`` extension merges them field-wise.
Defaults of the new fields are the Parallax paper's Muon recipe (Table 2b, Appendix F.2). Each new field declares
its valid values in its metadata (``{"valid": RULE}``, the words of :mod:`attnlab.config.rules`); torchtitan's keep
theirs in ``attnlab.config.checks.TITAN_RULES``.
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

    muon_momentum: float = field(default=0.95, metadata={"valid": "in [0, 1)"})
    """Muon momentum μ (EMA form as torch.optim.Muon: B ← μB + (1−μ)G)."""
    muon_nesterov: bool = True
    """Nesterov momentum for Muon (update G + μ(B − G) instead of B)."""
    muon_ns_steps: int = field(default=5, metadata={"valid": "> 0"})
    """Newton–Schulz iterations."""
    muon_ns_coefficients: str = field(default="quintic",
                                      metadata={"valid": "quintic, polar_express or triples 'a,b,c;a,b,c'"})
    """Newton–Schulz polynomial: "quintic" (3.4445, −4.7750, 2.0315 every step), "polar_express"
    (Amsel et al. 2025, per-step coefficients, 5 steps max), or explicit triples "a,b,c" / "a,b,c;a,b,c;..."
    (one per step; the last repeats)."""
    muon_ns_dtype: str = field(default="bfloat16", metadata={"valid": "one of bfloat16, float32"})
    """Dtype of the Newton–Schulz iteration: "bfloat16" or "float32"."""
    muon_eps: float = field(default=1e-7, metadata={"valid": "> 0"})
    """Lower clamp of the Frobenius norm before Newton–Schulz."""
    muon_update_scale: str = field(default="sqrt_max1_rows_over_cols", metadata={
        "valid": "one of sqrt_max1_rows_over_cols, spectral, sqrt_fan_out_over_fan_in, match_rms_adamw"})
    """Per-matrix update scale, rows × cols = fan_out × fan_in of the [out, in] weight (or of each head block
    under muon_per_head): "sqrt_max1_rows_over_cols" √max(1, rows/cols) (Jordan's, torch.optim.Muon's
    "original"; alias "spectral"), "sqrt_fan_out_over_fan_in" √(rows/cols) (Dion's "spectral_norm"; smaller on
    wide matrices such as wo, w2) or "match_rms_adamw" 0.2·√max(rows, cols) (Moonlight; reuses AdamW lr/wd).
    The Parallax paper says "spectral scaling" (Appendix F.2) without a formula: it does not settle which of
    the first two it means."""
    muon_per_head: bool = False
    """Orthogonalise attention input projections per head: each head's block of rows is its own matrix."""
    muon_per_head_patterns: list[str] = field(metadata={"valid": "a regex"},
                                              default_factory=lambda: [r"\.(wq|wk|wv|wr)\.weight$"])
    """Regexes (re.search on the parameter name) of the projections split per head when muon_per_head;
    the head size is the `head_dim` attribute of the nearest enclosing module (or its `muon_heads` hint)."""
    muon_min_dim: int = field(default=16, metadata={"valid": ">= 0"})
    """2-D weights whose smaller side is below this are treated as stacks of vectors (role "vector", Adam-style)."""

    adam_beta1: float = field(default=0.8, metadata={"valid": "in [0, 1)"})
    """β1 of Muon's Adam-style fallback."""
    adam_beta2: float = field(default=0.95, metadata={"valid": "in [0, 1)"})
    """β2 of Muon's Adam-style fallback."""
    adam_eps: float = field(default=1e-7, metadata={"valid": "> 0"})
    """ε of Muon's Adam-style fallback."""
    adam_embed_lr_mult: float = field(default=0.3, metadata={"valid": ">= 0"})
    """Muon fallback: lr multiplier of the embeddings (× optimizer.lr)."""
    adam_head_lr_mult: float = field(default=0.3, metadata={"valid": ">= 0"})
    """Muon fallback: lr multiplier of an untied output head."""
    adam_norm_lr_mult: float = field(default=0.015, metadata={"valid": ">= 0"})
    """Muon fallback: lr multiplier of norm weights."""
    adam_vector_lr_mult: float = field(default=1.0, metadata={"valid": ">= 0"})
    """Muon fallback: lr multiplier of biases, gates, conv kernels, A_log, dt_bias and other vectors."""

    embed_weight_decay: bool = True
    """Apply weight decay to the embeddings (and an untied head). Norms and vectors never get it."""

    embed_patterns: list[str] = field(metadata={"valid": "a regex"}, default_factory=lambda: [r"tok_embeddings"])
    """Regexes (re.search on the parameter name) of parameters with the role "embed"."""
    head_patterns: list[str] = field(metadata={"valid": "a regex"}, default_factory=lambda: [r"^output\."])
    """Regexes of parameters with the role "head" (the LM head when it is not tied)."""
    norm_patterns: list[str] = field(metadata={"valid": "a regex"}, default_factory=lambda: [r"norm"])
    """Regexes of parameters with the role "norm"."""
    vector_patterns: list[str] = field(
        metadata={"valid": "a regex"}, default_factory=lambda: [
            r"\.bias$", r"conv", r"A_log", r"dt_bias", r"r_gate", r"b_proj", r"a_proj", r"gk_proj", r"f_proj",
        ]
    )
    """Regexes of parameters with the role "vector" (biases, depthwise convs, decay parameters, gates; Adam-style).
    Tensors that are not 2-D always have it unless their module declares another role; full-width output gates
    (`g_proj`) are ordinary matrices and go to Muon."""

    lr_mult_patterns: list[str] = field(default_factory=list,
                                        metadata={"valid": "'REGEX=MULT' (a regex, a finite MULT >= 0)"})
    """Per-parameter lr overrides "REGEX=MULT" (re.search on the parameter name, first match wins): a match gets
    lr = optimizer.lr × MULT instead of its group's multiplier, in its own param group "<role>[REGEX]" (role,
    optimizer and weight decay unchanged). E.g. ["\\.r_norm\\.=1"] trains Parallax's ρ-norm gain at the base
    lr instead of the norm group's adam_norm_lr_mult (0.015× under Muon, Table 2b)."""
    lr_warmup_patterns: list[str] = field(default_factory=list, metadata={"valid": "a regex"})
    """Regexes of parameters with an extra lr warmup (own param groups, "<role>_warmup"), e.g. ["\\.wr\\."]
    when fine-tuning a converted Parallax model whose W_R starts at zero."""
    lr_warmup_steps: int = field(default=0, metadata={"valid": ">= 0"})
    """Steps of the extra linear lr warmup of `lr_warmup_patterns` (multiplies the main schedule)."""


@dataclass
class LRScheduler(_TTLRScheduler):
    # warmup_steps / total_steps / decay_ratio / decay_type / min_lr_factor come from torchtitan.
    # decay_type is the decay shape (linear | cosine | sqrt); min_lr_factor is the final lr factor.

    schedule: str = field(default="wsd", metadata={"valid": "one of wsd, cosine, constant"})
    """"wsd" (warmup, stable, decay from decay_start), "cosine" (warmup, cosine to min_lr_factor) or "constant"."""
    warmup_fraction: float | None = field(default=None, metadata={"valid": "in [0, 1]"})
    """Warmup as a fraction of total steps; wins over warmup_steps when set (paper's cosine: 0.01)."""
    decay_start: float | None = field(default=None, metadata={"valid": "in [0, 1]"})
    """WSD: fraction of total steps where decay starts (paper: 0.8). Alternative to decay_ratio = 1 − decay_start;
    neither set ⇒ decay right after warmup."""
    wd_anneal_gamma: float = field(default=0.0, metadata={"valid": ">= 0"})
    """Weight-decay annealing λ(t) = λ·(1 − t)^γ over the decay stage (eq. 42); 0 = constant weight decay."""
