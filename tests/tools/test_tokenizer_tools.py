"""attnlab/tools/train_tokenizer.py (BPE on your own files) and attnlab/tools/fetch_tokenizer.py (hub, offline
error)."""

import gzip
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.utils import REPO

from attnlab.tools import fetch_tokenizer
from attnlab.tools import train_tokenizer


def test_train_tokenizer_on_own_files_gives_a_trainer_usable_folder(tmp_path, capsys):
    from attnlab.data.loader import build_tokenizer

    words = [f"token{i} alpha beta gamma" for i in range(200)]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        for w in words:
            f.write(json.dumps({"body": w}) + "\n")
    out = tmp_path / "tok"
    assert train_tokenizer.main([str(tmp_path / "a.jsonl.gz"), "-o", str(out), "--vocab-size", "300",
                                 "--text-field", "body", "--no-progress"]) == 0
    assert "300 tokens" in capsys.readouterr().out
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    tok = build_tokenizer(SimpleNamespace(model=SimpleNamespace(hf_assets_path=str(out))))
    assert tok.get_vocab_size() == 300 and tok.bos_id is not None and tok.eos_id is not None
    ids = tok.encode("alpha beta ünïcode ☃", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == "alpha beta ünïcode ☃"  # byte-level: unseen characters still round-trip
    assert len(tok.encode("alpha beta gamma")) < len("alpha beta gamma")  # merges were learned
    # refusals: existing folder, unknown column
    with pytest.raises(SystemExit) as e:  # -o's declared rule: a path where nothing exists yet
        train_tokenizer.main([str(tmp_path / "a.jsonl.gz"), "-o", str(out)])
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err
    assert train_tokenizer.main([str(tmp_path / "a.jsonl.gz"), "-o", str(tmp_path / "t2"), "--no-progress"]) == 2
    assert "no column 'text'" in capsys.readouterr().err and not (tmp_path / "t2").exists()


def test_train_tokenizer_on_a_bad_input_leaves_no_folder(tmp_path, capsys):
    """The README's `-o runs/my_tokenizer` with a bad input left an empty runs/ behind."""
    for bad in (tmp_path / "missing.txt", tmp_path / "empty.txt"):
        (tmp_path / "empty.txt").write_text("")
        assert train_tokenizer.main([str(bad), "-o", str(tmp_path / "runs" / "deeper" / "tok"), "--no-progress"]) == 2
        assert "train_tokenizer: error:" in capsys.readouterr().err
        assert not (tmp_path / "runs").exists()


def test_fetch_tokenizer_offline_error_is_clear_and_writes_nothing(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    proc = subprocess.run([sys.executable, "-m", "attnlab.tools.fetch_tokenizer", "-o", str(tmp_path / "q")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cannot reach the Hugging Face Hub for Qwen/Qwen3-0.6B" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "q").exists()


def test_fetch_tokenizer_downloads_only_tokenizer_files(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, local_dir=None):
        calls.append((repo_id, revision, allow_patterns))
        os.makedirs(local_dir, exist_ok=True)
        (local_dir / "tokenizer.json").write_text("{}")
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.chdir(tmp_path)
    assert fetch_tokenizer.main([]) == 0
    (repo, rev, patterns), = calls
    assert repo == "Qwen/Qwen3-0.6B" and rev is None
    assert "tokenizer.json" in patterns and not any("safetensors" in p or "*" in p for p in patterns)
    assert (tmp_path / "assets" / "hf" / "Qwen3-0.6B" / "tokenizer.json").is_file()
    assert "assets/hf/Qwen3-0.6B" in capsys.readouterr().out
