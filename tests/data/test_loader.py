"""Data: per-document positions, packing, deterministic sharding, resumable state, clear errors."""

import json

import pytest
import torch

from attnlab.data.loader import PackedTextDataset, build_tokenizer, document_positions
from attnlab.data.sources import open_text_dataset, resolve_files
from tests.utils import make_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("c"), seq_len=16, n_train=40)


class _Cfg:
    def __init__(self, path):
        self.model = type("M", (), {"hf_assets_path": path})()
        self.data = type("D", (), {"cache_dir": "/tmp", "embedded_vocab_size": 64})()


def _dataset(corpus, seq_len=10, rank=0, world=1):
    tok = build_tokenizer(_Cfg(corpus["tokenizer"]))
    ds, field = open_text_dataset(corpus["train"], "training.dataset_path", local=True, text_field="text")
    return PackedTextDataset(ds, field, "t", tok, seq_len, rank, world, infinite=True), tok


def test_document_positions():
    t = torch.tensor([5, 0, 7, 8, 1, 0, 9, 1, 4, 4])  # bos=0, eos=1
    assert document_positions(t, 0, 1).tolist() == [0, 0, 1, 2, 3, 0, 1, 2, 0, 1]
    assert document_positions(t, None, 1).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]  # EOS-only tokenizers


def test_rows_pack_documents_with_bos_eos(corpus):
    ds, tok = _dataset(corpus, seq_len=10)
    it = iter(ds)
    (inp, label) = next(it)
    x, pos = inp["input"], inp["positions"]
    assert x.shape == pos.shape == label.shape == (10,)
    assert x[0].item() == tok.bos_id and torch.equal(label[:-1], x[1:])
    # rows are consecutive (seq_len + 1)-token windows of the BOS/EOS-delimited token stream
    stream = []
    for line in open(corpus["train"]):
        stream += tok.encode(json.loads(line)["text"], add_bos=True, add_eos=True)
    for k, (row, lab) in enumerate([(x, label)] + [(b["input"], lb) for b, lb in (next(it), next(it))]):
        window = torch.tensor(stream[k * 11:(k + 1) * 11])
        assert torch.equal(row, window[:-1]) and torch.equal(lab, window[1:])


def test_state_resumes_where_it_stopped(corpus):
    ds, _ = _dataset(corpus)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict()
    expect = [next(it) for _ in range(4)]
    fresh, _ = _dataset(corpus)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # state survives serialisation
    got = [b for b, _ in zip(iter(fresh), range(4))]
    for (a, la), (b, lb) in zip(expect, got):
        assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)


def test_interleaved_sharding_is_deterministic(corpus):
    one, _ = _dataset(corpus, seq_len=16)
    r0, _ = _dataset(corpus, seq_len=16, rank=0, world=2)
    r1, _ = _dataset(corpus, seq_len=16, rank=1, world=2)
    rows = [b[0]["input"] for b, _ in zip(iter(one), range(4))]
    assert torch.equal(next(iter(r0))[0]["input"], rows[0]) and torch.equal(next(iter(r1))[0]["input"], rows[1])


def test_repeatable_validation_restarts(corpus):
    tok = build_tokenizer(_Cfg(corpus["tokenizer"]))
    ds, field = open_text_dataset(corpus["val"], "validation.dataset_path", local=True, text_field="text")
    val = PackedTextDataset(ds, field, "v", tok, 16, 0, 1, infinite=False, repeatable=True)
    a = [b[0]["input"] for b in val]
    b = [b[0]["input"] for b in val]
    assert len(a) == 8 and all(torch.equal(x, y) for x, y in zip(a, b))


def test_errors_name_the_key(tmp_path, corpus):
    with pytest.raises(ValueError, match="training.dataset_path='/nope': no such file"):
        resolve_files("/nope", "training.dataset_path")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no data files found"):
        resolve_files(str(tmp_path / "empty"), "training.dataset_path")
    with pytest.raises(ValueError, match="no column 'body'"):
        open_text_dataset(corpus["train"], "training.dataset_path", local=True, text_field="body")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        build_tokenizer(_Cfg(str(tmp_path / "tok")))


def test_folder_glob_and_gz(tmp_path):
    import gzip

    d = tmp_path / "shards"
    d.mkdir()
    for i in range(2):
        with gzip.open(d / f"part-{i}.jsonl.gz", "wt") as f:
            f.write(json.dumps({"text": f"doc {i} " * 30}) + "\n")
    (d / "notes.txt.gz").write_bytes(gzip.compress(b"x"))
    with pytest.raises(ValueError, match="must all be of one format"):
        resolve_files(str(d), "training.dataset_path")
    builder, files = resolve_files(str(d / "*.jsonl.gz"), "training.dataset_path")
    assert builder == "json" and len(files) == 2
    ds, _ = open_text_dataset(str(d / "*.jsonl.gz"), "k", local=True, text_field="text")
    assert len(ds) == 2


ROWS = [{"text": "w1 w2 w3 w4"}, {"text": None}, {"text": "w5 w6 w7 w8"}]


def _rows():
    yield from ROWS


def test_records_without_text_from_unscanned_sources_are_named_or_skipped(corpus):
    """Hub data is not scanned at start: a record without a string text stops with the dataset and key named
    (not a TypeError in the tokenizer), or is skipped with a count; a map-style position stays the index."""
    from datasets import Dataset, IterableDataset

    tok = build_tokenizer(_Cfg(corpus["tokenizer"]))
    stream = PackedTextDataset(IterableDataset.from_generator(_rows), "text", "hub/x", tok, 4, 0, 1, infinite=False)
    with pytest.raises(ValueError, match=r"hub/x: a record's 'text' is NoneType, not a string \(1 such records, "
                                         r"more than data.max_bad_records=0\)"):
        list(stream)
    ds = PackedTextDataset(Dataset.from_list(ROWS), "text", "hub/x", tok, 4, 0, 1, infinite=False, max_bad=1)
    assert len(list(ds)) == 2 and ds.bad_records == 1 and ds._sample_idx == 3


