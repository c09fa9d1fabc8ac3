"""Train a byte-level BPE tokenizer (Hugging Face ``tokenizers``) on your own text files.

    python -m attnlab.tools.train_tokenizer FILES [FILES ...] -o tokenizers/mine --vocab-size 8192 [--max-docs 100000]
    python -m attnlab.train --model.hf_assets_path tokenizers/mine --model.vocab_size 8192 --training.dataset_path FILES

FILES: files, folders or globs of .jsonl/.json/.parquet/.txt/.md (optionally .gz), read with ``datasets`` as the
trainer reads them (JSON/Parquet: the ``--text-field`` column; a text file is one document). The output folder
holds ``tokenizer.json`` and ``tokenizer_config.json`` (BOS ``<|bos|>``, EOS ``<|eos|>``), usable as
``model.hf_assets_path``; it is the same trainer that builds the embedded default's tokenizer.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path


def documents(specs: list[str], text_field: str):
    """Texts of every document of ``specs`` in order (local files through ``datasets``)."""
    from attnlab.data.sources import open_text_dataset

    for spec in specs:
        ds, field = open_text_dataset(spec, "FILES", local=True, text_field=text_field, streaming=True)
        for row in ds:
            if row[field]:
                yield row[field]


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import ToolParser, at_least, new_path, non_negative_int

    ap = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", metavar="FILES", help="text files, folders or globs")
    ap.add_argument("-o", "--out", type=new_path, required=True, help="output folder (must not exist)")
    ap.add_argument("--vocab-size", type=at_least(258), default=8192,
                    help="tokens, including the 256 bytes and BOS/EOS")
    ap.add_argument("--text-field", default="text", help="column of JSON/Parquet files holding the text")
    ap.add_argument("--max-docs", type=non_negative_int, default=0,
                    help="train on at most this many documents (0 = all)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    from attnlab.data.embedded import train_bpe
    from attnlab.checkpoint.layout import new_folder

    out = Path(a.out)
    made = [p for p in out.absolute().parents if not p.exists()]  # the folders above OUT this call creates
    try:
        if out.exists():
            raise ValueError(f"{out} already exists; choose a new folder")
        if a.vocab_size < 258:
            raise ValueError(f"--vocab-size {a.vocab_size}: at least 258 (256 bytes + BOS + EOS)")
        out.parent.mkdir(parents=True, exist_ok=True)
        docs = documents(a.files, a.text_field)
        if a.max_docs:
            docs = itertools.islice(docs, a.max_docs)
        with new_folder(out) as tmp:
            train_bpe(docs, a.vocab_size, tmp, show_progress=not a.no_progress)
    except ValueError as e:
        for folder in made:  # innermost first: a failed call leaves no empty folder behind
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        print(f"train_tokenizer: error: {e}", file=sys.stderr)
        return 2
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    print(f"wrote {out}: byte-level BPE, {n} tokens; train with --model.hf_assets_path {out} "
          f"--model.vocab_size {n} (or larger)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
