"""Recurrent (decode) form of the affine family: the uniform averages are running sums.

State per batch row and kv head (fp32): n (tokens so far), Σv, Σk [B, HKV, D], Σ v kᵀ, Σ k kᵀ [B, HKV, D, D].
One step appends (k_t, v_t) and evaluates the mechanism at the new query with explicit D×D matrices and
the same CG as the chunked path (same iterates, so decode equals the full forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.attention.ops.lla.naive import cg_solve


@dataclass
class AffineState:
    n: int
    sum_v: torch.Tensor  # [B, HKV, D]
    sum_k: torch.Tensor  # [B, HKV, D]
    S: torch.Tensor  # [B, HKV, D, D] Σ v kᵀ
    H: torch.Tensor  # [B, HKV, D, D] Σ k kᵀ

    @staticmethod
    def zeros(B: int, HKV: int, D: int, device) -> "AffineState":
        z = lambda *s: torch.zeros(*s, device=device, dtype=torch.float32)  # noqa: E731
        return AffineState(0, z(B, HKV, D), z(B, HKV, D), z(B, HKV, D, D), z(B, HKV, D, D))

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, T, HKV, D] appended in place."""
        k, v = k.float(), v.float()
        self.n += k.shape[1]
        self.sum_k += k.sum(1)
        self.sum_v += v.sum(1)
        self.S += torch.einsum("btkd,btke->bkde", v, k)
        self.H += torch.einsum("btkd,btke->bkde", k, k)


def affine_step(mechanism, state: AffineState, q, k, v, lam=None, cg_iters=16, jacobi=False, rtol=1e-6):
    """q: [B, HQ, D]; k, v: [B, HKV, D] (the new token); lam: [B, HQ] or None. Updates ``state`` and returns
    o: [B, HQ, D] in q's dtype."""
    state.extend(k[:, None], v[:, None])
    B, HQ, D = q.shape
    G = HQ // k.shape[1]
    rep = lambda t: t.repeat_interleave(G, 1)  # noqa: E731  kv heads -> q heads
    n = float(state.n)
    vbar, kbar = rep(state.sum_v) / n, rep(state.sum_k) / n  # [B, HQ, D]
    if mechanism == "value_avg":
        return vbar.to(q.dtype)
    S = rep(state.S) / n
    qf = q.float()
    if mechanism == "affine_linear":
        rho = qf
    else:
        affine = mechanism == "affine_mesa"
        A = rep(state.H) / n + lam.float()[..., None, None] * torch.eye(D, device=q.device)
        if affine:
            A = A - kbar[..., :, None] * kbar[..., None, :]
        diag = torch.diagonal(A, dim1=-2, dim2=-1) if jacobi else None
        rho = cg_solve(lambda p: (A @ p[..., None]).squeeze(-1), (kbar - qf) if affine else qf, cg_iters,
                       diag=diag, rtol=rtol)
        if not affine:
            return (S @ rho[..., None]).squeeze(-1).to(q.dtype)
    St = S - vbar[..., :, None] * kbar[..., None, :]
    return (vbar - (St @ rho[..., None]).squeeze(-1)).to(q.dtype)
