"""Export a checkpoint to a Hugging Face folder (config.json + model.safetensors + tokenizer files).

    python -m scripts.export_hf CKPT DST [--config run.toml] [--dtype bfloat16] [--tokenizer DIR]

CKPT is a DCP step folder (architecture from ``--config``, its ``attnlab.json``, or inferred from shapes for
softmax/Parallax) or an HF folder. An all-softmax Qwen3 model becomes a plain ``Qwen3ForCausalLM`` folder that
``transformers.AutoModelForCausalLM.from_pretrained`` loads with equal logits; other mechanisms add their own
tensors under ``self_attn.`` and the architecture under ``"attnlab"`` in config.json, read back exactly by
``models.hf.load_checkpoint`` (scripts/generate.py and scripts/convert_to_parallax.py accept such folders).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from models.hf import CheckpointError, args_from_job_config, build_model, is_plain_qwen3, load_checkpoint, save_hf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("dst", help="output folder; must not exist")
    ap.add_argument("--config", help="training TOML of the run (architecture of a DCP checkpoint)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--tokenizer", help="folder with tokenizer.json etc. to copy (default: the config's hf_assets_path)")
    a, overrides = ap.parse_known_args(argv)
    try:
        if Path(a.dst).exists():
            raise CheckpointError(f"{a.dst} already exists; choose a new destination")
        args = args_from_job_config(a.config, overrides) if a.config else None
        fmt, args, sd = load_checkpoint(a.ckpt, args, progress=True)
        build_model(args, {k: v.float() for k, v in sd.items()})  # validates names and shapes before writing
        tok = a.tokenizer or (a.ckpt if fmt == "hf" else None)
        save_hf(sd, args, a.dst, DTYPES[a.dtype], tokenizer_dir=tok, progress=True)
    except CheckpointError as e:
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 2
    kind = "Qwen3ForCausalLM (transformers-loadable)" if is_plain_qwen3(args) else f"attnlab {sorted(set(args.layer_mechanisms()))}"
    print(f"wrote {a.dst}: {kind}, {a.dtype}")
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sys.exit(main())
