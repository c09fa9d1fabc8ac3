"""HLA in chunkwise matmul form (PyTorch), built from one primitive: causal scalar-gated linear attention.

``gla(q, k, v, g)`` computes o_t = Σ_{s≤t} b(s,t) (q_t·k_s) v_s with b(s,t) = exp(g_{s+1} + ... + g_t). The
chunk forms of every variant factor into two or three such passes (docs/mechanisms.md, "HLA"; the inclusive
metric-vector r_t = S_t q_t is itself a gated linear attention with values k):

- second order:  R = gla(q, k, k; g)     (R_t = S_t q_t)      O = gla(q, R, v; 2g)          [U = γ² U + R_t v_tᵀ]
- AHLA:          Z = gla(q, k, v; g)     (Z_t = q_tᵀ P_t)     O = gla(q, k, Z; g)           [= A_γ (A_γ V)]
- third order:   R = gla(q, k, k; g),  Z = gla(q, k, v; g),   O = gla(q, R, Z; 3g)          [Y = γ³ Y + R_t Z_t]

so the recurrent states of the passes are exactly the decode states of ``serial.py`` ((S, U), (P, E), (S, P, Y)).
Normalisation appends a ones column to v (den = the same operator applied to v ≡ 1).

Packed documents: ``doc`` [B, T] document ids; pairs across documents are masked and the carried state is
dropped at document starts (chunks may straddle documents). This file is the reference of the Triton kernel in
``attention/ops/linear_attn/triton_gla.py`` (same chunking and masking).
"""

from __future__ import annotations

import torch


def gla_chunk(q, k, v, g=None, *, chunk_size=64, doc=None, initial_state=None, output_final_state=False):
    """Chunked causal scalar-gated linear attention (fp32/fp64 accumulation).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-decay (≤ 0) or None; doc: [B, T] int or None;
    initial_state: [B, H, K, V] (applies to the first document of each row) or None.
    Returns o [B, T, H, V] in q's dtype (and the fp32 state after the last token, of the last document)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    NT = -(-T // C)
    pad = NT * C - T
    if g is None:
        g = q.new_zeros(B, T, H, dtype=ct)
    if doc is None:
        doc = torch.zeros(B, T, dtype=torch.int64, device=q.device)

    def chunks(x, fill=0):  # [B, T, ...] -> [B, NT, C, ...]
        if pad:
            x = torch.cat([x, x[:, -1:].expand(-1, pad, *x.shape[2:]) if fill is None else x.new_zeros(B, pad, *x.shape[2:])], 1)
        return x.reshape(B, NT, C, *x.shape[2:])

    qc, kc, vc = chunks(q.to(ct)), chunks(k.to(ct)), chunks(v.to(ct))  # [B, N, C, H, *]
    gc = chunks(g.to(ct))  # [B, N, C, H]
    dc = chunks(doc, fill=None)  # [B, N, C], padding continues the last document
    ell = gc.cumsum(2)  # local log-cumsum
    prev = torch.cat([dc[:, :1, 0], dc[:, :-1, -1]], 1)  # [B, N] document of the carried state
    carry = (dc == prev[:, :, None]).to(ct)  # [B, N, C] token sees the carried state
    last = (dc == dc[:, :, -1:]).to(ct)  # [B, N, C] token contributes to the outgoing state
    i = torch.arange(C, device=q.device)
    pair = (i[:, None] >= i[None, :]) & (dc[..., :, None] == dc[..., None, :])  # [B, N, C, C]
    diff = ell.permute(0, 1, 3, 2)[..., :, None] - ell.permute(0, 1, 3, 2)[..., None, :]  # [B, N, H, C, C]
    D = torch.exp(torch.where(pair[:, :, None], diff, float("-inf")))
    A = torch.einsum("bnthk,bnshk->bnhts", qc, kc) * D
    o = torch.einsum("bnhts,bnshv->bnthv", A, vc)  # intra-chunk part
    beta = torch.exp(ell) * carry[..., None]  # [B, N, C, H]
    e = torch.exp(ell[:, :, -1:] - ell) * last[..., None]  # [B, N, C, H] decay to chunk end
    betaW = torch.exp(ell[:, :, -1]) * (dc[:, :, -1] == prev).to(ct)[..., None]  # [B, N, H]
    h = q.new_zeros(B, H, K, V, dtype=ct) if initial_state is None else initial_state.to(ct)
    inter = []
    for n in range(NT):
        inter.append(torch.einsum("bthk,bhkv->bthv", qc[:, n] * beta[:, n, ..., None], h))
        h = betaW[:, n, :, None, None] * h + torch.einsum("bthk,bthv->bhkv", kc[:, n] * e[:, n, ..., None], vc[:, n])
    o = (o + torch.stack(inter, 1)).reshape(B, NT * C, H, V)[:, :T].to(q.dtype)
    return (o, h) if output_final_state else o


def compose_hla(gla, q, k, v, g=None, *, order=2, variant="symmetric", normalize=False, eps=1e-6,
                initial_state=None, output_final_state=False, **kw):
    """HLA from a gated-linear-attention primitive ``gla(q, k, v, g, initial_state=, output_final_state=, **kw)``.
    Shapes as in :func:`gla_chunk`; ``initial_state`` is the tuple of serial.py (with V+1 columns if normalize).
    Returns o [B, T, H, V] (and the final state tuple)."""
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    st = initial_state if initial_state is not None else (None, None, None)
    fs = output_final_state

    def run(a, b, c, gg, h0):
        r = gla(a, b, c, gg, initial_state=h0, output_final_state=fs, **kw)
        return r if fs else (r, None)

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


def chunk_hla(q, k, v, g=None, *, order=2, variant="symmetric", normalize=False, eps=1e-6, chunk_size=64,
              doc=None, initial_state=None, output_final_state=False):
    """HLA / AHLA / third order, chunked PyTorch path. q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None."""
    return compose_hla(gla_chunk, q, k, v, g, order=order, variant=variant, normalize=normalize, eps=eps,
                       initial_state=initial_state, output_final_state=output_final_state,
                       chunk_size=chunk_size, doc=doc)
