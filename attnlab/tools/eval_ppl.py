"""Perplexity of a checkpoint on a local or hub text set, packed exactly as the trainer's validation packs it.

    python -m attnlab.tools.eval_ppl RUN_OR_STEP_DIR [--step N] --data val.jsonl.gz [--seq-len 512 --batch-size 8]
        [--max-rows 0] [--by-position [--edges 0,64,512,...]] [-o ppl.json] [-- train.py flags, only for runs
        without config.toml]

The model is rebuilt from the run's ``config.toml`` (and its ``tokenizer/``), so it is the architecture that
was trained; a checkpoint whose tensors do not fit it is an error.

Documents are tokenized with BOS/EOS and packed into rows of ``seq_len + 1`` tokens (``data.loader.
PackedTextDataset``); with ``model.attn_mask_type = "block_causal"`` documents in a row do not see each other.
The loss is the mean next-token cross-entropy over every scored token (the trailing partial row is dropped);
ppl = exp(loss). Prints one JSON line and optionally writes it to ``-o``.

``--by-position`` also gives the loss of the tokens by how much context the model had when it predicted them:
the 0-based position p of the input token in what its mask lets it see (the row index under a causal mask, the
position inside its document under ``block_causal``), in buckets [edges[k], edges[k+1]) (default 0, 1, 2, 4, 8,
..., seq_len: log-spaced). A loss that keeps falling into the last buckets means the model uses the whole context.
It prints a table of the buckets before the JSON line, whose ``by_position`` list holds them. Documents shorter
than seq_len leave the far buckets of a ``block_causal`` run sparse (their ``tokens`` say how sparse): evaluate
long documents, or pass ``-- --model.attn_mask_type causal`` to score packed rows as one context each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F


def packed_rows(spec: str, cfg, tokenizer, seq_len: int):
    """Yields (input [T], positions [T], labels [T]) rows from the text set ``spec``."""
    from attnlab.data.loader import PackedTextDataset
    from attnlab.data.sources import open_text_dataset

    local = os.path.exists(spec) or any(c in spec for c in "*?[")
    ds, field = open_text_dataset(spec, "--data", local=local, text_field=cfg.data.text_field,
                                  split=cfg.data.hub_split, streaming=None if local else True)
    dataset = PackedTextDataset(ds, field, spec, tokenizer, seq_len, 0, 1, infinite=False, repeatable=True)
    for inputs, labels in dataset:
        yield inputs["input"], inputs["positions"], labels


def position_edges(seq_len: int) -> list[int]:
    """Log-spaced bucket edges over positions 0..seq_len-1: 0, 1, 2, 4, ..., the powers of two below seq_len,
    then seq_len."""
    return [0] + [1 << i for i in range(max(seq_len - 1, 0).bit_length()) if 1 << i < seq_len] + [seq_len]


@torch.no_grad()
def evaluate(model, rows, batch_size: int, max_rows: int = 0, device="cpu", progress: bool = True,
             edges: list[int] | None = None) -> dict:
    """Mean cross-entropy over every label of the first ``max_rows`` rows (0 = all). With ``edges`` (ascending,
    from 0) also ``by_position``: per bucket [edges[k], edges[k+1]) of the context position (module docstring),
    its tokens, mean loss and ppl; positions at or past the last edge fall in no bucket."""
    from tqdm import tqdm

    total, count, n_rows = 0.0, 0, 0
    block = model.model_args.attn_mask_type == "block_causal"
    if edges is not None:
        bounds = torch.tensor(edges, device=device)
        sums = torch.zeros(len(edges) + 1, dtype=torch.float64, device=device)  # [under, bucket 0.., past]
        counts = torch.zeros(len(edges) + 1, dtype=torch.int64, device=device)
    bar = tqdm(total=max_rows or None, unit="row", disable=not progress, desc="eval")
    batch: list = []

    def flush():
        nonlocal total, count
        x, pos, y = (torch.stack(t).to(device) for t in zip(*batch))
        logits = model(x, pos).float()
        nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")  # [B·T]
        total += float(nll.sum())
        count += y.numel()
        if edges is not None:  # the context the mask gives each input token (Transformer.context)
            seen = pos if block else torch.arange(x.shape[1], device=device).expand_as(x)
            k = torch.bucketize(seen.flatten(), bounds, right=True)  # 1 + the bucket index; len(edges) past the end
            sums.index_add_(0, k, nll.double())
            counts.index_add_(0, k, torch.ones_like(k))
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
    res = {"loss": loss, "ppl": math.exp(loss), "tokens": count, "rows": n_rows}
    if edges is not None:
        res["by_position"] = [
            {"start": a, "end": b, "tokens": int(n),
             "loss": float(s / n) if n else None, "ppl": math.exp(min(float(s / n), 50.0)) if n else None}
            for a, b, s, n in zip(edges, edges[1:], sums[1:-1].tolist(), counts[1:-1].tolist())]
    return res


def position_table(buckets: list[dict]) -> str:
    """The ``by_position`` buckets as a text table: positions, tokens, loss, ppl."""
    lines = [f"{'positions':>17s} {'tokens':>10s} {'loss':>8s} {'ppl':>10s}"]
    for b in buckets:
        stats = f"{b['loss']:8.4f} {b['ppl']:10.3f}" if b["tokens"] else f"{'-':>8s} {'-':>10s}"
        lines.append(f"{b['start']:>8d}-{b['end'] - 1:<8d} {b['tokens']:10d} {stats}")
    return "\n".join(lines)


def parse_edges(text: str, seq_len: int, ap: argparse.ArgumentParser) -> list[int]:
    """``--edges`` "0,64,512": ascending integers from 0; empty = :func:`position_edges`."""
    if not text:
        return position_edges(seq_len)
    try:
        edges = [int(e) for e in text.split(",")]
    except ValueError:
        ap.error(f"--edges {text!r}: not a comma list of integers")
    if edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        ap.error(f"--edges {text!r}: must start at 0 and increase")
    return edges


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import non_negative_int, out_file, positive_int, tool_parser

    ap = tool_parser(__doc__)
    ap.add_argument("--data", required=True, help="local file/folder/glob (.jsonl/.parquet/.txt[.gz]) or hub dataset")
    ap.add_argument("--seq-len", type=non_negative_int, default=0, help="0 = the run's validation.seq_len")
    ap.add_argument("--batch-size", type=positive_int, default=8, help="rows per forward pass")
    ap.add_argument("--max-rows", type=non_negative_int, default=0, help="evaluate at most this many rows (0 = all)")
    ap.add_argument("--by-position", action="store_true",
                    help="also the loss by context position, in log-spaced buckets up to the sequence length")
    ap.add_argument("--edges", default="",
                    help="with --by-position: bucket edges, a comma list from 0 (default 0,1,2,4,...,seq_len)")
    ap.add_argument("-o", "--out", type=out_file, default=None, help="also write the JSON here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    from attnlab.tools.common import load_run, split_train_flags

    ap = build_parser()
    own, train_flags = split_train_flags(argv)
    args = ap.parse_args(own)
    if args.edges and not args.by_position:
        ap.error("--edges needs --by-position")
    from attnlab.data.loader import build_tokenizer
    from attnlab.checkpoint.layout import step_of

    model, cfg, step_dir = load_run(ap, args, train_flags)
    seq_len = args.seq_len or cfg.validation.seq_len
    edges = parse_edges(args.edges, seq_len, ap) if args.by_position else None
    rows = packed_rows(args.data, cfg, build_tokenizer(cfg), seq_len)
    res = evaluate(model, rows, args.batch_size, args.max_rows, args.device, not args.no_progress, edges)
    res.update(checkpoint=str(step_dir), step=step_of(step_dir), data=args.data, seq_len=seq_len,
               attention=cfg.model.attention, attn_mask_type=cfg.model.attn_mask_type)
    if edges is not None:
        if seq_len > cfg.training.seq_len:
            print(f"eval_ppl: note: positions past the trained context of {cfg.training.seq_len} tokens (up to "
                  f"--seq-len {seq_len}) test extrapolation", file=sys.stderr)
        print(f"loss by context position ({cfg.model.attn_mask_type} mask, seq_len {seq_len}):")
        print(position_table(res["by_position"]))
    emit(res, args.out)
    return res



def emit(res: dict, out: str | None) -> None:
    """Print ``res`` as one JSON line, and write it to ``out`` (parent folders created) when given."""
    line = json.dumps(res)
    print(line)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
