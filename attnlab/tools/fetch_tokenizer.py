"""Fetch a tokenizer from the Hugging Face Hub (default: Qwen3's, which the paper configs use).

    python -m attnlab.tools.fetch_tokenizer                      # Qwen/Qwen3-0.6B -> assets/hf/Qwen3-0.6B
    python -m attnlab.tools.fetch_tokenizer --repo Qwen/Qwen3-1.7B -o assets/hf/Qwen3-1.7B [--revision main]

Only the tokenizer files are downloaded (``huggingface_hub.snapshot_download`` with ``allow_patterns``), not
the weights; the folder is what ``model.hf_assets_path`` names. ``HF_TOKEN`` / ``hf auth login`` apply for gated
repositories; ``HF_ENDPOINT`` selects a mirror. On a machine without network, run this where there is one and
copy the folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TOKENIZER_PATTERNS = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                      "special_tokens_map.json", "generation_config.json"]


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import ToolParser, dir_path, or_empty

    ap = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default="Qwen/Qwen3-0.6B", help="Hub model repository holding the tokenizer")
    ap.add_argument("--revision", default=None, help="branch, tag or commit (default: the main branch)")
    ap.add_argument("-o", "--out", type=or_empty(dir_path), default="",
                    help="output folder (default: assets/hf/<repository name>)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    out = Path(a.out or Path("assets") / "hf" / a.repo.split("/")[-1])
    try:
        snapshot_download(a.repo, revision=a.revision, allow_patterns=TOKENIZER_PATTERNS, local_dir=out)
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as e:
        print(f"fetch_tokenizer: error: cannot reach the Hugging Face Hub for {a.repo} (offline: HF_HUB_OFFLINE is "
              f"set or there is no network; {type(e).__name__}). Run this on a machine with network access and "
              f"copy {out} here, or point model.hf_assets_path at a folder with tokenizer.json.", file=sys.stderr)
        return 2
    except HfHubHTTPError as e:
        print(f"fetch_tokenizer: error: {a.repo}: {e} (a private or gated repository needs HF_TOKEN)", file=sys.stderr)
        return 2
    if not (out / "tokenizer.json").is_file():
        print(f"fetch_tokenizer: error: {a.repo} has no tokenizer.json (files fetched into {out})", file=sys.stderr)
        return 2
    print(f"wrote {out}: use --model.hf_assets_path {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
