"""Parallax mechanism diagnostics of a trained checkpoint, per layer and head, on held-out text.

    python -m attnlab.tools.analyze RUN_OR_STEP_DIR [--step N] --data val.jsonl.gz [-o out/] [--rows 16 --seq-len 512]
        [-- train.py flags, only for runs without config.toml, e.g. --model.attention parallax]

The model is rebuilt from the run's ``config.toml`` (and its ``tokenizer/``).

Diagnostics (Parallax paper §4.3–4.4, eqs. 16–19), for a subset of query positions:

- COR_i = ‖Σ_KV(i) ρ_i‖ / ‖v̄_i‖ (eq. 16); CPA_i = ‖Σ_KV(i) ρ_i‖ / (‖ρ_i‖ ‖Σ_KV(i)‖₂); probe norm ‖ρ_i‖;
- KV correlation ‖Σ_VV^{-1/2} Σ_KV Σ_KK^{-1/2}‖_F (eq. 17; covariances under p_i·, ridge 1e-4·tr/D);
- Parallax score range max_j s_ij − min_j s_ij (and min/max), s_ij = p_ij(1 + t̄_i − t_ij);
- attention sink p_i1 (softmax) and s_i1²/Σ_j s_ij² (Parallax, eq. 19); softmax entropy −Σ p log p;
- the gain of ρ's RMSNorm (``r_norm.weight``: mean/min/max per layer; ‖ρ_i‖ = √d_h · gain when the gain is
  uniform, so the probe norm and the gain tell apart "ρ grew" from "the gain grew");
- stable rank ‖X‖_F²/‖X‖₂² of W_Q, W_K, W_V, W_O, W_R and per head of W_Q W_Kᵀ, W_O W_V, W_R W_Kᵀ
  (raw weights: the q/k/ρ RMSNorm gains between them are left out).

Softmax checkpoints get the subset without ρ. Layers whose mechanism has no ``project_qkv`` (linear/recurrent
mixers) get only the stable ranks of the projections they have. Every row is one document (BOS first, so
"the first token" of the sink is the BOS), truncated to ``--seq-len``; documents shorter than ``--min-len``
are skipped. Output: ``analysis.json`` and one PNG per diagnostic (quantile dots and a mean line per layer,
as the paper's Figures 3 and 5).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch


QUANTILES = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
ACTIVATION_KEYS = ("cor", "cpa", "kv_corr", "probe_norm", "score_range", "score_min", "score_max",
                   "sink", "sink_p", "entropy")


# ---------------------------------------------------------------- weights

def stable_rank(w: torch.Tensor) -> float:
    """‖W‖_F² / ‖W‖₂² in float64 (0 for a zero matrix)."""
    s = torch.linalg.svdvals(w.detach().double())
    return float((s**2).sum() / s[0] ** 2) if s[0] > 0 else 0.0


def circuit_stable_rank(a: torch.Tensor, b: torch.Tensor) -> float:
    """Stable rank of aᵀ b for a: [D, n], b: [D, m] (e.g. W_Q,hᵀ W_K,h, a rank-≤D bilinear form), through
    thin QR factors: aᵀ b = Qa Ra Rbᵀ Qbᵀ has the singular values of Ra Rbᵀ ([D, D])."""
    ra = torch.linalg.qr(a.detach().double().T).R
    rb = torch.linalg.qr(b.detach().double().T).R
    return stable_rank(ra @ rb.T)


def weight_ranks(module) -> dict:
    """Stable ranks of the projections a module has, and per-head circuits when it has wq/wk/wv/wo."""
    out = {}
    for name in ("wq", "wk", "wv", "wo", "wr"):
        lin = getattr(module, name, None)
        if lin is not None and getattr(lin, "weight", None) is not None and lin.weight.dim() == 2:
            out[name] = stable_rank(lin.weight)
    D, HQ, HKV = getattr(module, "head_dim", None), getattr(module, "n_heads", None), getattr(module, "n_kv_heads", None)
    if not (D and HQ and HKV) or not all(k in out for k in ("wq", "wk", "wv", "wo")):
        return out
    G = HQ // HKV
    heads = lambda w: w.detach().view(-1, D, w.shape[-1])  # noqa: E731  [H, D, dim]
    wq, wk, wv = heads(module.wq.weight), heads(module.wk.weight), heads(module.wv.weight)
    wo = module.wo.weight.detach().view(module.wo.weight.shape[0], HQ, D).permute(1, 2, 0)  # [HQ, D, dim]
    out["qk_circuit"] = [circuit_stable_rank(wq[h], wk[h // G]) for h in range(HQ)]
    out["ov_circuit"] = [circuit_stable_rank(wo[h], wv[h // G]) for h in range(HQ)]  # W_O,h W_V,h
    if "wr" in out:
        wr = heads(module.wr.weight)
        out["rk_circuit"] = [circuit_stable_rank(wr[h], wk[h // G]) for h in range(HQ)]
    return out


# ---------------------------------------------------------------- activations

def _inv_sqrt(c: torch.Tensor, ridge: float) -> torch.Tensor:
    """(C + ridge·tr(C)/D·I)^{-1/2} for symmetric PSD c: [..., D, D]."""
    D = c.shape[-1]
    lam = ridge * c.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(1e-30) / D
    e, u = torch.linalg.eigh(c + lam[..., None, None] * torch.eye(D, dtype=c.dtype, device=c.device))
    return (u * e.clamp_min(1e-30).rsqrt()[..., None, :]) @ u.transpose(-1, -2)


def head_diagnostics(q, k, v, r, scale: float, queries: torch.Tensor, window: int = 0,
                     ridge: float = 1e-4) -> dict[str, torch.Tensor]:
    """Per-query diagnostics of one head in float64.

    q, r: [T, D] (r = ρ, or None for softmax); k, v: [T, D]; queries: [Q] int64 query positions.
    Returns {name: [Q]}: entropy, sink_p, kv_corr, and with r also cor, cpa, probe_norm, score_min/max/range,
    sink (= s_i1²/Σ s_ij²; = sink_p without r).
    """
    q, k, v = (x.double() for x in (q, k, v))
    T = k.shape[0]
    j = torch.arange(T, device=k.device)
    mask = j[None, :] <= queries[:, None]  # [Q, T]
    if window:
        mask &= queries[:, None] - j[None, :] < window
    logits = (q[queries] @ k.T * scale).masked_fill(~mask, float("-inf"))
    p = torch.softmax(logits, -1)  # [Q, T]
    out = {"entropy": -(p * torch.log(p.clamp_min(1e-300))).sum(-1), "sink_p": p[:, 0]}
    vbar, kbar = p @ v, p @ k  # [Q, D]
    skv = torch.einsum("qj,jd,je->qde", p, v, k) - vbar[:, :, None] * kbar[:, None, :]  # Σ_KV(i): [Q, D, D]
    svv = torch.einsum("qj,jd,je->qde", p, v, v) - vbar[:, :, None] * vbar[:, None, :]
    skk = torch.einsum("qj,jd,je->qde", p, k, k) - kbar[:, :, None] * kbar[:, None, :]
    corr = _inv_sqrt(svv, ridge) @ skv @ _inv_sqrt(skk, ridge)
    out["kv_corr"] = torch.linalg.matrix_norm(corr, "fro")
    if r is None:
        out["sink"] = out["sink_p"]
        return out
    rho = r.double()[queries]  # [Q, D]
    t = rho @ k.T  # [Q, T], t_ij = ρ_i·k_j (unscaled)
    tbar = (p * t).sum(-1, keepdim=True)
    s = (p * (1 + tbar - t)).masked_fill(~mask, 0.0)  # s_ij of eq. (8)
    correction = (skv @ rho[:, :, None]).squeeze(-1)  # Σ_KV(i) ρ_i: [Q, D]
    cnorm, rnorm = correction.norm(dim=-1), rho.norm(dim=-1)
    out["cor"] = cnorm / vbar.norm(dim=-1).clamp_min(1e-30)
    out["cpa"] = torch.where(cnorm > 0, cnorm / (rnorm * torch.linalg.matrix_norm(skv, 2)).clamp_min(1e-30),
                             torch.zeros_like(cnorm))
    out["probe_norm"] = rnorm
    big = torch.finfo(s.dtype).max
    out["score_max"] = s.masked_fill(~mask, -big).max(-1).values
    out["score_min"] = s.masked_fill(~mask, big).min(-1).values
    out["score_range"] = out["score_max"] - out["score_min"]
    out["sink"] = s[:, 0] ** 2 / (s**2).sum(-1)
    return out


def query_positions(T: int, n: int, min_pos: int) -> torch.Tensor:
    """Up to ``n`` evenly spaced query positions in [min_pos, T)."""
    lo = min(min_pos, T - 1)
    return torch.unique(torch.linspace(lo, T - 1, min(n, T - lo)).round().long())


@torch.no_grad()
def layer_activations(module, x: torch.Tensor, ctx, queries: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """x: [1, T, dim] (the normed input of the attention block) -> {name: [per head [Q]]}."""
    q, k, v = module.project_qkv(x, ctx)  # [1, T, HQ|HKV, D]
    r = module.probe(x, ctx) if hasattr(module, "probe") else None
    G = q.shape[2] // k.shape[2]
    window = getattr(getattr(module, "opts", None), "window_size", 0) or 0
    res: dict[str, list] = {}
    for h in range(q.shape[2]):
        d = head_diagnostics(q[0, :, h], k[0, :, h // G], v[0, :, h // G], None if r is None else r[0, :, h],
                             module.scale, queries, window)
        for name, val in d.items():
            res.setdefault(name, []).append(val.float().cpu())
    return res


# ---------------------------------------------------------------- driver

def document_rows(spec: str, tokenizer, text_field: str, n_rows: int, seq_len: int, min_len: int) -> list[torch.Tensor]:
    """Up to ``n_rows`` token rows, one document each (BOS + text [+ EOS]), truncated to ``seq_len``."""
    from attnlab.data.sources import open_text_dataset

    local = os.path.exists(spec) or any(c in spec for c in "*?[")
    ds, field = open_text_dataset(spec, "--data", local=local, text_field=text_field, streaming=not local or None)
    rows = []
    for sample in ds:
        ids = tokenizer.encode(sample[field], add_bos=True, add_eos=True)
        if len(ids) >= min_len:
            rows.append(torch.tensor(ids[:seq_len], dtype=torch.long))
        if len(rows) >= n_rows:
            break
    if not rows:
        raise ValueError(f"--data={spec!r}: no document has >= {min_len} tokens (lower --min-len)")
    return rows


def summarize(values: torch.Tensor) -> dict:
    values = values[torch.isfinite(values)]
    if values.numel() == 0:
        return {"mean": float("nan"), "quantiles": {str(qq): float("nan") for qq in QUANTILES}}
    qs = torch.quantile(values.double(), torch.tensor(QUANTILES, dtype=torch.float64))
    return {"mean": float(values.double().mean()), "quantiles": {str(qq): float(x) for qq, x in zip(QUANTILES, qs)}}


@torch.no_grad()
def analyze(model, rows: list[torch.Tensor], n_queries: int = 32, min_pos: int = 8) -> dict:
    """Run every row through ``model`` and collect diagnostics per layer (see the module docstring)."""
    device = next(model.parameters()).device
    captured: dict[int, tuple] = {}
    hooks = [layer.attention.register_forward_pre_hook(lambda m, a, i=int(i): captured.__setitem__(i, a))
             for i, layer in model.layers.items()]
    acts: dict[int, dict[str, list[list[torch.Tensor]]]] = {}
    try:
        for row in rows:
            tokens = row[None].to(device)
            captured.clear()
            model(tokens)
            queries = query_positions(tokens.shape[1], n_queries, min_pos).to(device)
            for i, (x, ctx) in captured.items():
                module = model.layers[str(i)].attention
                if not hasattr(module, "project_qkv"):
                    continue
                for name, per_head in layer_activations(module, x, ctx, queries).items():
                    slot = acts.setdefault(i, {}).setdefault(name, [[] for _ in per_head])
                    for h, val in enumerate(per_head):
                        slot[h].append(val)
    finally:
        for h in hooks:
            h.remove()
    layers = []
    for i, layer in model.layers.items():
        i = int(i)
        entry = {"layer": i, "mechanism": getattr(layer.attention, "mechanism", type(layer.attention).__name__),
                 "stable_rank": weight_ranks(layer.attention), "activations": {}}
        r_norm = getattr(layer.attention, "r_norm", None)
        if getattr(r_norm, "weight", None) is not None:
            g = r_norm.weight.detach().double()
            entry["rho_norm_gain"] = {"mean": float(g.mean()), "min": float(g.min()), "max": float(g.max())}
        for name, per_head in acts.get(i, {}).items():
            heads = [torch.cat(v) for v in per_head]
            entry["activations"][name] = {**summarize(torch.cat(heads)),
                                          "head_mean": [float(h.double().mean()) for h in heads]}
        layers.append(entry)
    return {"n_rows": len(rows), "n_tokens": int(sum(r.numel() for r in rows)), "queries_per_row": n_queries,
            "quantiles": list(QUANTILES), "layers": layers, "summary": _summary(layers)}


def _summary(layers: list[dict]) -> dict:
    """Means over layers (activations) and over heads and layers (stable ranks, as the paper's Table 4)."""
    out = {}
    for key in ACTIVATION_KEYS:
        vals = [l["activations"][key]["mean"] for l in layers if key in l["activations"]]
        if vals:
            out[key] = sum(vals) / len(vals)
    gains = [l["rho_norm_gain"]["mean"] for l in layers if "rho_norm_gain" in l]
    if gains:
        out["rho_gain"] = sum(gains) / len(gains)
    for key in ("wq", "wk", "wv", "wo", "wr", "qk_circuit", "ov_circuit", "rk_circuit"):
        vals = [x for l in layers if key in l["stable_rank"]
                for x in (l["stable_rank"][key] if isinstance(l["stable_rank"][key], list) else [l["stable_rank"][key]])]
        if vals:
            out[f"srank_{key}"] = sum(vals) / len(vals)
    return out


TITLES = {"cor": "correction-to-output ratio COR", "cpa": "covariance–probe alignment CPA",
          "kv_corr": "KV correlation ‖Corr‖_F", "probe_norm": "probe norm ‖ρ‖", "score_range": "score range",
          "score_min": "min score s_ij", "score_max": "max score s_ij", "sink": "attention sink (s² share / p_i1)",
          "sink_p": "softmax sink p_i1", "entropy": "softmax entropy"}


def plot(results: dict, out_dir: str, label: str) -> list[str]:
    """One PNG per activation diagnostic: quantile dots per layer, mean line (paper Figures 3/5)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key in ACTIVATION_KEYS:
        pts = [(l["layer"], l["activations"][key]) for l in results["layers"] if key in l["activations"]]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = [p[0] for p in pts]
        for qq in QUANTILES:
            ax.scatter(xs, [p[1]["quantiles"][str(qq)] for p in pts], s=10, alpha=0.25 + 0.5 * (1 - 2 * abs(qq - 0.5)),
                       color="tab:blue")
        ax.plot(xs, [p[1]["mean"] for p in pts], color="tab:red", marker="o", ms=3, label=f"{label} mean")
        ax.set_xlabel("layer")
        ax.set_title(TITLES[key], fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{key}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import dir_path, non_negative_int, positive_int, tool_parser

    ap = tool_parser(__doc__)
    ap.add_argument("--data", required=True, help="held-out text: local file/folder/glob or a hub dataset name")
    ap.add_argument("-o", "--out", type=dir_path, default=None, help="output folder (default <run>/analysis)")
    ap.add_argument("--rows", type=positive_int, default=16, help="documents analysed")
    ap.add_argument("--seq-len", type=positive_int, default=512, help="documents are truncated to this many tokens")
    ap.add_argument("--min-len", type=non_negative_int, default=32, help="skip documents with fewer tokens")
    ap.add_argument("--queries", type=positive_int, default=32, help="query positions per document")
    ap.add_argument("--no-plots", action="store_true", help="write analysis.json only")
    return ap


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    from attnlab.tools.common import load_run, split_train_flags

    ap = build_parser()
    own, train_flags = split_train_flags(argv)
    args = ap.parse_args(own)
    from attnlab.data.loader import build_tokenizer
    from attnlab.checkpoint.layout import run_dir_of, step_of

    model, cfg, step_dir = load_run(ap, args, train_flags)
    rows = document_rows(args.data, build_tokenizer(cfg), cfg.data.text_field, args.rows, args.seq_len, args.min_len)
    res = analyze(model, rows, args.queries)
    res.update(checkpoint=str(step_dir), step=step_of(step_dir), attention=cfg.model.attention,
               layer_pattern=list(cfg.model.layer_pattern), data=args.data)
    out = args.out or str(run_dir_of(step_dir) / "analysis")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "analysis.json"), "w") as f:
        json.dump(res, f, indent=1, allow_nan=True)
    if not args.no_plots:
        plot(res, out, cfg.model.attention)
    print(json.dumps({"out": out, **{k: round(v, 4) if math.isfinite(v) else v for k, v in res["summary"].items()}}))
    return res


if __name__ == "__main__":
    main()
