"""metrics.jsonl cut short by a kill or a full disk mid-write: a resumed run repairs it before appending, and
every reader names the file and the line of a bad record (a partial last record is skipped with a warning)."""

import json
import logging

import pytest

from attnlab.trainer.metrics import JsonlLogger, read_records
from attnlab.tools import plot_ppl
from attnlab.testing.tiny_runs import read_metrics

GOOD = "".join(json.dumps({"step": s, "loss": 2.0 / s}) + "\n" for s in (1, 2))


@pytest.mark.parametrize("tail,kept", [('{"step": 3, "loss": 0.6', [1, 2, 4]),  # cut mid-record: dropped
                                       ('{"step": 3, "loss": 0.6}', [1, 2, 3, 4])])  # only the newline lost: ended
def test_a_resumed_run_repairs_the_partial_last_line_before_appending(tmp_path, caplog, tail, kept):
    path = tmp_path / "metrics.jsonl"
    path.write_text(GOOD + tail)
    with caplog.at_level(logging.WARNING):
        log = JsonlLogger(str(path))
    log.log({"loss": 0.5}, 4)
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == kept
    assert f"{path} line 3:" in caplog.text


def test_readers_skip_a_partial_last_line_and_name_any_other_bad_line(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    path = run / "metrics.jsonl"
    path.write_text(GOOD + '{"step": 3, "lo')
    with caplog.at_level(logging.WARNING):
        train, _ = plot_ppl.load(str(run))
    assert sorted(train) == [1, 2] and [r["step"] for r in read_metrics(run)] == [1, 2]
    assert f"{path} line 3: skipped a partial last record" in caplog.text
    # a partial record a resumed run (before the repair) appended onto: not the last line, so an error
    path.write_text(GOOD.replace("\n", "", 1) + json.dumps({"step": 3, "loss": 0.6}) + "\n")
    with pytest.raises(SystemExit, match=rf"plot_ppl: error: {path} line 1: not valid JSON \(Extra data"):
        plot_ppl.load(str(run))
    with pytest.raises(ValueError, match=rf"{path} line 1: not valid JSON"):
        read_records(path)
