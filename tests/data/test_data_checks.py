"""Data cases found before the trainer starts, in one line naming the key or file: a format we do not read, a
parquet file without the text column, an unreachable hub, validation without held-out data; a resume on other data
is named; the embedded cache build leaves no temporary folder behind."""

import json
import shutil
import subprocess
import sys
import time

import pytest

from attnlab.config import parse_config
from attnlab.data.loader import _source, build_dataloader, build_tokenizer, check_data_source
from attnlab.testing.tiny_runs import make_corpus, tiny_args
from attnlab.train import preflight


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("c"), seq_len=16, n_train=24)


def _cfg(corpus, tmp_path, *extra):
    return parse_config(tiny_args(corpus, tmp_path / "run", 2, 16, 2, *extra))


def test_a_csv_dataset_is_refused_in_preflight_naming_the_formats(corpus, tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("text\nw1 w2\n")
    with pytest.raises(ValueError, match=rf"training.dataset_path='{csv}': {csv} is not a supported format; "
                                         r"supported: .jsonl/.json .*\.parquet, .txt/.text/.md .* convert other "
                                         r"formats \(e.g. .csv\)"):
        preflight(_cfg(corpus, tmp_path, "--training.dataset_path", str(csv)))


def test_a_parquet_file_without_the_text_column_is_refused_in_preflight(corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"body": ["w1 w2", "w3"]}), path)
    with pytest.raises(ValueError, match=rf"training.dataset_path='{path}': {path} has no column 'text' "
                                         r"\(data.text_field\); its columns are \['body'\]"):
        preflight(_cfg(corpus, tmp_path, "--training.dataset_path", str(path)))
    preflight(_cfg(corpus, tmp_path, "--training.dataset_path", str(path), "--data.text_field", "body"))


def test_val_every_0_without_a_validation_file_is_refused_not_run_on_the_training_documents(corpus, tmp_path):
    """``data.val_every = 0`` means no held-out split; validation then needs ``validation.dataset_path``. It used
    to validate on the training documents, silently."""
    flags = ["--validation.dataset_path", "", "--data.val_every", "0"]
    cfg = _cfg(corpus, tmp_path, *flags)
    message = r"data.val_every=0 holds out no documents, and validation.dataset_path is empty"
    with pytest.raises(ValueError, match=message):
        preflight(cfg)
    with pytest.raises(ValueError, match=message):
        _source(cfg, "val")
    preflight(_cfg(corpus, tmp_path, *flags, "--validation.no-enable"))  # no validation: every document trains
    preflight(_cfg(corpus, tmp_path, "--data.val_every", "0"))  # a validation file: every document trains


def test_an_unreachable_hub_is_one_line_in_seconds(corpus, tmp_path, monkeypatch):
    """It took 34 s of retries, then a traceback from inside the trainer."""
    import os

    from huggingface_hub import constants

    flags = ["--training.dataset_path", "", "--training.dataset", "allenai/c4", "--data.hub_subset", "en"]
    message = ("training.dataset='allenai/c4': the Hugging Face Hub (http://127.0.0.1:9) cannot be reached (no "
               "network, or a proxy refuses); use local files (training.dataset_path), or for a copy already in the "
               "datasets cache ($HF_HOME, default ~/.cache/huggingface) set HF_HUB_OFFLINE=1 and data.streaming = "
               "false")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # a port nothing listens on
    cfg = _cfg(corpus, tmp_path, *flags)
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        check_data_source(cfg)
    assert str(e.value) == message and time.perf_counter() - t0 < 6
    dump = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "attnlab.train", *tiny_args(corpus, dump, 2, 16, 2, *flags)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [f"train.py: error: {message}"]
    assert not dump.exists()


def test_offline_mode_with_a_streamed_hub_dataset_is_named(monkeypatch, corpus, tmp_path):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    cfg = _cfg(corpus, tmp_path, "--training.dataset_path", "", "--training.dataset", "allenai/c4")
    with pytest.raises(ValueError, match=r"training.dataset='allenai/c4': HF_HUB_OFFLINE is set, and a hub dataset "
                                         r"is streamed from the Hub \(data.streaming\); set data.streaming = false"):
        check_data_source(cfg)


def test_resuming_on_other_data_names_the_change(corpus, tmp_path, caplog):
    """The old loader position was applied to the new data without a word."""
    other = tmp_path / "other.jsonl"
    other.write_text("".join(open(corpus["train"]).readlines()[:12]))
    cfg = _cfg(corpus, tmp_path)
    tok = build_tokenizer(cfg)
    dl = build_dataloader(1, 0, tok, cfg)
    it = iter(dl)
    next(it), next(it)
    state = dl.state_dict()
    build_dataloader(1, 0, tok, cfg).load_state_dict(state)
    assert "Data changed" not in caplog.text
    build_dataloader(1, 0, tok, _cfg(corpus, tmp_path, "--training.dataset_path", str(other))).load_state_dict(state)
    lines = [r.getMessage() for r in caplog.records if "Data changed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        f"Data changed since checkpoint (resumed): training.dataset_path {corpus['train']!r} -> {str(other)!r}, "
        f"bytes {len(open(corpus['train']).read())} -> {other.stat().st_size}, files' paths and sizes ")
    assert lines[0].endswith("; its loader position is applied to this data as it is (to read this data from its "
                             "first document, resume with --checkpoint.exclude_from_loading dataloader)")


def test_a_lost_or_failed_embedded_cache_build_leaves_no_temporary_folder(tmp_path, monkeypatch):
    """Two first runs building at once left a complete ``embedded-v{N}.tmpPID`` folder behind."""
    from attnlab.data import embedded

    monkeypatch.setattr(embedded, "_documents", lambda: [f"doc {i} " * 40 for i in range(40)])
    real = embedded.train_bpe

    def other_run_finishes_first(texts, vocab_size, out_dir, **kw):  # the race: the other build renames first
        real(texts, vocab_size, out_dir, **kw)
        shutil.copytree(out_dir, tmp_path / f"embedded-v{vocab_size}")

    monkeypatch.setattr(embedded, "train_bpe", other_run_finishes_first)
    out = embedded.build_embedded(str(tmp_path), 300)
    assert out == tmp_path / "embedded-v300" and [p.name for p in tmp_path.iterdir()] == ["embedded-v300"]
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "BPE"

    def fails(*args, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(embedded, "train_bpe", fails)
    with pytest.raises(OSError, match="disk full"):
        embedded.build_embedded(str(tmp_path), 301)
    assert [p.name for p in tmp_path.iterdir()] == ["embedded-v300"]
