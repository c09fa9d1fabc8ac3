"""Local training data that parses but cannot train: a corpus whose every document is empty, and a .json file
holding one JSON document instead of JSON Lines. Both stop at open time (before step 1) naming the file."""

import json

import pytest

from attnlab.config import parse_config
from attnlab.data.loader import build_dataloader, build_tokenizer
from attnlab.data.sources import open_text_dataset
from tests.utils import make_corpus, tiny_args


def _open(path):
    return open_text_dataset(str(path), "training.dataset_path", local=True, text_field="text")


@pytest.mark.parametrize("texts", [["", ""], ["", " \n\t "]], ids=["empty", "whitespace"])
def test_a_corpus_of_empty_documents_is_an_error_naming_the_file(tmp_path, texts):
    """It used to train on BOS/EOS only, re-looping over the empty documents, and exit 0."""
    path = tmp_path / "empty_docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with pytest.raises(ValueError, match=rf"training.dataset_path='{path}': every one of the 2 records in "
                                         rf"\['{path}'\] has an empty 'text' \(data.text_field\); the dataset has "
                                         "no text"):
        _open(path)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*texts, "w1 w2"]))  # one document is enough
    ds, _ = _open(path)
    assert list(ds["text"]) == [*texts, "w1 w2"]


def test_the_trainer_data_loader_refuses_an_empty_corpus_before_step_1(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    empty = tmp_path / "empty_docs.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    cfg = parse_config(tiny_args(corpus, tmp_path / "run", 2, 16, 2, "--training.dataset_path", str(empty)))
    with pytest.raises(ValueError, match=rf"training.dataset_path='{empty}': every one of the 1 records"):
        build_dataloader(1, 0, build_tokenizer(cfg), cfg)


@pytest.mark.parametrize("name,doc,kind", [
    ("one.json", {"text": "w1 w2", "meta": {"source": "x"}}, "object"),
    ("rows.jsonl", [{"text": "w1 w2"}, {"text": "w3"}], "array"),
])
def test_one_json_document_is_named_as_such_not_as_invalid_json(tmp_path, name, doc, kind):
    """A pretty-printed object (or array in a .jsonl) was reported as 'line 1: not valid JSON'."""
    path = tmp_path / name
    path.write_text(json.dumps(doc, indent=2))
    with pytest.raises(ValueError, match=rf"training.dataset_path='{path}': {path} holds one JSON {kind} spread over "
                                         r"lines, not JSON Lines \(one object per line"):
        _open(path)
    path.write_text(json.dumps({"text": "w1 w2"}) + "\n" + '{"text": "w3\n')  # a broken later line: still per line
    with pytest.raises(ValueError, match=rf"{path} line 2: not valid JSON"):
        _open(path)
