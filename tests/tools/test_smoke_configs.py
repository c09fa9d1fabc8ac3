"""attnlab/tools/smoke_configs.py on the CPU: two paper configurations, shrunk to the debug flavor, train 3 steps each
through torchrun; the table reports both; a broken run is reported as FAILED (exit code 1)."""

import pytest

from attnlab.tools import smoke_configs
from tests.utils import make_corpus

CONFIGS = "qwen3_0.6b_softmax_adamw_wsd,qwen3_0.6b_parallax"  # AdamW and Muon, softmax and Parallax


def test_selection():
    names = [p.stem for p in smoke_configs.configs("")]
    assert "qwen3_0.6b_parallax" in names and "qwen3_1.7b_softmax_t24_adamw_cosine" in names
    assert "debug_cpu" not in names and not any("replication" in n for n in names)
    assert [p.stem for p in smoke_configs.configs("qwen3_0.6b_parallax_wda*")] == [
        "qwen3_0.6b_parallax_wda0p5", "qwen3_0.6b_parallax_wda1", "qwen3_0.6b_parallax_wda2"]


@pytest.mark.slow  # CI time: 20-30 s on 2 cores
def test_two_configs_on_cpu(tmp_path, capsys):
    corpus = make_corpus(tmp_path / "corpus")
    common = ["--device", "cpu", "--flavor", "debug", "--seq", "16", "--steps", "3", "--local-batch", "2",
              "--data", corpus["train"], "--tokenizer", corpus["tokenizer"], "--timeout", "240"]
    rc = smoke_configs.main([*common, "--only", CONFIGS, "--out", str(tmp_path / "ok"), "--", "--model.vocab_size", "64"])
    out = capsys.readouterr().out
    assert rc == 0, out
    table = out.split("tok/s/dev")[1]
    for name in CONFIGS.split(","):
        line = next(ln for ln in table.splitlines() if ln.startswith(name + " "))
        _, result, secs, first, loss, _ = line.split()
        assert result == "ok" and 0 < float(first) <= float(secs) and float(loss) > 0, line
    assert "2/2 ok" in out


@pytest.mark.slow
def test_failed_config_is_reported(tmp_path, capsys):
    corpus = make_corpus(tmp_path / "corpus")
    rc = smoke_configs.main(["--device", "cpu", "--flavor", "debug", "--seq", "16", "--steps", "3", "--data",
                             corpus["train"], "--tokenizer", corpus["tokenizer"], "--only", "qwen3_0.6b_softmax",
                             "--out", str(tmp_path), "--", "--model.vocab_size", "8"])  # < the tokenizer's 63
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED" in out and "model.vocab_size" in out, out
