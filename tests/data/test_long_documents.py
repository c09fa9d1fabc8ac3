"""Long documents are tokenized and packed in bounded pieces with the ids of the whole document, a checkpoint taken
inside one resumes inside it, and the re-loop warning stays a few lines however many passes a run makes."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from datasets import Dataset

from attnlab.data.embedded import train_bpe
from attnlab.data.loader import PackedTextDataset, piece_end

WORDS = "the quick brown fox jumps over a lazy dog; naïve café déjà vu, 42 times: x=y (z) it's".split()


QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A small byte-level BPE tokenizer folder, the kind of the embedded corpus (GPT-2's pre-tokenizer)."""
    return str(train_bpe([" ".join(WORDS)] * 50, 300, tmp_path_factory.mktemp("bpe"), show_progress=False))


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory):
    """A small tokenizer built as Qwen3's is: NFC, its split regex, byte-level BPE."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("qwen_style")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|bos|>", "<|eos|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}))
    return str(out)


def _text(n_words: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    seps = [" "] * 12 + ["\n", "\n\n", "  ", "\t", ". "]
    return "".join(rng.choice(WORDS) + rng.choice(seps) for _ in range(n_words))


class _Recording:
    """The Hugging Face tokenizer with the length of every text it encodes recorded."""

    def __init__(self, inner):
        self.inner, self.lengths = inner, []

    def encode(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        return self.inner.encode(text, *args, **kwargs)


def _dataset(bpe, docs, seq_len=32, piece_chars=500, stream=False, infinite=False):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(bpe)
    tok.tokenizer = _Recording(tok.tokenizer)
    ds = Dataset.from_list([{"text": d} for d in docs])
    packed = PackedTextDataset(ds.to_iterable_dataset() if stream else ds, "text", "long", tok, seq_len, 0, 1,
                               infinite=infinite)
    packed.piece_chars = piece_chars
    return packed, tok


def _rows(stream: list[int], seq_len: int) -> list[list[int]]:
    n = seq_len + 1
    return [stream[i:i + n] for i in range(0, len(stream) - n + 1, n)]


@pytest.mark.parametrize("kind", ["bpe", "qwen_style"])
def test_a_long_document_is_tokenized_in_bounded_pieces_with_the_ids_of_the_whole(kind, request):
    docs = [_text(3000), "a short one", _text(400, seed=1)]
    ds, tok = _dataset(request.getfixturevalue(kind), docs)
    rows = [torch.cat([x["input"], y[-1:]]).tolist() for x, y in ds]
    assert max(tok.tokenizer.lengths) <= 500 < len(docs[0])  # every text handed to the tokenizer is one piece
    stream = [t for d in docs for t in tok.encode(d, add_bos=True, add_eos=True)]
    assert rows == _rows(stream, 32)


def test_pieces_end_where_byte_level_bpe_splits_anyway(bpe):
    """Cut points are a space between a non-space and a letter; a stretch without one is cut at the limit."""
    text = _text(2000, seed=2)
    start, ends = 0, []
    while start < len(text):
        start = piece_end(text, start, 100)
        ends.append(start)
    assert ends[-1] == len(text) and all(0 < b - a <= 100 for a, b in zip([0, *ends], ends))
    assert all(text[i] == " " and not text[i - 1].isspace() and text[i + 1].isalpha() for i in ends[:-1])
    assert piece_end("x" * 250, 0, 100) == 100 and piece_end("ab " * 10, 0, 100) == 30


@pytest.mark.parametrize("stream", [False, True], ids=["map", "streaming"])
def test_a_checkpoint_inside_a_long_document_resumes_inside_it(bpe, stream):
    docs = [_text(300, seed=3), _text(3000, seed=4), _text(300, seed=5)]
    ds, _ = _dataset(bpe, docs, stream=stream)
    it = iter(ds)
    for _ in range(40):
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))  # the state survives serialisation
    assert state["doc_offset"] > 0  # inside the long document
    expect = [x["input"] for x, _ in it]
    fresh, _ = _dataset(bpe, docs, stream=stream)
    fresh.load_state_dict(state)
    got = [x["input"] for x, _ in fresh]
    assert len(got) == len(expect) > 0 and all(torch.equal(a, b) for a, b in zip(expect, got))


def test_the_re_loop_warning_names_the_pass_and_comes_a_few_times(bpe, caplog):
    """It came once per pass: six lines in a 60-step run over a small folder."""
    ds, _ = _dataset(bpe, ["w " * 20, "v " * 20], seq_len=16, infinite=True)
    it = iter(ds)
    for _ in range(5 * 9):  # 9 passes of the two documents (5 rows each)
        next(it)
    lines = [r.getMessage() for r in caplog.records if "re-looped" in r.getMessage()]
    assert [line.split("pass ")[1].split()[0] for line in lines] == ["2", "4", "8"]


@pytest.mark.slow
def test_memory_does_not_grow_with_document_length(bpe):
    """Peak RSS of packing one 20 MB document against one of 20 KB, each in a fresh process (it was ~135 bytes
    per input byte: 2.7 GB more)."""
    script = textwrap.dedent(f"""
        import resource, sys
        from datasets import Dataset
        from torchtitan.components.tokenizer import HuggingFaceTokenizer
        from attnlab.data.loader import PackedTextDataset
        text = ("the quick brown fox jumps over a lazy dog; naive cafe, 42 times. " * 400_000)[:int(sys.argv[1])]
        ds = PackedTextDataset(Dataset.from_list([{{"text": text}}]), "text", "x", HuggingFaceTokenizer({bpe!r}),
                               256, 0, 1, infinite=False)
        del text
        n = sum(1 for _ in ds)
        print(n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    """)
    peak = {}
    for size in (20_000, 20_000_000):
        out = subprocess.run([sys.executable, "-c", script, str(size)], capture_output=True, text=True, check=True)
        rows, peak[size] = map(int, out.stdout.split())
        assert rows > 0
    assert peak[20_000_000] - peak[20_000] < 200, peak  # MB: the text and its Arrow copy, not the tokenizer's state