def test_hub_dataset_subset_is_passed_to_load_dataset(monkeypatch):
    """``[data] hub_subset`` names the config of a hub dataset (c4 "en", fineweb-edu "sample-10BT")."""
    from datasets import Dataset

    from attnlab.data import sources as data_sources
    from attnlab.config import DEFAULT_CONFIG, parse_config
    from attnlab.data.loader import _source

    calls = []

    def fake_load_dataset(*args, **kw):
        calls.append((args, kw))
        return Dataset.from_list([{"text": f"doc {i}"} for i in range(4)])

    monkeypatch.setattr(data_sources, "load_dataset", fake_load_dataset)
    cfg = parse_config(["--job.config_file", DEFAULT_CONFIG, "--training.dataset", "allenai/c4",
                        "--data.hub_subset", "en", "--data.hub_split", "validation", "--data.val_every", "0"])
    ds, field, name = _source(cfg, "train")
    assert calls == [(("allenai/c4", "en"), {"split": "validation", "streaming": True})]
    assert field == "text" and len(ds) == 4
    _source(parse_config(["--job.config_file", DEFAULT_CONFIG, "--training.dataset", "x/y", "--data.val_every",
                          "0"]), "train")
    assert calls[-1][0] == ("x/y", None)


@pytest.mark.parametrize("val_path", [False, True])
def test_training_split_holds_out_documents_only_without_a_validation_file(corpus, val_path):
    """``data.val_every`` holds every k-th training document out for validation only when
    ``validation.dataset_path`` is empty; with a validation file, training reads every document."""
    from attnlab.config import DEFAULT_CONFIG, parse_config
    from attnlab.data.loader import _source

    flags = ["--job.config_file", DEFAULT_CONFIG, "--training.dataset_path", corpus["train"],
             "--validation.enable", "--data.val_every", "4"]
    cfg = parse_config(flags + (["--validation.dataset_path", corpus["val"]] if val_path else []))
    train = [r["text"] for r in _source(cfg, "train")[0]]
    every = [json.loads(line)["text"] for line in open(corpus["train"])]
    assert train == (every if val_path else [t for i, t in enumerate(every) if i % 4])
    val = [r["text"] for r in _source(cfg, "val")[0]]
    assert val == ([json.loads(line)["text"] for line in open(corpus["val"])] if val_path else every[::4])


def test_state_is_a_snapshot(corpus):
    """The dataset state does not change as packing goes on: the loader's worker pickles it later, in a thread."""
    ds, _ = _dataset(corpus, seq_len=10)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    before = {**state, "token_buffer": list(state["token_buffer"])}
    for _ in range(8):
        next(it)
    assert state == before and ds.state_dict() != before


def test_one_worker_reads_what_no_worker_reads_and_its_state_reshards(corpus):
    """``num_workers = 1`` (tokenization in a worker process) gives the batches and the dataset state of the
    in-process loader, and the cross-world-size reshard reads that state from the worker's snapshot (more workers
    would each read every document: refused by the config check)."""
    import pickle

    from attnlab.data.loader import ReshardableDataloader, dataset_state

    def loader(workers, rank=0, world=1):
        ds, _ = _dataset(corpus, seq_len=10, rank=rank, world=world)
        return ReshardableDataloader(ds, dp_rank=rank, dp_world_size=world, batch_size=2, num_workers=workers)

    batches, states = {}, {}
    for workers in (0, 1):
        dl = loader(workers)
        it = iter(dl)
        batches[workers] = [next(it)[0]["input"] for _ in range(3)]
        states[workers] = dl.state_dict()
        del it
    assert all(torch.equal(a, b) for a, b in zip(batches[0], batches[1]))
    one, none = (dataset_state(pickle.loads(states[w]["dp_rank_0"])) for w in (1, 0))
    assert one["sample_idx"] == none["sample_idx"] > 0 and one["token_buffer"] == none["token_buffer"]
    for rank in (0, 1):  # the one-rank, one-worker checkpoint resumed on two ranks
        new = loader(1, rank, 2)
        new.load_state_dict({**states[1], "world_size": 1})
        assert new.dataset._sample_idx == -(-(none["sample_idx"] - rank) // 2)


def test_after_a_resharded_resume_the_next_checkpoint_saves_the_loaders_own_state(corpus):
    """A run resumed from another data-parallel world size saved the old ranks' empty template (b"" per rank) in
    every later checkpoint, so the position was lost and the next resume failed on it: once loaded, the loader's
    state is its own again."""
    import pickle

    from attnlab.data.loader import ReshardableDataloader, dataset_state

    def loader(rank, world):
        ds, _ = _dataset(corpus, seq_len=10, rank=rank, world=world)
        return ReshardableDataloader(ds, dp_rank=rank, dp_world_size=world, batch_size=2)

    old = {"world_size": 2}
    for rank in (0, 1):  # two ranks read three batches each
        dl = loader(rank, 2)
        it = iter(dl)
        [next(it) for _ in range(3)]
        old[f"dp_rank_{rank}"] = dl.state_dict()[f"dp_rank_{rank}"]
    new = loader(0, 1)
    new.resume_world_size = 2
    assert new.state_dict() == {"dp_rank_0": b"", "dp_rank_1": b"", "world_size": 2}  # the template DCP fills
    new.load_state_dict(old)
    it = iter(new)
    next(it)
    state = new.state_dict()
    assert state["world_size"] == 1 and dataset_state(pickle.loads(state["dp_rank_0"]))["sample_idx"] > 0
