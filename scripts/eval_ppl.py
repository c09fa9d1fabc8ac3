"""Perplexity of a checkpoint on a local or hub text set, packed exactly as the trainer's validation packs it.

    python -m scripts.eval_ppl RUN_OR_STEP_DIR [--step N] --data val.jsonl.gz [--seq-len 512 --batch-size 8]
        [--max-rows 0] [-o ppl.json] [-- train.py flags, only for runs without config.toml]

The model is rebuilt from the run's ``config.toml`` (and its ``tokenizer/``), so it is the architecture that
was trained; a checkpoint whose tensors do not fit it is an error.

Documents are tokenized with BOS/EOS and packed into rows of ``seq_len + 1`` tokens (``data.loader.
PackedTextDataset``); with ``model.attn_mask_type = "block_causal"`` documents in a row do not see each other.
The loss is the mean next-token cross-entropy over every scored token (the trailing partial row is dropped);
ppl = exp(loss). Prints one JSON line and optionally writes it to ``-o``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

import torch
import torch.nn.functional as F


def packed_rows(spec: str, cfg, tokenizer, seq_len: int):
    """Yields (input [T], positions [T], labels [T]) rows from the text set ``spec``."""
    from data.loader import PackedTextDataset
    from data.sources import open_text_dataset

    local = os.path.exists(spec) or any(c in spec for c in "*?[")
    ds, field = open_text_dataset(spec, "--data", local=local, text_field=cfg.data.text_field,
                                  split=cfg.data.hub_split, streaming=None if local else True)
    dataset = PackedTextDataset(ds, field, spec, tokenizer, seq_len, 0, 1, infinite=False, repeatable=True)
    for inputs, labels in dataset:
        yield inputs["input"], inputs["positions"], labels


@torch.no_grad()
def evaluate(model, rows, batch_size: int, max_rows: int = 0, device="cpu", progress: bool = True) -> dict:
    """Mean cross-entropy over every label of the first ``max_rows`` rows (0 = all)."""
    from tqdm import tqdm

    total, count, n_rows = 0.0, 0, 0
    bar = tqdm(total=max_rows or None, unit="row", disable=not progress, desc="eval")
    batch: list = []

    def flush():
        nonlocal total, count
        x, pos, y = (torch.stack(t).to(device) for t in zip(*batch))
        logits = model(x, pos).float()
        total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
        count += y.numel()
        bar.update(len(batch))
        bar.set_postfix(ppl=f"{math.exp(min(total / count, 50)):.3f}")
        batch.clear()

    for row in rows:
        batch.append(row)
        n_rows += 1
        if len(batch) == batch_size:
            flush()
        if max_rows and n_rows >= max_rows:
            break
    if batch:
        flush()
    bar.close()
    if count == 0:
        raise ValueError("--data yielded no complete row; lower --seq-len")
    loss = total / count
    return {"loss": loss, "ppl": math.exp(loss), "tokens": count, "rows": n_rows}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    from models.run_folder import TRAIN_FLAGS_HELP, add_checkpoint_arguments, resolve, split_train_flags

    own, train_flags = split_train_flags(argv)
    ap = argparse.ArgumentParser(description=__doc__, epilog=TRAIN_FLAGS_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(ap, hf=False)
    ap.add_argument("--data", required=True, help="local file/folder/glob (.jsonl/.parquet/.txt[.gz]) or hub dataset")
    ap.add_argument("--seq-len", type=int, default=0, help="0 = the run's validation.seq_len")
    ap.add_argument("--batch-size", type=int, default=8, help="rows per forward pass")
    ap.add_argument("--max-rows", type=int, default=0, help="evaluate at most this many rows (0 = all)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    ap.add_argument("-o", "--out", default=None, help="also write the JSON here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(own)
    from data.loader import build_tokenizer
    from models.checkpoint_io import load_model
    from models.run_folder import step_of
    from models.hf import CheckpointError

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        ckpt = resolve(args.ckpt, args.step, dcp_only=True)
    except FileNotFoundError as e:
        ap.error(str(e))
    try:
        model, cfg, step_dir = load_model(ckpt.path, ckpt.config_argv(train_flags), device=args.device,
                                          dtype=getattr(torch, args.dtype))
    except CheckpointError as e:  # nothing describes the run, a corrupt shard, weights that do not fit
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    seq_len = args.seq_len or cfg.validation.seq_len
    ckpt.use_tokenizer(cfg)
    rows = packed_rows(args.data, cfg, build_tokenizer(cfg), seq_len)
    res = evaluate(model, rows, args.batch_size, args.max_rows, args.device, not args.no_progress)
    res.update(checkpoint=str(step_dir), step=step_of(step_dir), data=args.data, seq_len=seq_len,
               attention=cfg.model.attention)
    line = json.dumps(res)
    print(line)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return res


if __name__ == "__main__":
    main()
