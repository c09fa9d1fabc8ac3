"""HLA as a streaming recurrence, one token at a time: the decode path and a second oracle.

Compact states (docs/mechanisms.md, "HLA"), per head, with a per-token decay γ_t = exp(g_t):

- second order:  S = γ S + k kᵀ;  U = γ² U + (S q) vᵀ;                o = qᵀ U          state (S [K,K], U [K,V])
- AHLA:          P = γ P + k vᵀ;  E = γ E + k (qᵀ P);                 o = qᵀ E          state (P [K,V], E [K,V])
- third order:   S = γ S + k kᵀ;  P = γ P + k vᵀ;  Y = γ³ Y + (S q)(qᵀ P);  o = qᵀ Y   state (S, P, Y)

All updates use the *inclusive* S, P (after adding token t). The paper-tuple recurrences (S, C, m, G, h) of
Thm 3.1 and Algorithm 3 are kept (``hla2_step_paper``, ``hla3_step_paper``) to test the errata.
States are float32 (float64 for float64 inputs); normalisation is done by the caller with a ones column in v.
"""

from __future__ import annotations

import torch

from attnlab.attention.ops.common import document_ids


def init_state(order: int, variant: str, B: int, H: int, K: int, V: int, device, dtype=torch.float32) -> tuple:
    """Zero decode state: (S [B,H,K,K], U [B,H,K,V]) | (P, E) for AHLA | (S, P, Y) for third order."""
    z = lambda a, b: torch.zeros(B, H, a, b, device=device, dtype=dtype)  # noqa: E731
    if variant == "asymmetric":
        return (z(K, V), z(K, V))
    return (z(K, K), z(K, V)) if order == 2 else (z(K, K), z(K, V), z(K, V))


def hla_step(state: tuple, q, k, v, g, order: int = 2, variant: str = "symmetric"):
    """One token. q, k: [B, H, K]; v: [B, H, V]; g: [B, H] log-decay or None. Returns (o [B, H, V], state)."""
    ct = state[0].dtype
    q, k, v = q.to(ct), k.to(ct), v.to(ct)
    gam = torch.ones(q.shape[:2], dtype=ct, device=q.device) if g is None else torch.exp(g.to(ct))
    gam = gam[..., None, None]
    outer = lambda a, b: a[..., :, None] * b[..., None, :]  # noqa: E731
    if variant == "asymmetric":
        P, E = state
        P = gam * P + outer(k, v)
        E = gam * E + outer(k, torch.einsum("bhk,bhkv->bhv", q, P))
        return torch.einsum("bhk,bhkv->bhv", q, E), (P, E)
    S = gam * state[0] + outer(k, k)
    Sq = torch.einsum("bhij,bhj->bhi", S, q)
    if order == 2:
        U = gam**2 * state[1] + outer(Sq, v)
        return torch.einsum("bhk,bhkv->bhv", q, U), (S, U)
    P = gam * state[1] + outer(k, v)
    Y = gam**3 * state[2] + outer(Sq, torch.einsum("bhk,bhkv->bhv", q, P))
    return torch.einsum("bhk,bhkv->bhv", q, Y), (S, P, Y)


def serial_hla(q, k, v, g=None, *, order=2, variant="symmetric", cu_seqlens=None, initial_state=None,
               output_final_state=False):
    """Token loop over [B, T, H, *] inputs; the state resets at every document start of ``cu_seqlens``.
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] or None. Returns o [B, T, H, V] (q's dtype) and the state
    after the last token when ``output_final_state``."""
    B, T, H, K = q.shape
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    state = initial_state if initial_state is not None else init_state(order, variant, B, H, K, v.shape[-1], q.device, ct)
    starts = None
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, B, T)
        starts = torch.ones(B, T, dtype=torch.bool, device=q.device)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    outs = []
    for t in range(T):
        if starts is not None and t > 0:
            keep = (~starts[:, t]).to(ct)[:, None, None, None]
            state = tuple(s * keep for s in state)
        o, state = hla_step(state, q[:, t], k[:, t], v[:, t], None if g is None else g[:, t], order, variant)
        outs.append(o)
    o = torch.stack(outs, 1).to(q.dtype)
    return (o, state) if output_final_state else o


def hla2_step_paper(state, q, k, v, gamma: float = 1.0, corrected: bool = True):
    """Paper tuple (S, C, m, G, h), Thm 3.1 / §2.4, single head: q, k: [K], v: [V]. With decay, ``corrected``
    uses the corrected G = γ² G + γ k kᵀ C_{t-1}; otherwise the printed G = γ G + k kᵀ C_{t-1}.
    Returns (o = qᵀ(S C − G), den = qᵀ(S m − h), state)."""
    S, C, m, G, h = state
    kkC, kkm = torch.outer(k, k @ C), k * (k @ m)  # use C_{t-1}, m_{t-1}
    if corrected:
        G, h = gamma**2 * G + gamma * kkC, gamma**2 * h + gamma * kkm
    else:
        G, h = gamma * G + kkC, gamma * h + kkm
    S = gamma * S + torch.outer(k, k)
    C = gamma * C + torch.outer(q, v)
    m = gamma * m + q
    return q @ (S @ C - G), q @ (S @ m - h), (S, C, m, G, h)


def hla3_step_paper(state, q, k, v):
    """The paper's Algorithm 3 (undecayed), single head; it computes the 'max index attained twice' sum, NOT the
    masked (W Wᵀ W) V (a paper erratum). state = (SK, SQ, P, G1, G2, G3)."""
    SK, SQ, P, G1, G2, G3 = state
    u1 = SQ @ k
    G1 = G1 + torch.outer(k, u1 @ P)
    a2 = SK @ q
    G2 = G2 + torch.outer(a2, q @ P)
    G3 = G3 + torch.outer(SK @ (SQ @ k), v)
    SK = SK + torch.outer(k, k)
    SQ = SQ + torch.outer(q, q)
    P = P + torch.outer(k, v)
    o = (SQ @ (SK @ q)) @ P - q @ G1 - q @ G2 - q @ G3
    return o, (SK, SQ, P, G1, G2, G3)


def hla3_step_corrected(state, q, k, v):
    """Corrected paper-style third order: qᵀ(S^K S^Q P − G1 − G3 − X), X += (kᵀ S^Q_{t-1} k) k vᵀ.
    state = (SK, SQ, P, G1, G3, X)."""
    SK, SQ, P, G1, G3, X = state
    G1 = G1 + torch.outer(k, (SQ @ k) @ P)
    G3 = G3 + torch.outer(SK @ (SQ @ k), v)
    X = X + (k @ SQ @ k) * torch.outer(k, v)
    SK = SK + torch.outer(k, k)
    SQ = SQ + torch.outer(q, q)
    P = P + torch.outer(k, v)
    o = q @ (SK @ SQ @ P - G1 - G3 - X)
    return o, (SK, SQ, P, G1, G3, X)
