"""The embedded default corpus: docstrings of the Python standard library on this machine.

Every machine with Python has it, so ``python -m attnlab.train`` needs no download. Docstrings are read with
``ast`` from the stdlib's ``.py`` sources (nothing is imported), grouped one document per module, split
deterministically into train/validation, and written once as JSONL under the cache folder together with a
byte-level BPE tokenizer trained on the train split by Hugging Face ``tokenizers``.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from torchtitan.tools.logging import logger

BOS, EOS = "<|bos|>", "<|eos|>"
MAX_BYTES = 5_000_000  # keep the corpus small: tokenizer training and one epoch stay fast on 2 cores


def _module_docs(path: Path) -> str | None:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    parts = []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                title = "" if isinstance(node, ast.Module) else f"{node.name}\n"
                parts.append(title + doc.strip())
    text = "\n\n".join(dict.fromkeys(parts))  # drop repeated docstrings, keep order
    return text if len(text) >= 200 else None


def _documents() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts and "idle_test" not in p.parts)
    docs, size = [], 0
    for p in files:
        text = _module_docs(p)
        if text:
            docs.append(text)
            size += len(text.encode())
            if size >= MAX_BYTES:
                break
    if not docs:
        raise RuntimeError(f"no docstrings found under the Python standard library at {root}")
    return docs


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, length: int | None = None,
              show_progress: bool = True) -> Path:
    """Train a byte-level BPE tokenizer (Hugging Face ``tokenizers``) with ``<|bos|>``/``<|eos|>`` on ``texts``
    and write ``tokenizer.json`` + ``tokenizer_config.json`` into ``out_dir`` (a folder usable as
    ``model.hf_assets_path``). Byte-level: every byte has a token, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}, f)
    return out


def build_embedded(cache_dir: str, vocab_size: int, val_every: int = 20) -> Path:
    """Build (once) and return the folder holding ``train.jsonl``, ``val.jsonl`` and the tokenizer files.

    The files are written into a temporary folder of this call's own, which is then renamed to the final name in
    one step: processes that build at the same time (the ranks of a first run, two first runs) each see either
    no folder or a complete one. The first rename wins; a later builder, or one that fails, removes its temporary
    folder and leaves nothing behind."""
    import shutil
    import tempfile

    out = Path(cache_dir) / f"embedded-v{vocab_size}"
    if (out / "tokenizer.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp", dir=out.parent))
    try:
        docs = _documents()
        splits = {"train": [d for i, d in enumerate(docs) if i % val_every], "val": docs[::val_every]}
        for name, items in splits.items():
            with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as f:
                for d in items:
                    f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        logger.info(f"Embedded corpus: {len(docs)} documents from the Python standard library, built once into "
                    f"{out} with its BPE tokenizer (vocab {vocab_size}), the one runs with model.hf_assets_path = "
                    "\"embedded\" use; a run with a tokenizer of its own trains with its own")
        train_bpe(splits["train"], vocab_size, tmp, length=len(splits["train"]))
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private to its owner; the cache is not
        tmp.rename(out)
    except OSError:
        if not (out / "tokenizer.json").exists():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
