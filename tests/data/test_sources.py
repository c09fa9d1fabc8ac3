"""Bad local data: every case names the file, the line and the key, at open time (before step 1); malformed
records are skipped with a count up to data.max_bad_records."""

import gzip
import json

import pytest

from attnlab.data.sources import open_text_dataset

GOOD = [json.dumps({"text": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(3)]


def _open(path, max_bad=0, **kw):
    if max_bad:
        kw["max_bad"] = max_bad
    return open_text_dataset(str(path), "training.dataset_path", local=True, text_field="text", **kw)


BAD = {
    "broken.jsonl": ('{"text": "w1 w2\n', r"line 3: not valid JSON \(Unterminated string"),
    "utf8.jsonl": (b'{"text": "w1 \xff\xfe w2"}\n', r"line 3: not UTF-8 \(byte 13: b'\\xff\\xfe w'\)"),
    "missing.jsonl": (json.dumps({"body": "x"}) + "\n", r"line 3: no column 'text' \(data.text_field\) in this "
                                                        r"record; its keys are \['body'\]"),
    "number.jsonl": (json.dumps({"text": 5}) + "\n", r"line 3: 'text' is int, not a string"),
    "list.jsonl": ("[1, 2]\n", r"line 3: not a JSON object \(list\)"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_record_stops_before_training_or_is_skipped_with_a_count(tmp_path, name, caplog):
    bad, message = BAD[name]
    path = tmp_path / name
    path.write_bytes(b"".join(x.encode() if isinstance(x, str) else x for x in [*GOOD[:2], bad, GOOD[2]]))
    with pytest.raises(ValueError, match=rf"training.dataset_path='{path}': {path} {message}.*data.max_bad_records"):
        _open(path)
    ds, _ = _open(path, max_bad=1)
    assert list(ds["text"]) == [json.loads(g)["text"] for g in GOOD]
    assert "skipping 1 malformed records (data.max_bad_records=1)" in caplog.text


def test_skipping_reads_the_file_as_it_is_now_not_a_cached_earlier_version(tmp_path):
    """The good records of a file with skipped ones are rebuilt when the file changes in place (datasets caches a
    generator's output under a hash of its arguments, and the path alone stays the same)."""
    path = tmp_path / "edited.jsonl"
    path.write_text(GOOD[0] + "{\n")
    assert len(_open(path, max_bad=1)[0]) == 1
    path.write_text(GOOD[0] + GOOD[1] + "{\n")
    assert list(_open(path, max_bad=1)[0]["text"]) == [json.loads(g)["text"] for g in GOOD[:2]]


def test_too_many_malformed_records_counts_them(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text(GOOD[0] + "{\n" + "{\n" + GOOD[1])
    with pytest.raises(ValueError, match=r"line 3: not valid JSON.*\(2 malformed records so far, more than "
                                         r"data.max_bad_records=1\)"):
        _open(path, max_bad=1)


def test_empty_file_is_named(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match=rf"training.dataset_path='{path}': no records in \['{path}'\]; the dataset "
                                         "is empty"):
        _open(path)


def test_truncated_gzip_is_named(tmp_path):
    path = tmp_path / "cut.jsonl.gz"
    full = gzip.compress("".join(GOOD * 300).encode())
    path.write_bytes(full[: len(full) // 2])
    with pytest.raises(ValueError, match=rf"training.dataset_path='{path}': {path}: cannot be read to the end "
                                         r"\(EOFError"):
        _open(path)


def test_json_array_file_and_streaming_skip(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"text": "a b"}, {"text": None}, {"text": "c d"}]))
    with pytest.raises(ValueError, match=r"rows.json line 2: 'text' is NoneType, not a string"):
        _open(path)
    ds, _ = _open(path, max_bad=1, streaming=True)
    assert [r["text"] for r in ds] == ["a b", "c d"]


def test_text_file_with_bad_utf8(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_bytes(b"good words \xc3\x28 here")
    with pytest.raises(ValueError, match=r"doc.txt line 1: not UTF-8 \(byte 11"):
        _open(path)
