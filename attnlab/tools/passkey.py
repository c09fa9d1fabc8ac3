"""Passkey retrieval: does the model find a key hidden in filler text, at each prompt length and needle depth?

    python -m attnlab.tools.passkey RUN_OR_STEP_DIR [--step N] [--lengths 1024,2048,4096] [--depths 0,0.25,0.5,0.75,1]
        [--samples 10] [--seed 0] [--batch-size 4] [-o passkey.json] [-- train.py flags, only for runs without
        config.toml]

Every prompt (the passkey test of Mohtashami & Jaggi, "Landmark Attention", 2023) is one document of exactly L
tokens, followed by the key::

    [BOS] There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. ...  (intro)
    The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ...  (filler, repeated)
    The pass key is 71432. Remember it. 71432 is the pass key.        (the needle, at depth d of the filler)
    ... What is the pass key? The pass key is | 71432

A prompt counts as retrieved when the model's greedy continuation is exactly the key's tokens: one forward pass
over prompt + key (teacher forcing) in which every key token is the argmax at its position, which is what greedy
decoding would produce. The pieces are tokenized separately and concatenated, so the key has the same token ids in
the needle and in the answer; the needle goes in at a filler-sentence boundary. Every (length, depth) cell uses
the same ``--samples`` keys (``--seed``). Lengths default to the run's ``training.seq_len`` and its halvings down
to an eighth (those the prompt fits into); the model reads L tokens at positions 0..L-1, as in training.

Prints a table (retrieval accuracy and mean log-probability of the key per length and depth) and one JSON line,
also written to ``-o``.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Template:
    """The prompt's text. ``{key}`` in ``needle`` marks where the key goes; the key's text is ``key_prefix`` + its
    ``key_len`` symbols (drawn from ``alphabet``) joined by ``separator``."""

    intro: str = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz "
                  "you about the pass key.")
    filler: str = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    needle: str = " The pass key is{key}. Remember it.{key} is the pass key."
    question: str = " What is the pass key? The pass key is"
    alphabet: tuple[str, ...] = tuple("0123456789")
    key_len: int = 5
    key_prefix: str = " "
    separator: str = ""

    def key_text(self, symbols: list[str]) -> str:
        return self.key_prefix + self.separator.join(symbols)


@dataclass
class Pieces:
    """One key's prompt pieces as token ids: ``head`` (BOS and the intro), ``needle`` (holding the key),
    ``question``, ``key`` (the answer) and ``unit`` (one filler passage, repeated as needed)."""

    head: list[int]
    needle: list[int]
    question: list[int]
    key: list[int]
    unit: list[int]
    key_text: str

    @property
    def min_length(self) -> int:
        """The shortest prompt length L these pieces fit: every piece once, no filler (the model reads all the
        tokens but the key's last)."""
        return len(self.head) + len(self.needle) + len(self.question) + len(self.key) - 1


@dataclass
class Prompt:
    """``ids``: L + 1 tokens, the L the model reads and then the key's last token; ``key``: the key's A token ids,
    the last A of ``ids``; ``needle_at``: the index in ``ids`` where the needle starts."""

    ids: list[int]
    key: list[int]
    needle_at: int


def tokenize(encode, bos: int | None, symbols: list[str], template: Template = Template()) -> Pieces:
    """The pieces of the prompt for the key ``symbols``; ``encode``: text -> token ids without special tokens,
    ``bos``: the id every training document starts with (None when the tokenizer has none)."""
    key = encode(template.key_text(symbols))
    first, *rest = template.needle.split("{key}")
    needle = encode(first)
    for part in rest:
        needle += key + encode(part)
    unit = encode(template.filler)
    if not key or not unit:
        raise ValueError("the passkey template's key and filler must encode to at least one token each")
    return Pieces(([bos] if bos is not None else []) + encode(template.intro), needle, encode(template.question), key,
                  unit, template.key_text(symbols))


def build_prompt(pieces: Pieces, length: int, depth: float) -> Prompt:
    """The prompt of ``length`` tokens (plus the key's last token) with the needle after a fraction ``depth`` of the
    filler, at the nearest boundary between filler passages (the filler's end when the last passage is cut)."""
    budget = length - pieces.min_length  # filler tokens
    if budget < 0:
        raise ValueError(f"length {length} is shorter than the passkey prompt's {pieces.min_length} tokens")
    n = len(pieces.unit)
    filler = (pieces.unit * (budget // n + 1))[:budget]
    cut = min(round(depth * budget / n) * n, budget)
    ids = pieces.head + filler[:cut] + pieces.needle + filler[cut:] + pieces.question + pieces.key
    return Prompt(ids, pieces.key, len(pieces.head) + cut)


def logits_from(model, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """tokens [B, T] -> logits [B, T - start, V] of positions start..T-1 only: the final norm's output is cut before
    the LM head, so a long prompt's [B, T, V] logits are never built."""
    handle = model.norm.register_forward_hook(lambda module, inputs, out: out[:, start:])
    try:
        return model(tokens)
    finally:
        handle.remove()


@torch.no_grad()
def score(model, prompts: list[Prompt], device="cpu") -> tuple[list[bool], list[float]]:
    """For prompts of one length: whether greedy decoding continues each with exactly its key (every key token is
    the argmax given the prompt and the key tokens before it), and the key's log-probability (summed over its
    tokens)."""
    ids = torch.tensor([p.ids for p in prompts], device=device)  # [B, L + 1]
    n_key = torch.tensor([len(p.key) for p in prompts], device=device)  # [B]
    A, L = int(n_key.max()), ids.shape[1] - 1
    logits = logits_from(model, ids[:, :-1], L - A).float()  # [B, A, V]: predictions of ids' last A tokens
    target = ids[:, -A:]  # [B, A]
    in_key = torch.arange(A, device=device) >= A - n_key[:, None]  # [B, A]: a key's A_b tokens end every row
    hit = (logits.argmax(-1) == target) | ~in_key
    logp = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0] * in_key
    return hit.all(-1).tolist(), logp.sum(-1).tolist()


def draw_keys(n: int, seed: int, template: Template = Template()) -> list[list[str]]:
    """``n`` keys of ``template.key_len`` symbols each, from ``seed``."""
    rng = random.Random(seed)
    return [[rng.choice(template.alphabet) for _ in range(template.key_len)] for _ in range(n)]


def evaluate(model, encode, bos: int | None, lengths: list[int], depths: list[float], keys: list[list[str]],
             batch_size: int = 4, device="cpu", template: Template = Template()) -> list[dict]:
    """One record per (length, depth): the fraction of ``keys`` retrieved and the mean key log-probability."""
    pieces = [tokenize(encode, bos, k, template) for k in keys]
    out = []
    for length in lengths:
        for depth in depths:
            prompts = [build_prompt(p, length, depth) for p in pieces]
            hits, logps = [], []
            for i in range(0, len(prompts), batch_size):
                h, lp = score(model, prompts[i:i + batch_size], device)
                hits += h
                logps += lp
            out.append({"length": length, "depth": depth, "accuracy": sum(hits) / len(hits),
                        "logprob": sum(logps) / len(logps)})
    return out


def table(results: list[dict], lengths: list[int], depths: list[float]) -> str:
    """Accuracy (mean key log-probability) per length (rows) and depth (columns), with the mean over depths."""
    cell = {(r["length"], r["depth"]): r for r in results}
    lines = [f"{'length':>8s} " + " ".join(f"{f'depth {d:.2f}':>15s}" for d in depths) + f" {'mean':>6s}"]
    for n in lengths:
        row = [cell[(n, d)] for d in depths]
        lines.append(f"{n:8d} " + " ".join(f"{r['accuracy']:6.2f} ({r['logprob']:6.2f})" for r in row)
                     + f" {sum(r['accuracy'] for r in row) / len(row):6.2f}")
    return "\n".join(lines)


def _numbers(text: str, kind, flag: str, ap: argparse.ArgumentParser) -> list:
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        ap.error(f"{flag} {text!r}: not a comma list of {kind.__name__}s")


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import non_negative_int, out_file, positive_int, tool_parser

    ap = tool_parser(__doc__)
    ap.add_argument("--lengths", default="", help="comma list of prompt lengths in tokens (default: the run's "
                    "training.seq_len and its halvings down to an eighth, those the prompt fits into)")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                    help="comma list of needle depths in [0, 1]: 0 right after the intro, 1 just before the question")
    ap.add_argument("--samples", type=positive_int, default=10,
                    help="keys per (length, depth); every cell uses the same keys")
    ap.add_argument("--seed", type=non_negative_int, default=0, help="seed of the keys")
    ap.add_argument("--batch-size", type=positive_int, default=4, help="prompts per forward pass")
    ap.add_argument("-o", "--out", type=out_file, default=None, help="also write the JSON here")
    return ap


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    from attnlab.tools.common import load_run, split_train_flags
    from attnlab.tools.eval_ppl import emit

    ap = build_parser()
    own, train_flags = split_train_flags(argv)
    args = ap.parse_args(own)
    depths = _numbers(args.depths, float, "--depths", ap)
    if not all(0 <= d <= 1 for d in depths):
        ap.error(f"--depths {args.depths!r}: every depth must be in [0, 1]")
    lengths = _numbers(args.lengths, int, "--lengths", ap) if args.lengths else []
    for flag, value in (("--samples", args.samples), ("--batch-size", args.batch_size)):
        if value < 1:
            ap.error(f"{flag} {value} must be >= 1")
    from attnlab.data.loader import build_tokenizer
    from attnlab.checkpoint.layout import step_of

    model, cfg, step_dir = load_run(ap, args, train_flags)
    tok = build_tokenizer(cfg)
    encode = lambda text: tok.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    keys = draw_keys(args.samples, args.seed)
    shortest = max(tokenize(encode, tok.bos_id, k).min_length for k in keys)
    trained = cfg.training.seq_len
    if not lengths:
        lengths = [trained >> s for s in (3, 2, 1, 0) if trained >> s >= shortest]
        if not lengths:
            ap.error(f"the run's training.seq_len {trained} is shorter than the passkey prompt's {shortest} tokens; "
                     "pass --lengths")
    elif min(lengths) < shortest:
        ap.error(f"--lengths {args.lengths!r}: {min(lengths)} is shorter than the passkey prompt's {shortest} tokens")
    if max(lengths) > trained:
        print(f"passkey: note: lengths past the trained context of {trained} tokens test extrapolation",
              file=sys.stderr)
    results = evaluate(model, encode, tok.bos_id, lengths, depths, keys, args.batch_size, args.device)
    res = {"checkpoint": str(step_dir), "step": step_of(step_dir), "attention": cfg.model.attention,
           "train_seq_len": trained, "samples": args.samples, "seed": args.seed, "lengths": lengths, "depths": depths,
           "results": results,
           "accuracy_by_length": {str(n): sum(r["accuracy"] for r in results if r["length"] == n) / len(depths)
                                  for n in lengths}}
    print(f"passkey retrieval, {step_dir} ({cfg.model.attention}, trained at {trained} tokens), {args.samples} keys "
          "per cell: accuracy (mean log-probability of the key)")
    print(table(results, lengths, depths))
    emit(res, args.out)
    return res


if __name__ == "__main__":
    main()
