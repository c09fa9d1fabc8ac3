"""Convert a softmax Transformer checkpoint into Parallax with W_R = 0 (exactly the same function).

    python scripts/convert_to_parallax.py SRC DST [--layers 14-27 | --top-half] [--rho-gate --gate-bias B]
                                          [--no-rope-on-rho]

SRC is a run's DCP step folder (``<dump>/checkpoint/step-N``) or a Hugging Face Qwen3 safetensors folder; DST
is written in the same format. Each converted layer gets ``wr = 0`` (so ρ = RMSNorm(0) = 0 and Parallax
reduces to softmax attention, spec ``parallax.md`` §1), ``r_norm`` weights 1 and, with ``--rho-gate``, a gate
with zero weights and bias ``--gate-bias``. Before anything is written both models run on a fixed batch in
float32; DST is written only if max |Δlogits| ≤ ``--tol`` (1e-5). Any failure writes nothing.

A DCP folder records no architecture: it is read from the folder's ``attnlab.json`` (the trainer writes one
into every step folder, mask type included) when present, else inferred from tensor shapes (pass
``--rope-theta`` / ``--norm-eps`` / ``--attn-mask-type`` when the run changed them). The DCP output
is a model-only checkpoint for ``checkpoint.initial_load_path`` (see configs/convert_finetune_parallax.toml).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import warnings  # noqa: E402

import torch  # noqa: E402

import attention  # noqa: E402
from models.hf import CheckpointError, build_model, load_checkpoint, save_dcp_state, save_hf, _bar  # noqa: E402


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """"14-27" / "0,2,5-7" -> sorted layer indices, each in [0, n_layers)."""
    out = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            out.update(range(int(lo), int(hi if hi else lo) + 1))
    except ValueError:
        raise CheckpointError(f"--layers {spec!r}: expected ranges like '14-27' or '0,2,5-7'") from None
    bad = sorted(i for i in out if not 0 <= i < n_layers)
    if bad or not out:
        raise CheckpointError(f"--layers {spec!r}: layers {bad or '(none)'} outside 0-{n_layers - 1}")
    return sorted(out)


def convert_state(args, sd, layers, rope_on_rho=True, rho_gate=False, gate_bias=0.0, progress=False):
    """(new ModelArgs, new state dict): ``layers`` become Parallax with W_R = 0. Every converted layer must be
    softmax attention; other mechanisms stay as they are."""
    mechs = args.layer_mechanisms()
    not_softmax = [(i, mechs[i]) for i in layers if mechs[i] != "softmax"]
    if not_softmax:
        raise CheckpointError(f"layers {[i for i, _ in not_softmax]} are {sorted({m for _, m in not_softmax})}, "
                              "not softmax attention; only softmax layers convert to Parallax")
    sm = args.attention_options["softmax"]
    popts = attention.get_mechanism("parallax").options(
        window_size=sm.window_size, qk_norm=sm.qk_norm, rope_on_rho=rope_on_rho, rho_gate=rho_gate,
        rho_gate_bias=gate_bias, wr_init="zero")
    if "parallax" in args.attention_options:
        old = args.attention_options["parallax"]
        if (old.rope_on_rho, old.rho_gate, old.window_size, old.qk_norm) != (rope_on_rho, rho_gate, sm.window_size, sm.qk_norm):
            raise CheckpointError("the source already has Parallax layers with different options "
                                  f"({old}); convert with matching --rho-gate/--no-rope-on-rho")
    new_mechs = ["parallax" if i in layers else m for i, m in enumerate(mechs)]
    import dataclasses
    new_args = dataclasses.replace(args, attention=new_mechs[0],
                                   layer_pattern=new_mechs if len(set(new_mechs)) > 1 else [],
                                   attention_options={**{k: v for k, v in args.attention_options.items()
                                                         if k in set(new_mechs)}, "parallax": popts})
    if "softmax" not in new_mechs:
        new_args.attention_options.pop("softmax", None)
    out = dict(sd)
    HD, dim = args.n_heads * args.head_dim, args.dim
    for i in _bar(layers, "convert", progress):
        p = f"layers.{i}.attention."
        dtype = sd[f"{p}wq.weight"].dtype
        out[f"{p}wr.weight"] = torch.zeros(HD, dim, dtype=dtype)
        out[f"{p}r_norm.weight"] = torch.ones(args.head_dim, dtype=dtype)
        if rho_gate:
            out[f"{p}r_gate.weight"] = torch.zeros(args.n_heads, dim, dtype=dtype)
            out[f"{p}r_gate.bias"] = torch.full((args.n_heads,), float(gate_bias), dtype=dtype)
    return new_args, out


@torch.no_grad()
def max_logit_diff(args_a, sd_a, args_b, sd_b, seq_len: int = 32, batch: int = 2, seed: int = 0) -> float:
    """max |logits_a − logits_b| of the two models on one fixed random batch, float32."""
    fp32 = lambda sd: {k: v.float() for k, v in sd.items()}  # noqa: E731
    a = build_model(args_a, fp32(sd_a))
    b = build_model(args_b, fp32(sd_b))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args_a.vocab_size, (batch, min(seq_len, args_a.max_seq_len)), generator=g)
    return (a(tokens) - b(tokens)).abs().max().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="DCP step folder or Hugging Face Qwen3 folder (softmax Transformer)")
    ap.add_argument("dst", help="output folder (same format as SRC); must not exist")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--layers", help="layers to convert, e.g. '14-27' or '0,2,5-7' (default: all)")
    which.add_argument("--top-half", action="store_true", help="convert layers n_layers//2 .. n_layers-1")
    ap.add_argument("--rho-gate", action="store_true", help="add the per-head sigmoid gate on ρ (weights 0)")
    ap.add_argument("--gate-bias", type=float, default=0.0, help="initial gate bias (σ(bias) = initial gate)")
    ap.add_argument("--no-rope-on-rho", action="store_true", help="do not apply RoPE to ρ")
    ap.add_argument("--rope-theta", type=float, default=1e6, help="RoPE base of a DCP source without attnlab.json")
    ap.add_argument("--norm-eps", type=float, default=1e-6, help="RMSNorm eps of a DCP source without attnlab.json")
    ap.add_argument("--attn-mask-type", choices=["causal", "block_causal"], default="causal",
                    help="attention mask of a DCP source without attnlab.json (model.attn_mask_type of its run)")
    ap.add_argument("--tol", type=float, default=1e-5, help="max |Δlogits| (float32) allowed before writing")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    progress = not a.no_progress
    try:
        dst = Path(a.dst)
        if dst.exists():
            raise CheckpointError(f"{dst} already exists; choose a new destination")
        if not dst.parent.is_dir():
            raise CheckpointError(f"{dst.parent} does not exist")
        fmt, args, sd = load_checkpoint(a.src, progress=progress, rope_theta=a.rope_theta, norm_eps=a.norm_eps,
                                        attn_mask_type=a.attn_mask_type)
        if a.top_half:
            layers = list(range(args.n_layers // 2, args.n_layers))
        elif a.layers:
            layers = parse_layers(a.layers, args.n_layers)
        else:
            layers = list(range(args.n_layers))
        new_args, new_sd = convert_state(args, sd, layers, not a.no_rope_on_rho, a.rho_gate, a.gate_bias, progress)
        diff = max_logit_diff(args, sd, new_args, new_sd)
        if not diff <= a.tol:
            raise CheckpointError(f"converted model disagrees with the source: max |Δlogits| = {diff:.3g} > {a.tol:g}; "
                                  "nothing written")
        if fmt == "dcp":
            save_dcp_state(new_sd, dst, new_args)
        else:
            dtype = next(iter(sd.values())).dtype
            save_hf(new_sd, new_args, dst, dtype=dtype, tokenizer_dir=a.src, progress=progress)
    except CheckpointError as e:
        print(f"convert_to_parallax: error: {e}", file=sys.stderr)
        return 2
    pattern = new_args.layer_mechanisms()
    print(f"wrote {fmt} checkpoint {dst}: layers {layers[0]}-{layers[-1]} ({len(layers)}/{args.n_layers}) now "
          f"Parallax with W_R = 0; max |Δlogits| = {diff:.2e}")
    if fmt == "dcp":
        lp = "" if len(set(pattern)) == 1 else " --model.layer_pattern " + ",".join(pattern)
        print(f"fine-tune: python train.py --job.config_file configs/convert_finetune_parallax.toml "
              f"--checkpoint.initial_load_path {dst}{lp}")
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sys.exit(main())
