"""Generate text from a checkpoint with the decode caches (KV cache for softmax/Parallax, recurrent states for
the linear family), printing the text and tokens/s.

    python -m attnlab.tools.generate CKPT [--step N] --prompt "Once upon a time" [--max-new-tokens 64]
                               [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--greedy] [--tokenizer DIR]

CKPT: a run folder (latest step, or ``--step N``), a ``checkpoint/step-N`` folder, or an HF folder
(attnlab/tools/export_hf.py or a Qwen3 download). Architecture: ``--config`` (a training TOML), else the run's
``config.toml``, else the folder's own record (HF config.json / attnlab.json), else inferred from shapes for
softmax/Parallax. Tokenizer: ``--tokenizer DIR`` with tokenizer.json (default: the run's ``tokenizer/``, the HF
folder, or the config's ``model.hf_assets_path``); ``--tokenizer ids`` reads the prompt as space-separated
token ids.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

from attnlab.models.decode import generate
from attnlab.checkpoint.dcp import build_model, CheckpointError
from attnlab.checkpoint.layout import resolve
from attnlab.checkpoint.load import load_tool_checkpoint
from attnlab.tools.common import TOKENIZER_HELP, add_checkpoint_arguments, add_tokenizer_argument, checkpoint_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Tok:
    """tokenizer.json (HF ``tokenizers``) with BOS/EOS from tokenizer_config.json, or raw ids."""

    def __init__(self, where: str | None):
        self.tok, self.bos, self.eos = None, None, None
        if where in (None, "ids"):
            return
        from tokenizers import Tokenizer

        d = Path(where)
        if not (d / "tokenizer.json").is_file():
            raise CheckpointError(f"no tokenizer.json in {d}; pass --tokenizer DIR or --tokenizer ids")
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        tid = lambda t: None if t is None else self.tok.token_to_id(t if isinstance(t, str) else t.get("content"))  # noqa: E731
        self.bos, self.eos = tid(cfg.get("bos_token")), tid(cfg.get("eos_token"))

    def encode(self, text: str) -> list[int]:
        if self.tok is None:
            return [int(t) for t in text.split()]
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos] if self.bos is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids)) if self.tok is None else self.tok.decode(ids)


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.attention.ops.common import IMPLS
    from attnlab.tools.common import (ToolParser, add_device_argument, existing_file, non_negative_int, positive_float,
                                      positive_int, probability)

    ap = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(ap)
    ap.add_argument("--prompt", required=True, help="text to continue (token ids with --tokenizer ids)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens generated after the prompt")
    ap.add_argument("--temperature", type=positive_float, default=1.0, help="softmax temperature of sampling")
    ap.add_argument("--top-k", type=non_negative_int, default=0, help="keep the k most likely tokens (0 = all)")
    ap.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (1 = off)")
    ap.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature/top-k/top-p)")
    ap.add_argument("--num-samples", type=positive_int, default=1,
                    help="sequences generated in parallel from the prompt")
    ap.add_argument("--seed", type=non_negative_int, default=0, help="sampling seed")
    ap.add_argument("--config", type=existing_file,
                    help="training TOML giving the architecture (default: the run's config.toml)")
    add_tokenizer_argument(ap, TOKENIZER_HELP + "; 'ids' reads the prompt as space-separated token ids", ids=True)
    add_device_argument(ap)
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--impl", choices=IMPLS,
                    help="override [attention] impl (auto picks the Triton decode kernel on CUDA)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        ckpt = resolve(a.ckpt, a.step)
        fmt, args, sd, cfg = load_tool_checkpoint(ckpt, a.config)
        if a.impl:
            args.attn_impl = a.impl
        ids_only = a.tokenizer == "ids"
        tok = _Tok("ids" if ids_only else str(checkpoint_tokenizer(ckpt, cfg, a.tokenizer, args.vocab_size)))
        dtype = DTYPES[a.dtype] if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
        model = build_model(args, {k: v.float() for k, v in sd.items()}, device=a.device, dtype=dtype)
        ids = tok.encode(a.prompt)
        if not ids:
            raise CheckpointError("the prompt encodes to no tokens")
        if max(ids) >= args.vocab_size:
            raise CheckpointError(f"prompt token {max(ids)} is outside the model's vocabulary ({args.vocab_size})")
    except (CheckpointError, FileNotFoundError) as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    if len(ids) + a.max_new_tokens > args.max_seq_len:  # the caches and RoPE table grow; the model never saw this
        print(f"generate: warning: the prompt ({len(ids)} tokens) + --max-new-tokens {a.max_new_tokens} = "
              f"{len(ids) + a.max_new_tokens} tokens goes past the trained context of {args.max_seq_len} tokens "
              "(model.max_seq_len = training.seq_len); text beyond it is out of distribution", file=sys.stderr)
    prompt = torch.tensor([ids] * a.num_samples, device=a.device)
    gen = torch.Generator(device=a.device).manual_seed(a.seed)
    res = generate(model, prompt, a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                   greedy=a.greedy, eos_id=tok.eos, generator=gen)
    for row in res.tokens.tolist():
        print(tok.decode(row))
        print("-" * 40)
    print(f"{res.new_tokens} new tokens x {a.num_samples}: prefill {len(ids)} tokens {res.prefill_s * 1e3:.1f} ms, "
          f"decode {res.tokens_per_s:.1f} tokens/s ({args.layer_mechanisms()[0]}"
          f"{'…' if len(set(args.layer_mechanisms())) > 1 else ''}, {a.device}, {str(dtype).removeprefix('torch.')})")
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sys.exit(main())
