"""Export a checkpoint to a Hugging Face folder (config.json + model.safetensors + tokenizer files).

    python -m attnlab.tools.export_hf CKPT DST [--step N] [--config run.toml] [--dtype bfloat16] [--tokenizer DIR]

CKPT is a run folder (latest step, or ``--step N``), a ``checkpoint/step-N`` folder or an HF folder. The
architecture comes from ``--config`` (a training TOML), else the run's ``config.toml``, else the folder's
``attnlab.json``, else the tensor shapes (softmax/Parallax). The tokenizer written is ``--tokenizer``, else the
run's ``tokenizer/`` or the config's ``model.hf_assets_path``, saved by transformers so that it prepends the BOS
training prepends to every document (``attnlab.checkpoint.hf.save_hf_tokenizer``). An all-softmax Qwen3 model becomes a
plain ``Qwen3ForCausalLM`` folder that ``transformers.AutoModelForCausalLM.from_pretrained`` loads with equal logits;
other mechanisms add their own tensors under ``self_attn.`` and the architecture under ``"attnlab"`` in
config.json, read back exactly by ``attnlab.checkpoint.load.load_checkpoint`` (attnlab/tools/generate.py and
attnlab/tools/convert_to_parallax.py accept such folders). Softmax-with-options and Parallax folders also carry a
standalone remote-code model: ``AutoModelForCausalLM.from_pretrained(DST, trust_remote_code=True)`` loads them
(and so does lm-eval's ``hf`` model with ``trust_remote_code=True``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from attnlab.checkpoint.dcp import build_model, CheckpointError
from attnlab.checkpoint.hf import has_remote_code, is_plain_qwen3, save_hf
from attnlab.checkpoint.layout import resolve
from attnlab.checkpoint.load import load_tool_checkpoint
from attnlab.tools.common import TOKENIZER_HELP, add_checkpoint_arguments, add_tokenizer_argument, checkpoint_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import ToolParser, existing_file, new_path

    ap = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(ap)
    ap.add_argument("dst", type=new_path, help="output folder; must not exist")
    ap.add_argument("--config", type=existing_file,
                    help="training TOML giving the architecture (default: the run's config.toml)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the written tensors")
    add_tokenizer_argument(ap, TOKENIZER_HELP + "; copied into DST (none: the export has no tokenizer)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        if Path(a.dst).exists():
            raise CheckpointError(f"{a.dst} already exists; choose a new destination")
        ckpt = resolve(a.ckpt, a.step)
        fmt, args, sd, cfg = load_tool_checkpoint(ckpt, a.config, progress=True)
        build_model(args, {k: v.float() for k, v in sd.items()})  # validates names and shapes before writing
        tok = checkpoint_tokenizer(ckpt, cfg, a.tokenizer, args.vocab_size, required=False)
        save_hf(sd, args, a.dst, DTYPES[a.dtype], tokenizer_dir=tok, progress=True)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 2
    kind = ("Qwen3ForCausalLM (transformers-loadable)" if is_plain_qwen3(args) else
            f"attnlab {sorted(set(args.layer_mechanisms()))}"
            + (" (transformers-loadable with trust_remote_code=True)" if has_remote_code(args) else ""))
    print(f"wrote {a.dst}: {kind}, {a.dtype}, tokenizer {'from ' + str(tok) if tok else 'none'}")
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sys.exit(main())
