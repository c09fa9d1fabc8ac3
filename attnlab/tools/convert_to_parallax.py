"""Convert a softmax Transformer checkpoint into Parallax with W_R = 0 (exactly the same function).

    python -m attnlab.tools.convert_to_parallax SRC DST [--step N] [--layers 14-27 | --top-half]
                                          [--rho-gate --gate-bias B] [--no-rope-on-rho]

SRC is a run folder (latest step, or ``--step N``), a DCP step folder (``<dump>/checkpoint/step-N``) or a
Hugging Face Qwen3 safetensors folder; DST is written in the same format. Each converted layer gets ``wr = 0`` (so
ρ = RMSNorm(0) = 0 and Parallax reduces to softmax attention, Parallax paper §5), ``r_norm`` weights
``--rho-norm-init`` (default: the module's, ``attention.parallax.rho_norm_init``; 1 is the paper's recipe as written)
and, with ``--rho-gate``, a gate with zero weights and bias ``--gate-bias``. Before anything is written both
models run on a fixed batch in float32; DST is written only if max |Δlogits| ≤ ``--tol`` (1e-5). Any failure writes
nothing.

A DCP folder records no architecture: it is read from the run's ``config.toml``, else the folder's
``attnlab.json`` (the trainer writes one into every step folder, mask type included), else inferred from tensor
shapes (pass ``--rope-theta`` / ``--norm-eps`` / ``--attn-mask-type`` when the run changed them). The DCP output
is a model-only checkpoint for ``checkpoint.initial_load_path``: the tool prints the train.py command that fine-tunes
it with attnlab/configs/convert_finetune_parallax.toml, with the converted architecture (flavor and sizes, vocabulary,
layer pattern, ``rope_on_rho``, ``rho_gate``, …), the run's tokenizer, and the run's data, sizes and precision as
flags, into a dump folder of its own (``DST-finetune``), so it runs on the machine that trained the source and never
resumes another conversion's fine-tune.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from attnlab.checkpoint.convert import finetune_command, max_logit_diff
from attnlab.checkpoint.dcp import save_dcp_state, CheckpointError
from attnlab.checkpoint.hf import save_hf


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import (ToolParser, add_checkpoint_arguments, add_conversion_arguments,
                                      add_tokenizer_argument, new_path, positive_float)

    ap = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(ap, "src")
    ap.add_argument("dst", type=new_path, help="output folder (same format as SRC); must not exist")
    add_conversion_arguments(ap)
    ap.add_argument("--rope-theta", type=positive_float, default=1e6,
                    help="RoPE base of a DCP source without attnlab.json")
    ap.add_argument("--norm-eps", type=positive_float, default=1e-6,
                    help="RMSNorm eps of a DCP source without attnlab.json")
    ap.add_argument("--attn-mask-type", choices=["causal", "block_causal"], default="causal",
                    help="attention mask of a DCP source without attnlab.json (model.attn_mask_type of its run)")
    ap.add_argument("--tol", type=positive_float, default=1e-5, help="max |Δlogits| (float32) allowed before writing")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_tokenizer_argument(ap, "folder with the tokenizer.json the weights were trained with, written beside a "
                               "Hugging Face DST and named by the fine-tune command (default: the run's tokenizer/, "
                               "the Hugging Face folder's own)")
    return ap


def main(argv=None) -> int:
    from attnlab.checkpoint.layout import resolve
    from attnlab.checkpoint.load import load_tool_checkpoint
    from attnlab.tools.common import checkpoint_tokenizer, convert_from_arguments

    ap = build_parser()
    a = ap.parse_args(argv)
    progress = not a.no_progress
    try:
        dst = Path(a.dst)
        if dst.exists():
            raise CheckpointError(f"{dst} already exists; choose a new destination")
        src = resolve(a.src, a.step)
        fmt, args, sd, src_cfg = load_tool_checkpoint(src, progress=progress, rope_theta=a.rope_theta,
                                                      norm_eps=a.norm_eps, attn_mask_type=a.attn_mask_type)
        tok = checkpoint_tokenizer(src, src_cfg, a.tokenizer, args.vocab_size, required=False)
        layers, new_args, new_sd = convert_from_arguments(args, sd, a, progress)
        diff = max_logit_diff(args, sd, new_args, new_sd)
        if not diff <= a.tol:
            raise CheckpointError(f"converted model disagrees with the source: max |Δlogits| = {diff:.3g} > {a.tol:g}; "
                                  "nothing written")
        if fmt == "dcp":
            save_dcp_state(new_sd, dst, new_args)
        else:
            dtype = next(iter(sd.values())).dtype
            save_hf(new_sd, new_args, dst, dtype=dtype, tokenizer_dir=tok, progress=progress)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"convert_to_parallax: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {fmt} checkpoint {dst}: layers {layers[0]}-{layers[-1]} ({len(layers)}/{args.n_layers}) now "
          f"Parallax with W_R = 0; max |Δlogits| = {diff:.2e}")
    if fmt == "dcp":
        try:
            print(f"fine-tune: {finetune_command(new_args, dst, tok, src_cfg)}")
        except CheckpointError as e:  # no flavor has the checkpoint's RMSNorm eps
            print(f"fine-tune: no train.py command rebuilds this model ({e})")
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sys.exit(main())
