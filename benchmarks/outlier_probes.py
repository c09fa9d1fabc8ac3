"""CPU probes behind ``benchmarks/outliers.md``: what a mechanism looks like at initialisation under the registry
recipe (``configs/replication/repl_base.toml``, flavor repl-68M), without trained weights.

    python -m benchmarks.outlier_probes init softmax,hla,cala [--data VAL --tokenizer DIR] [-- train.py flags]
    python -m benchmarks.outlier_probes hla-range [--data VAL --tokenizer DIR] [-- train.py flags]
    python -m benchmarks.outlier_probes roles softmax,hla,cala
    python -m benchmarks.outlier_probes cala-range

- ``init``: per mechanism, the RMS of the residual branch (the attention block's output, after its output
  projection) and of the mixer output (the output projection's input), mean over layers and at the first and last
  layer, and the loss at init, over 2 rows of ``--seq`` tokens (``--data`` rows, else random token ids).
- ``hla-range``: HLA's output before its per-head output RMSNorm, per token and head: percentiles over tokens and the
  median over each document's first 4 tokens. The RMSNorm divides by this RMS, so its Jacobian scales as its inverse.
- ``roles``: the optimizer role and lr of every parameter of the attention block (``attnlab.optim.groups``).
- ``cala-range``: the largest ratio of CALA's global kernel φ(LN q)·φ(LN k₁) / φ(LN q)·φ(LN k₂) (φ = elu+1,
  LayerNorm without affine, then times a gain g) over all q, k₁, k₂ (gradient ascent from 64 starts), for g = 1, 2,
  4: how far one key's weight can exceed another's.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from attnlab.tools.common import positive_int, split_train_flags

BASE = "replication/repl_base"


def _model_and_rows(mech: str, flags: list[str], data: str | None, tokenizer: str | None, seq: int):
    from attnlab import configs
    from attnlab.checkpoint.dcp import build_model
    from attnlab.checkpoint.load import args_from_job_config, job_config

    argv = ["--model.attention", mech, *(["--model.hf_assets_path", tokenizer] if tokenizer else []), *flags]
    base = configs.path(BASE)
    args = args_from_job_config(base, argv)
    if data:
        from attnlab.data.loader import build_tokenizer
        from attnlab.tools.eval_ppl import packed_rows

        cfg = job_config(base, argv)
        it = packed_rows(data, cfg, build_tokenizer(cfg), seq)
        x, pos, y = (torch.stack(t) for t in zip(*[next(it) for _ in range(2)]))
    else:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(args.vocab_size, (2, seq + 1), generator=g)
        x, y, pos = tokens[:, :-1], tokens[:, 1:], torch.arange(seq).expand(2, seq)
    torch.manual_seed(0)
    return build_model(args), x, pos, y


@torch.no_grad()
def init_stats(mech: str, flags: list[str], data: str | None, tokenizer: str | None, seq: int) -> dict:
    model, x, pos, y = _model_and_rows(mech, flags, data, tokenizer, seq)
    branch, mixer = [], []
    for block in model.layers.values():
        att = block.attention
        att.register_forward_hook(lambda m, a, o: branch.append(o.pow(2).mean().sqrt().item()))
        out = att.wo if hasattr(att, "wo") else att.o_proj
        out.register_forward_pre_hook(lambda m, a: mixer.append(a[0].pow(2).mean().sqrt().item()))
    loss = F.cross_entropy(model(x, pos).flatten(0, 1), y.flatten()).item()
    n = len(branch)
    return {"mech": mech, "flags": " ".join(flags), "branch_rms_mean": round(sum(branch) / n, 4),
            "branch_rms_first": round(branch[0], 4), "branch_rms_last": round(branch[-1], 4),
            "mixer_rms_mean": round(sum(mixer) / n, 4), "loss_init": round(loss, 3)}


@torch.no_grad()
def hla_range(flags: list[str], data: str | None, tokenizer: str | None, seq: int) -> list[dict]:
    model, x, pos, _ = _model_and_rows("hla", flags, data, tokenizer, seq)
    seen: dict[str, torch.Tensor] = {}
    for name, block in model.layers.items():
        block.attention.o_norm.register_forward_pre_hook(lambda m, a, name=name: seen.__setitem__(name, a[0]))
    model(x, pos)
    starts = pos < 4  # each document's first 4 tokens (positions restart at document starts)
    out = []
    for name, o in seen.items():
        rms = o.float().pow(2).mean(-1).sqrt()  # [B, T, H]
        p = torch.quantile(rms.flatten(), torch.tensor([0.001, 0.01, 0.5, 0.99]))
        out.append({"layer": int(name), "p0.1": f"{p[0]:.1e}", "p1": f"{p[1]:.1e}", "median": f"{p[2]:.2f}",
                    "p99": f"{p[3]:.2f}", "doc_start_median": f"{rms[starts].median():.1e}"})
    return out


def roles(mech: str) -> str:
    from attnlab import configs
    from attnlab.checkpoint.load import args_from_job_config, job_config
    from attnlab.models.model import Transformer
    from attnlab.optim.groups import route_parameters

    argv = ["--model.attention", mech, "--model.n_layers", "1"]
    cfg = job_config(configs.path(BASE), argv)
    with torch.device("meta"):
        model = Transformer(args_from_job_config(configs.path(BASE), argv))
    o = cfg.optimizer
    mult = {"matrix": 1.0, "embed": o.adam_embed_lr_mult, "head": o.adam_head_lr_mult, "norm": o.adam_norm_lr_mult,
            "vector": o.adam_vector_lr_mult}
    return mech + ": " + ", ".join(f"{r.name.removeprefix('layers.0.attention.')} {r.role} {mult[r.role] * o.lr:.1e}"
                                   for r in route_parameters(model, o) if ".attention." in r.name)


def cala_kernel_ratio(gain: float, dim: int = 64, starts: int = 64, steps: int = 1500) -> float:
    """max over q, k1, k2 of φ(g·LN q)·φ(g·LN k1) / φ(g·LN q)·φ(g·LN k2), φ = elu + 1 (gradient ascent)."""
    def phi(t):
        return F.elu(gain * F.layer_norm(t, (dim,))) + 1

    x = torch.randn(3, starts, dim, generator=torch.Generator().manual_seed(0)).requires_grad_()
    opt = torch.optim.Adam([x], lr=0.05)
    for _ in range(steps):
        q, a, b = (phi(t) for t in x)
        log_ratio = ((q * a).sum(-1) / (q * b).sum(-1)).log()
        opt.zero_grad()
        (-log_ratio.sum()).backward()
        opt.step()
    return log_ratio.max().exp().item()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", choices=["init", "hla-range", "roles", "cala-range"])
    p.add_argument("mechs", nargs="?", default="softmax", help="comma-separated mechanisms (init, roles)")
    p.add_argument("--data", default=None, help="validation text for the rows (default: random token ids)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder of --data (model.hf_assets_path)")
    p.add_argument("--seq", type=positive_int, default=1024, help="tokens per row")
    p.epilog = "Flags after `--` go to every model (train.py's --section.key value)."
    argv = list(argv if argv is not None else sys.argv[1:])
    own, flags = split_train_flags(argv)
    a = p.parse_args(own)
    if a.probe == "init":
        for mech in a.mechs.split(","):
            print(json.dumps(init_stats(mech, flags, a.data, a.tokenizer, a.seq)), flush=True)
    elif a.probe == "hla-range":
        for row in hla_range(flags, a.data, a.tokenizer, a.seq):
            print(json.dumps(row), flush=True)
    elif a.probe == "roles":
        for mech in a.mechs.split(","):
            print(roles(mech))
    else:
        for g in (1.0, 2.0, 4.0):
            print(f"gain {g:g}: largest kernel ratio {cala_kernel_ratio(g):.2f}")


if __name__ == "__main__":
    main()
