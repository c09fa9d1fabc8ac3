"""Research tools: analyze.py diagnostics, eval_ppl.py, synthetic task generators (CPU, tiny)."""

import json
import math

import pytest
import torch

from attnlab.tools import analyze, eval_ppl, passkey, synthetic
from tests.utils import read_metrics, run_train, tiny_args


def _flags(corpus, mech):
    return ["--model.attention", mech, "--model.vocab_size", "64", "--model.hf_assets_path", corpus["tokenizer"],
            "--training.seq_len", "16", "--validation.seq_len", "16"]


@pytest.fixture(scope="module")
def parallax_run(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("px")
    run_train(tiny_args(corpus, dump, 3, 16, 2, "--model.attention", "parallax", "--checkpoint.interval", "3"))
    return dump


def _analyze(run, corpus, mech, tmp_path):
    return analyze.main([str(run), "--data", corpus["val"], "--seq-len", "16", "--min-len", "8", "--rows", "3",
                         "--queries", "6", "-o", str(tmp_path), "--no-plots", "--", *_flags(corpus, mech)])


def test_analyze_parallax_keys_finite_and_json(parallax_run, corpus, tmp_path):
    res = _analyze(parallax_run, corpus, "parallax", tmp_path)
    saved = json.loads((tmp_path / "analysis.json").read_text())
    assert saved["step"] == 3 and len(saved["layers"]) == 4
    for layer in saved["layers"]:
        assert set(layer["activations"]) == set(analyze.ACTIVATION_KEYS)
        for v in layer["activations"].values():
            assert math.isfinite(v["mean"]) and all(math.isfinite(x) for x in v["quantiles"].values())
            assert len(v["head_mean"]) == 4
        assert set(layer["stable_rank"]) == {"wq", "wk", "wv", "wo", "wr", "qk_circuit", "ov_circuit", "rk_circuit"}
    s = res["summary"]
    assert s["cor"] > 0 and 0 < s["cpa"] <= 1 + 1e-9 and 0 < s["sink_p"] < 1


def test_analyze_softmax_subset_and_plots(corpus, tmp_path):
    dump = tmp_path / "sm"
    run_train(tiny_args(corpus, dump, 2, 16, 2, "--checkpoint.interval", "2"))
    analyze.main([str(dump), "--data", corpus["val"], "--seq-len", "16", "--min-len", "8", "--rows", "2",
                  "--queries", "4", "-o", str(tmp_path / "out"), "--", *_flags(corpus, "softmax")])
    saved = json.loads((tmp_path / "out" / "analysis.json").read_text())
    for layer in saved["layers"]:
        assert set(layer["activations"]) == {"entropy", "sink_p", "sink", "kv_corr"}
        assert "wr" not in layer["stable_rank"] and len(layer["stable_rank"]["qk_circuit"]) == 4
    assert (tmp_path / "out" / "entropy.png").is_file() and not (tmp_path / "out" / "cor.png").exists()


def test_cor_is_exactly_zero_when_wr_is_zero(parallax_run, corpus):
    from attnlab.checkpoint.load import load_model

    model, cfg, _ = load_model(parallax_run, _flags(corpus, "parallax"))
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wr.weight.zero_()
    rows = [torch.tensor([0, 5, 9, 12, 7, 30, 31, 4, 8, 2, 11])]
    res = analyze.analyze(model, rows, n_queries=5, min_pos=2)
    for layer in res["layers"]:
        a = layer["activations"]
        assert a["cor"]["mean"] == 0.0 and a["cor"]["quantiles"]["0.99"] == 0.0
        assert a["probe_norm"]["mean"] == 0.0 and a["cpa"]["mean"] == 0.0
        # with ρ = 0 the Parallax weights are the softmax weights: score sink = p_i1² / Σ p_ij² ≥ 0, range = max p - min p
        assert a["score_min"]["quantiles"]["0.01"] >= 0.0


def test_stable_rank_known_matrices():
    assert analyze.stable_rank(torch.diag(torch.tensor([3.0, 1.0, 1.0]))) == pytest.approx(11 / 9, rel=1e-12)
    u = torch.linalg.qr(torch.randn(7, 7, dtype=torch.float64)).Q
    w = u[:, :3] @ torch.diag(torch.tensor([2.0, 2.0, 1.0], dtype=torch.float64)) @ u[:3]  # rank 3, σ = 2, 2, 1
    assert analyze.stable_rank(w) == pytest.approx(9 / 4, rel=1e-10)
    a, b = torch.randn(4, 9, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    assert analyze.circuit_stable_rank(a, b) == pytest.approx(analyze.stable_rank(a.T @ b), rel=1e-9)


def test_head_diagnostics_match_explicit_loops():
    torch.manual_seed(0)
    T, D = 11, 5
    q, k, v, r = (torch.randn(T, D, dtype=torch.float64) for _ in range(4))
    k[0] = 3 * q.mean(0)  # a key most queries like: a visible sink
    queries = torch.tensor([3, 6, 10])
    d = analyze.head_diagnostics(q, k, v, r, 0.7, queries, ridge=0.0)
    for n, i in enumerate(queries.tolist()):
        logits = torch.tensor([0.7 * float(q[i] @ k[j]) for j in range(i + 1)], dtype=torch.float64)
        p = torch.softmax(logits, 0)
        vbar = sum(p[j] * v[j] for j in range(i + 1))
        kbar = sum(p[j] * k[j] for j in range(i + 1))
        skv = sum(p[j] * torch.outer(v[j] - vbar, k[j] - kbar) for j in range(i + 1))
        t = torch.stack([r[i] @ k[j] for j in range(i + 1)])
        s = p * (1 + (p * t).sum() - t)
        assert torch.allclose(sum(s[j] * v[j] for j in range(i + 1)), vbar - skv @ r[i], atol=1e-10)  # eq. (8)
        assert d["cor"][n] == pytest.approx(float((skv @ r[i]).norm() / vbar.norm()), rel=1e-9)
        assert d["cpa"][n] == pytest.approx(float((skv @ r[i]).norm() / (r[i].norm() * torch.linalg.matrix_norm(skv, 2))), rel=1e-9)
        assert d["sink_p"][n] == pytest.approx(float(p[0]), rel=1e-12)
        assert d["sink"][n] == pytest.approx(float(s[0] ** 2 / (s**2).sum()), rel=1e-9)
        assert d["score_range"][n] == pytest.approx(float(s.max() - s.min()), rel=1e-9)
        assert d["entropy"][n] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-9)
        if i + 1 > D:  # full-rank covariances: the canonical correlations are at most 1 each
            assert float(d["kv_corr"][n]) <= math.sqrt(D) + 1e-6


def test_sink_hand_built():
    """One key dominates every softmax row: p_i1 → 1 and, with ρ = 0, the Parallax share → 1 too."""
    T, D = 6, 2
    q = torch.tensor([[10.0, 0.0]]).repeat(T, 1)
    k = torch.tensor([[10.0, 0.0]] + [[0.0, 1.0]] * (T - 1))
    v = torch.randn(T, D)
    d = analyze.head_diagnostics(q, k, v, torch.zeros(T, D), 1.0, torch.arange(1, T))
    assert torch.allclose(d["sink_p"], torch.ones(T - 1, dtype=torch.float64), atol=1e-30)
    assert torch.allclose(d["sink"], torch.ones(T - 1, dtype=torch.float64))
    # uniform keys: p_i1 = 1/(i+1) exactly
    d = analyze.head_diagnostics(q, torch.zeros(T, D), v, None, 1.0, torch.arange(T))
    assert torch.allclose(d["sink_p"], 1 / torch.arange(1, T + 1, dtype=torch.float64))


def test_eval_ppl_matches_trainer_validation(parallax_run, corpus, tmp_path):
    """Validation in the trainer (2 steps × batch 2 × seq 16 at step 3) is an independent computation."""
    out = tmp_path / "ppl.json"
    res = eval_ppl.main([str(parallax_run), "--data", corpus["val"], "--batch-size", "2", "--max-rows", "4",
                         "--no-progress", "-o", str(out), "--", *_flags(corpus, "parallax")])
    val = [r for r in read_metrics(parallax_run) if "val_loss" in r and r["step"] == 3][-1]
    assert res["tokens"] == 64 and res["loss"] == pytest.approx(val["val_loss"], rel=1e-5)
    assert json.loads(out.read_text())["ppl"] == pytest.approx(math.exp(res["loss"]))


def test_eval_ppl_equals_exp_mean_loss_by_hand(parallax_run, corpus):
    from attnlab.data.loader import build_tokenizer
    from attnlab.checkpoint.load import load_model

    model, cfg, _ = load_model(parallax_run, _flags(corpus, "parallax"))
    tok = build_tokenizer(cfg)
    stream = []
    for line in open(corpus["val"]):
        stream += tok.encode(json.loads(line)["text"], add_bos=True, add_eos=True)
    rows = [torch.tensor(stream[i * 17:(i + 1) * 17]) for i in range(3)]
    nll = []
    with torch.no_grad():
        for row in rows:  # documents are 17 tokens with BOS/EOS: one document per row, plain causal
            logits = model(row[None, :-1])[0].double()
            nll += (-torch.log_softmax(logits, -1)[torch.arange(16), row[1:]]).tolist()
    res = eval_ppl.evaluate(model, eval_ppl.packed_rows(corpus["val"], cfg, tok, 16), 2, 3, progress=False)
    assert res["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)


@pytest.mark.parametrize("task", synthetic.TASKS)
def test_synthetic_generators_structure(task):
    spec = synthetic.TaskSpec(vocab=16, seq_len=48, n_copy=8)
    x, y = synthetic.GENERATORS[task](spec, 5, torch.Generator().manual_seed(3))
    assert x.dtype == torch.long and x.min() >= 0 and x.max() < spec.vocab_size()
    scored = y != synthetic.IGNORE
    assert scored.any()
    if task == "compression":
        assert torch.equal(y, x[:, :-1]) and (x[:, -1] == synthetic.MARK).all()
        return
    assert x.shape == y.shape == (5, 48)
    for b in range(5):
        for t in scored[b].nonzero().flatten().tolist():
            target = int(y[b, t])
            if task in ("recall", "noisy_recall", "mqar"):  # the value follows the same key earlier in context
                key = int(x[b, t])
                earlier = [int(x[b, j + 1]) for j in range(t) if int(x[b, j]) == key]
                assert earlier and earlier[-1] == target
            elif task == "fuzzy_recall":  # the preceding key span occurred earlier, followed by the target
                assert target in x[b, :t].tolist()
            elif task == "selective_copy":  # copy order: the k-th scored position gets the k-th data token
                L = spec.seq_len - spec.n_copy
                data = [int(tk) for tk in x[b, : L - 1] if tk != synthetic.BLANK]
                assert target == data[t - (L - 1)]
            elif task == "memorization":
                assert t % 2 == 0 and target == int(x[b, t + 1])


def test_memorization_map_is_global():
    spec = synthetic.TaskSpec(vocab=16, seq_len=32)
    seen = {}
    for seed in (1, 2):
        x, y = synthetic.gen_memorization(spec, 4, torch.Generator().manual_seed(seed))
        for k, v in zip(x[:, 0::2].flatten().tolist(), y[:, 0::2].flatten().tolist()):
            assert seen.setdefault(k, v) == v


@pytest.mark.slow  # ~10 s on an idle 2-core machine, over a minute under load
def test_softmax_learns_in_context_recall():
    spec = synthetic.TaskSpec(vocab=8, seq_len=24)  # 4 keys, 4 values: chance = 0.25
    r = synthetic.train_task("recall", "softmax", spec, steps=40, batch=16, lr=2e-2, eval_batch=64)
    assert r["acc"] > 0.5, r


def test_eval_and_analyze_rebuild_the_run_from_its_config_toml(parallax_run, corpus, tmp_path):
    """Without any training flag a Parallax run is evaluated as Parallax (it was silently built as softmax): the
    training run itself leaves config.toml and its tokenizer; a copy without them needs the flags."""
    import shutil

    run = parallax_run
    assert (run / "config.toml").is_file() and (run / "tokenizer" / "tokenizer.json").is_file()
    bare = tmp_path / "bare"
    shutil.copytree(run / "checkpoint", bare / "checkpoint")
    explicit = eval_ppl.main([str(bare), "--data", corpus["val"], "--batch-size", "2", "--max-rows", "4",
                              "--no-progress", "--", *_flags(corpus, "parallax")])
    res = eval_ppl.main([str(run), "--data", corpus["val"], "--batch-size", "2", "--max-rows", "4", "--no-progress"])
    assert res["attention"] == "parallax" and res["loss"] == explicit["loss"]
    assert res["checkpoint"].endswith("step-3") and res["step"] == 3
    res = eval_ppl.main([str(run / "checkpoint" / "step-3"), "--data", corpus["val"], "--max-rows", "2",
                         "--no-progress"])  # a step folder finds its run's config too
    assert res["attention"] == "parallax"
    out = analyze.main([str(run), "--step", "3", "--data", corpus["val"], "--seq-len", "16", "--min-len", "8",
                        "--rows", "2", "--queries", "4", "-o", str(tmp_path / "an"), "--no-plots"])
    assert out["attention"] == "parallax" and "cor" in out["layers"][0]["activations"]
    with pytest.raises(SystemExit):
        eval_ppl.main([str(run), "--step", "7", "--data", corpus["val"]])  # no step-7: one clear error
    with pytest.raises(SystemExit) as e:
        eval_ppl.main([str(run), "--data", corpus["val"], "--model.attention", "softmax"])  # unknown flag
    assert e.value.code == 2


def test_analyze_records_rho_gain_and_probe_norm_per_layer(parallax_run, corpus):
    """A uniform ρ-norm gain g gives ‖ρ_i‖ = √head_dim · g at every query; both land per layer and in the summary."""
    from attnlab.checkpoint.load import load_model

    model, cfg, _ = load_model(parallax_run, _flags(corpus, "parallax"))
    with torch.no_grad():
        for i, layer in model.layers.items():
            layer.attention.r_norm.weight.fill_(0.25 * (1 + int(i)))
    res = analyze.analyze(model, [torch.tensor([0, 5, 9, 12, 7, 30, 31, 4, 8, 2, 11])], n_queries=5, min_pos=2)
    for layer in res["layers"]:
        g = 0.25 * (1 + layer["layer"])
        assert layer["rho_norm_gain"] == pytest.approx({"mean": g, "min": g, "max": g})
        hd = model.layers[str(layer["layer"])].attention.head_dim
        assert layer["activations"]["probe_norm"]["mean"] == pytest.approx(math.sqrt(hd) * g, rel=1e-3)
    assert res["summary"]["rho_gain"] == pytest.approx(0.25 * (1 + 2 + 3 + 4) / 4)


def test_position_edges_are_log_spaced_up_to_the_length():
    assert eval_ppl.position_edges(1) == [0, 1]
    assert eval_ppl.position_edges(16) == [0, 1, 2, 4, 8, 16]
    assert eval_ppl.position_edges(17) == [0, 1, 2, 4, 8, 16, 17]
    assert eval_ppl.position_edges(32768)[-3:] == [8192, 16384, 32768]


@pytest.mark.parametrize("mask", ["block_causal", "causal"])
def test_eval_ppl_by_position_matches_per_token_losses(parallax_run, corpus, mask, capsys):
    """Rows of 32 tokens hold 17-token documents cut anywhere. Each bucket's loss is the mean loss of the tokens
    whose context (their document's prefix under block_causal, their row's prefix under causal) has a length in
    it, computed here from a forward pass over each document (block_causal) or row (causal) alone."""
    import itertools

    from attnlab.data.loader import build_tokenizer
    from attnlab.checkpoint.load import load_model

    flags = ["--model.attn_mask_type", mask]
    res = eval_ppl.main([str(parallax_run), "--data", corpus["val"], "--seq-len", "32", "--batch-size", "2",
                         "--max-rows", "3", "--by-position", "--no-progress", "--", *flags])
    model, cfg, _ = load_model(parallax_run, flags)
    edges = eval_ppl.position_edges(32)
    sums, counts = [0.0] * (len(edges) - 1), [0] * (len(edges) - 1)
    for x, pos, y in itertools.islice(eval_ppl.packed_rows(corpus["val"], cfg, build_tokenizer(cfg), 32), 3):
        starts = [t for t in range(32) if t == 0 or (mask == "block_causal" and int(pos[t]) == 0)]
        for a, b in zip(starts, starts[1:] + [32]):  # a document (or the row) on its own, positions from 0
            with torch.no_grad():
                nll = -torch.log_softmax(model(x[None, a:b])[0].double(), -1)[torch.arange(b - a), y[a:b]]
            for seen, loss in enumerate(nll.tolist()):
                k = max(i for i in range(len(edges) - 1) if edges[i] <= seen)
                sums[k] += loss
                counts[k] += 1
    assert [b["tokens"] for b in res["by_position"]] == counts and sum(counts) == res["tokens"] == 96
    for b, s, n in zip(res["by_position"], sums, counts):
        assert b["start"] < b["end"] and b["loss"] == pytest.approx(s / n, rel=1e-4)
    assert sum(sums) / 96 == pytest.approx(res["loss"], rel=1e-5)
    if mask == "block_causal":  # 17-token documents: few tokens see 16 or more tokens of their own document
        assert counts[-1] < 16
    out = capsys.readouterr().out
    assert f"loss by context position ({mask} mask, seq_len 32)" in out and "      16-31 " in out


@pytest.mark.parametrize("flags,message", [(["--edges", "0,8"], "--edges needs --by-position"),
                                           (["--by-position", "--edges", "1,8"], "must start at 0 and increase"),
                                           (["--by-position", "--edges", "0,a"], "not a comma list of integers")])
def test_eval_ppl_bad_edges(parallax_run, corpus, capsys, flags, message):
    with pytest.raises(SystemExit):
        eval_ppl.main([str(parallax_run), "--data", corpus["val"], "--no-progress", *flags])
    assert message in capsys.readouterr().err


WORD_TEMPLATE = passkey.Template(intro="w1 w2 w3", filler=" w4 w5 w6 w7 w8", needle=" w9 w10{key} w11{key} w12",
                                 question=" w13 w14", alphabet=tuple(f"w{i}" for i in range(20, 60)), key_len=3,
                                 separator=" ")


def _word_encoder(corpus):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{corpus['tokenizer']}/tokenizer.json")
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def _contains(ids: list[int], part: list[int]) -> int:
    return sum(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


@pytest.mark.parametrize("length", [20, 41, 64])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_prompt_holds_the_key_at_its_depth(corpus, length, depth):
    encode = _word_encoder(corpus)
    symbols = ["w23", "w45", "w31"]
    pieces = passkey.tokenize(encode, 0, symbols, WORD_TEMPLATE)
    key = encode(" w23 w45 w31")
    needle = encode(" w9 w10") + key + encode(" w11") + key + encode(" w12")
    assert pieces.key == key and len(key) == 3 and pieces.needle == needle
    assert pieces.min_length == 4 + 10 + 2 + 3 - 1  # BOS + intro, needle, question, key; the last key token unread
    p = passkey.build_prompt(pieces, length, depth)
    assert len(p.ids) == length + 1 and p.ids[0] == 0 and p.ids[-3:] == key == p.key
    assert _contains(p.ids, key) == 3  # twice in the needle, once as the answer
    assert p.ids[p.needle_at:p.needle_at + 10] == needle
    filler = length - pieces.min_length
    before = p.needle_at - 4  # filler tokens before the needle: whole 5-token passages, about depth · filler
    assert before % 5 == 0 or before == filler
    assert abs(before - depth * filler) <= 2.5
    with pytest.raises(ValueError, match="shorter than the passkey prompt's 18 tokens"):
        passkey.build_prompt(pieces, pieces.min_length - 1, depth)


class _Oracle(torch.nn.Module):
    """Predicts the next token of ``truth`` [B, T + 1] at every position (logit 5 on it, 0 elsewhere), except
    that at the (row, position) pairs of ``wrong`` it predicts token 0."""

    def __init__(self, truth: torch.Tensor, vocab: int, wrong: list[tuple[int, int]]):
        super().__init__()
        self.truth, self.vocab, self.wrong = truth, vocab, wrong
        self.norm, self.output = torch.nn.Identity(), torch.nn.Identity()

    def forward(self, tokens):
        nxt = self.truth[:, 1:tokens.shape[1] + 1].clone()
        assert torch.equal(tokens, self.truth[:, :tokens.shape[1]])  # the model reads the prompt as given
        for b, t in self.wrong:
            nxt[b, t] = 0
        return self.output(self.norm(5.0 * torch.nn.functional.one_hot(nxt, self.vocab).float()))


def test_passkey_scoring_counts_only_an_exact_continuation():
    """Prompts of 8 tokens with keys of 2 and 3 tokens: a wrong prediction inside a key misses it, one just
    before the key (a prompt token, not scored) does not; the log-probability sums the key's tokens only."""
    ids = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 5, 6, 7, 8, 9, 13, 14, 15]]  # L = 8, + the key's last token
    prompts = [passkey.Prompt(ids[0], [11, 12], 0), passkey.Prompt(ids[1], [13, 14, 15], 0)]
    truth = torch.tensor(ids)
    one = float(torch.log_softmax(torch.tensor([5.0] + [0.0] * 19), 0)[0])  # log p of a right token
    zero = float(torch.log_softmax(torch.tensor([5.0] + [0.0] * 19), 0)[1])  # log p of the key when 0 is predicted
    for wrong, hits, logps in [
        ([], [True, True], [2 * one, 3 * one]),
        ([(0, 5)], [True, True], [2 * one, 3 * one]),  # row 0 predicts its token 6 (w10) wrong: not the key
        ([(1, 5)], [True, False], [2 * one, 2 * one + zero]),  # row 1's key starts at token 6, predicted at 5
        ([(0, 7)], [False, True], [one + zero, 3 * one]),  # the key's last token
    ]:
        h, lp = passkey.score(_Oracle(truth, 20, wrong), prompts)
        assert h == hits and lp == pytest.approx(logps), wrong


def test_passkey_scoring_agrees_with_greedy_decoding(parallax_run):
    """With the trained model, a prompt whose key is the model's own greedy continuation (models.decode) scores as
    retrieved with the log-probability decoding saw; the same prompt with its key's last token changed misses."""
    from attnlab.checkpoint.load import load_model
    from attnlab.models.decode import generate

    model, _, _ = load_model(parallax_run)
    prefix = torch.tensor([[0, 7, 8, 9, 10, 11, 12, 13, 30, 31, 32, 5, 6],
                           [0, 40, 41, 42, 3, 4, 5, 50, 51, 52, 53, 8, 9]])
    res = generate(model, prefix, 3, greedy=True, keep_logits=True)
    keys = res.tokens[:, -3:]
    good = [passkey.Prompt(row, row[-3:], 0) for row in res.tokens.tolist()]
    hits, logps = passkey.score(model, good)
    expect = [sum(float(torch.log_softmax(res.step_logits[i][b], -1)[keys[b, i]]) for i in range(3)) for b in range(2)]
    assert hits == [True, True] and logps == pytest.approx(expect, rel=1e-4)
    bad = [passkey.Prompt(p.ids[:-1] + [(p.ids[-1] + 1) % 64], p.ids[-3:-1] + [(p.ids[-1] + 1) % 64], 0) for p in good]
    assert passkey.score(model, bad)[0] == [False, False]


def test_passkey_tool_on_a_run(parallax_run, capsys, tmp_path):
    """The default English prompt does not fit the run's 16 tokens: one line naming --lengths; with --lengths the
    table and JSON have a cell per (length, depth), lengths past training noted as extrapolation."""
    with pytest.raises(SystemExit):
        passkey.main([str(parallax_run)])
    assert "pass --lengths" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        passkey.main([str(parallax_run), "--lengths", "47", "--depths", "0,1"])
    assert "--lengths '47': 47 is shorter than the passkey prompt's 48 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        passkey.main([str(parallax_run), "--lengths", "64", "--depths", "0,1.5"])
    assert "--depths '0,1.5': every depth must be in [0, 1]" in capsys.readouterr().err
    out = tmp_path / "pk.json"
    res = passkey.main([str(parallax_run), "--lengths", "48,64", "--depths", "0,0.5", "--samples", "2",
                        "--batch-size", "2", "-o", str(out)])
    printed = capsys.readouterr()
    assert "test extrapolation" in printed.err
    assert [(r["length"], r["depth"]) for r in res["results"]] == [(n, d) for n in (48, 64) for d in (0, 0.5)]
    assert all(0 <= r["accuracy"] <= 1 and r["logprob"] <= 0 for r in res["results"])
    assert res["attention"] == "parallax" and res["train_seq_len"] == 16 and json.loads(out.read_text()) == res
    assert "depth 0.50" in printed.out and printed.out.splitlines()[-1] == json.dumps(res)
