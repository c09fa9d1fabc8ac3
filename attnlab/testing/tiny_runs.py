"""A tiny word-level corpus and tokenizer, the ``train.py`` arguments for a debug-flavor run on it, and a run's
metrics read back. Used by ``attnlab/tools/multigpu_check.py`` and the tests, which train real (tiny) runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

from attnlab import configs

WORDS = [f"w{i}" for i in range(60)]


def make_corpus(root: Path, seq_len: int = 16, n_train: int = 64, n_val: int = 8) -> dict[str, str]:
    """Documents of exactly ``seq_len - 1`` words, so with BOS+EOS each fills one packed row of ``seq_len+1``
    tokens (data-parallel runs then see the same rows as one process). Returns paths for the config."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root.mkdir(parents=True, exist_ok=True)
    vocab = {"<|bos|>": 0, "<|eos|>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}))
    rng = random.Random(0)
    for name, n in (("train", n_train), ("val", n_val)):
        with open(root / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                # a learnable pattern: each word is followed by its successor most of the time
                w = [rng.randrange(len(WORDS))]
                for _ in range(seq_len - 2):
                    w.append((w[-1] + 1) % len(WORDS) if rng.random() < 0.8 else rng.randrange(len(WORDS)))
                f.write(json.dumps({"text": " ".join(WORDS[i] for i in w)}) + "\n")
    return {"tokenizer": str(root), "train": str(root / "train.jsonl"), "val": str(root / "val.jsonl")}


def tiny_args(corpus: dict[str, str], dump: Path, steps: int, seq_len: int = 16, batch: int = 2, *extra: str) -> list[str]:
    return [
        "--job.config_file", str(configs.path("debug_cpu")), "--job.dump_folder", str(dump),
        "--model.hf_assets_path", corpus["tokenizer"], "--training.dataset_path", corpus["train"],
        "--validation.dataset_path", corpus["val"], "--training.seq_len", str(seq_len),
        "--validation.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
        "--validation.local_batch_size", "2", "--validation.steps", "2", "--validation.freq", "1000",
        "--training.steps", str(steps), "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard",
        "--lr_scheduler.warmup_steps", "1", "--model.vocab_size", "64", "--debug.deterministic",
        "--checkpoint.interval", "1000", *extra,
    ]


def read_metrics(dump: Path) -> list[dict]:
    from attnlab.trainer.metrics import read_records

    return read_records(dump / "metrics.jsonl")


def losses(dump: Path) -> dict[int, float]:
    """step -> training loss (the last record of a step wins, as after a resume)."""
    return {r["step"]: r["loss"] for r in read_metrics(dump) if "loss" in r}


if __name__ == "__main__":  # a module the tools import, not a tool: running it (--help included) says what it holds
    print(__doc__)
    raise SystemExit(0)
