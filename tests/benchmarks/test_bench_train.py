"""benchmarks/bench_train.py's argument checks (the helpers of its runs are benchmarks.common's:
tests/benchmarks/test_common.py)."""

from __future__ import annotations

import sys

import pytest

from benchmarks import bench_train


@pytest.mark.parametrize("flag,value,message", [("--rows", "gdn,kdaa", "--rows: unknown ['kdaa']; choose from"),
                                                ("--precisions", "bf16,bf8", "--precisions: unknown ['bf8']")])
def test_unknown_row_or_precision_fails_before_any_run(monkeypatch, capsys, tmp_path, flag, value, message):
    monkeypatch.setattr(sys, "argv", ["bench_train", "--data", "d", "--tokenizer", "t", "--out", str(tmp_path / "o"),
                                      flag, value])
    with pytest.raises(SystemExit):
        bench_train.main()
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
