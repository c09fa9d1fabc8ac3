"""HLA in chunkwise matmul form, composed from one primitive: causal scalar-gated linear attention.

``gla(q, k, v, g)`` computes o_t = Σ_{s≤t} b(s,t) (q_t·k_s) v_s with b(s,t) = exp(g_{s+1} + ... + g_t)
(:func:`attention.ops.linear_attn.gated_linear_attention` with scale 1: its chunk path in PyTorch, its Triton
kernel). The chunk forms of every variant factor into two or three such passes (docs/mechanisms.md, "HLA"; the
inclusive metric-vector r_t = S_t q_t is itself a gated linear attention with values k):

- second order:  R = gla(q, k, k; g)     (R_t = S_t q_t)      O = gla(q, R, v; 2g)          [U = γ² U + R_t v_tᵀ]
- AHLA:          Z = gla(q, k, v; g)     (Z_t = q_tᵀ P_t)     O = gla(q, k, Z; g)           [= A_γ (A_γ V)]
- third order:   R = gla(q, k, k; g),  Z = gla(q, k, v; g),   O = gla(q, R, Z; 3g)          [Y = γ³ Y + R_t Z_t]

so the recurrent states of the passes are exactly the decode states of ``recurrent.py`` ((S, U), (P, E), (S, P, Y)).
Normalisation appends a ones column to v (den = the same operator applied to v ≡ 1).
"""

from __future__ import annotations

import torch


def compose_hla(gla, q, k, v, g=None, *, order=2, variant="symmetric", normalize=False, eps=1e-6,
                initial_state=None, output_final_state=False):
    """HLA from a gated-linear-attention primitive ``gla(q, k, v, g, initial_state=, output_final_state=)`` that
    returns (o, final state or None). q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-decay (≤ 0) or None;
    ``initial_state`` is the tuple of ``recurrent.py`` (with V+1 columns if normalize).
    Returns o [B, T, H, V] (and the final state tuple)."""
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    st = initial_state if initial_state is not None else (None, None, None)
    fs = output_final_state

    def run(a, b, c, gg, h0):
        return gla(a, b, c, gg, initial_state=h0, output_final_state=fs)

    if variant == "asymmetric":
        Z, P = run(q, k, v, g, st[0])
        O, E = run(q, k, Z, g, st[1])
        state = (P, E)
    elif order == 2:
        R, S = run(q, k, k, g, st[0])
        O, U = run(q, R, v, None if g is None else 2 * g, st[1])
        state = (S, U)
    else:
        R, S = run(q, k, k, g, st[0])
        Z, P = run(q, k, v, g, st[1])
        O, Y = run(q, R, Z, None if g is None else 3 * g, st[2])
        state = (S, P, Y)
    if normalize:
        den = O[..., -1].float() if O.dtype != torch.float64 else O[..., -1]
        O = safe_div_o(O[..., :-1], den, eps)
    return (O, state) if output_final_state else O


def safe_div_o(num, den, eps):
    """num / (sign(den)(|den| + eps)) in num's dtype; num: [..., V], den: [...]."""
    den = torch.where(den >= 0, den + eps, den - eps)
    return (num.to(den.dtype) / den.unsqueeze(-1)).to(num.dtype)
