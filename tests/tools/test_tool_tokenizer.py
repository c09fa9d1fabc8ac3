"""Every tool that reads a model takes ``--tokenizer DIR`` (attnlab/tools/common.py: ``add_tokenizer_argument``,
``checkpoint_tokenizer``): a Hugging Face folder without a tokenizer is refused in one line unless it is given, and
a tokenizer with more tokens than the model's embedding rows is refused in one line."""

import pytest

from tests.utils import make_corpus, random_qwen3

pytest.importorskip("transformers")

from attnlab.tools import eval_ppl, export_hf, generate, passkey  # noqa: E402


@pytest.fixture(scope="module")
def weights_only(tmp_path_factory):
    """A Qwen3 folder of 64 embedding rows without a tokenizer (trained with the test corpus's 60-token one), a
    tokenizer folder of 100 tokens, and the corpus."""
    from tokenizers import Tokenizer, models

    root = tmp_path_factory.mktemp("weights_only")
    corpus = make_corpus(root / "corpus")
    random_qwen3(root / "hf", seed=5, vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=1e4)
    (root / "big").mkdir()
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0")).save(str(root / "big" /
                                                                                         "tokenizer.json"))
    return root, corpus


def _run(main, argv, capsys):
    """(exit status, stderr) of a tool's main: its return value, or the code of its parser's SystemExit."""
    try:
        status = main(argv)
        status = status if isinstance(status, int) else 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


TOOLS = {
    "eval_ppl": (eval_ppl.main, ["--data", "DATA", "--seq-len", "16", "--max-rows", "2", "--no-progress"]),
    "passkey": (passkey.main, ["--lengths", "64", "--depths", "0", "--samples", "1"]),
    "generate": (generate.main, ["--prompt", "w1 w2", "--max-new-tokens", "2", "--greedy"]),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_a_hugging_face_folder_without_a_tokenizer_is_one_line_and_tokenizer_names_it(weights_only, tool, capsys):
    """eval_ppl and passkey fell back to the embedded 4096-token tokenizer beside 64 rows and died with an
    IndexError (39 lines); none of the tools took --tokenizer."""
    root, corpus = weights_only
    main, extra = TOOLS[tool]
    extra = [corpus["val"] if a == "DATA" else a for a in extra]
    status, err = _run(main, [str(root / "hf"), *extra], capsys)
    lines = [ln for ln in err.strip().splitlines() if "error" in ln]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "no tokenizer.json of its own and no run naming one; pass --tokenizer DIR" in lines[0]
    assert "attnlab train_tokenizer" in lines[0] and "attnlab fetch_tokenizer" in lines[0]
    status, err = _run(main, [str(root / "hf"), *extra, "--tokenizer", str(root / "big")], capsys)
    assert status == 2 and "100 tokens, more than the model's 64 embedding rows" in err and "Traceback" not in err
    status, err = _run(main, [str(root / "hf"), *extra, "--tokenizer", corpus["tokenizer"]], capsys)
    assert status == 0, err


def test_export_takes_the_same_tokenizer_argument(weights_only, tmp_path, capsys):
    root, corpus = weights_only
    status, err = _run(export_hf.main, [str(root / "hf"), str(tmp_path / "o1"), "--tokenizer", str(root / "big")],
                       capsys)
    assert status == 2 and "100 tokens, more than the model's 64 embedding rows" in err
    assert export_hf.main([str(root / "hf"), str(tmp_path / "o2"), "--tokenizer", corpus["tokenizer"]]) == 0
    assert (tmp_path / "o2" / "tokenizer.json").is_file()


def test_by_position_past_the_trained_context_prints_a_note(weights_only, capsys):
    """passkey and generate said so; eval_ppl --by-position did not."""
    root, corpus = weights_only  # max_position_embeddings 64: the trained context
    base = [str(root / "hf"), "--data", corpus["train"], "--max-rows", "1", "--no-progress", "--by-position",
            "--tokenizer", corpus["tokenizer"]]
    eval_ppl.main([*base, "--seq-len", "64"])
    assert "note" not in capsys.readouterr().err
    eval_ppl.main([*base, "--seq-len", "128"])
    assert "eval_ppl: note: positions past the trained context of 64 tokens" in capsys.readouterr().err
