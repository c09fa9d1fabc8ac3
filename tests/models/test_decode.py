"""Cached decoding (attnlab/models/decode.py) against repeated full forwards, for every mechanism with init_cache."""

import pytest
import torch

from attnlab import attention
from attnlab.attention.base import AttentionArgs, AttentionContext
from attnlab.models.args import ModelArgs
from attnlab.models.decode import forward_cached, generate, init_caches, sample
from attnlab.checkpoint.dcp import build_model

CACHED = sorted(n for n, m in attention.REGISTRY.items() if hasattr(m.cls, "init_cache"))


def _tiny(mech: str, n_layers: int = 2, vocab_size: int = 53, **opts) -> torch.nn.Module:
    args = ModelArgs(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
                     vocab_size=vocab_size,
                     max_seq_len=64, attention=mech, attn_impl="auto",
                     attention_options={mech: attention.get_mechanism(mech).options(**opts)})
    torch.manual_seed(0)
    model = build_model(args)
    with torch.no_grad():  # make norms and zero-initialised pieces non-trivial
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name or p.abs().max() == 0:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _full_greedy(model, prompt, n):
    toks, logits = prompt, []
    for _ in range(n):
        last = model(toks)[:, -1]
        logits.append(last)
        toks = torch.cat([toks, last.argmax(-1, keepdim=True)], 1)
    return toks, logits


@pytest.mark.parametrize("mech,opts", [("softmax", {}), ("softmax", {"window_size": 4}), ("parallax", {}),
                                       ("parallax", {"rho_gate": True, "rope_on_rho": False})])
def test_greedy_cache_equals_full_forward_softmax_parallax(mech, opts):
    model = _tiny(mech, **opts)
    prompt = torch.randint(0, 53, (2, 7), generator=torch.Generator().manual_seed(1))
    res = generate(model, prompt, 6, greedy=True, keep_logits=True)
    ref, ref_logits = _full_greedy(model, prompt, 6)
    assert torch.equal(res.tokens, ref)
    for a, b in zip(res.step_logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mech", [m for m in CACHED if m not in ("softmax", "parallax")])
def test_greedy_cache_equals_full_forward_other_mechanisms(mech):
    model = _tiny(mech, n_layers=1)
    prompt = torch.randint(0, 53, (2, 5), generator=torch.Generator().manual_seed(2))
    res = generate(model, prompt, 3, greedy=True, keep_logits=True)
    ref, ref_logits = _full_greedy(model, prompt, 3)
    for a, b in zip(res.step_logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)
    assert torch.equal(res.tokens, ref)


def test_kv_cache_rows_of_different_lengths_match_reference():
    """The softmax/Parallax KV cache with per-row lengths: row 1 holds 3 tokens fewer than row 0."""
    mech = attention.get_mechanism("parallax")
    args = AttentionArgs(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, impl="auto")
    m = mech.cls(args, mech.options()).double()
    with torch.no_grad():
        m.init_weights(0.02)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    full = [m(x[b:b + 1, :n], AttentionContext.from_positions(torch.arange(n)[None], False, 1e6))
            for b, n in ((0, 9), (1, 6))]
    cache = m.init_cache(2, 12, "cpu", torch.float64)
    # prefill 5 tokens in row 0 and 2 in row 1 by running them separately through a batch-1 view of the cache
    from attnlab.attention.softmax import KVCache
    for b, n0 in ((0, 5), (1, 2)):
        sub = KVCache(cache.k[b:b + 1], cache.v[b:b + 1], cache.seqlens[b:b + 1])
        m(x[b:b + 1, :n0], AttentionContext(positions=torch.arange(n0)[None], cache=sub))
    assert cache.seqlens.tolist() == [5, 2]
    outs = []
    for t in range(4):  # both rows step together, at different absolute positions
        pos = (cache.seqlens.long()[:, None]).clone()
        xt = torch.stack([x[0, 5 + t], x[1, 2 + t]])[:, None]
        outs.append(m(xt, AttentionContext(positions=pos, cache=cache)))
    o = torch.cat(outs, 1)  # [2, 4, dim]
    torch.testing.assert_close(o[0], full[0][0, 5:9], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o[1], full[1][0, 2:6], rtol=1e-10, atol=1e-10)


def test_cache_overflow_and_sampling_filters():
    model = _tiny("softmax")
    state = init_caches(model, 1, 4)
    forward_cached(model, torch.zeros(1, 4, dtype=torch.long), state)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        forward_cached(model, torch.zeros(1, 1, dtype=torch.long), state)
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, 1.0, top_k=2, generator=g)) for _ in range(200)}
    assert draws == {1, 2}  # top-k keeps exactly the two largest
    draws = {int(sample(logits, 1.0, top_p=0.3, generator=g)) for _ in range(100)}
    assert draws == {1}  # the top token alone holds > 30 % of the mass
    assert int(sample(logits, greedy=True)) == 1


def test_generate_script_greedy_matches_full_forward(tmp_path, capsys):
    from attnlab.checkpoint.hf import save_hf
    from attnlab.tools import generate as script

    model = _tiny("parallax")
    save_hf(model.state_dict(), model.model_args, tmp_path / "hf")
    prompt = torch.tensor([[5, 17, 3, 40]])
    assert script.main([str(tmp_path / "hf"), "--prompt", "5 17 3 40", "--tokenizer", "ids", "--greedy",
                        "--max-new-tokens", "5", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [int(t) for t in out[0].split()] == _full_greedy(model, prompt, 5)[0][0].tolist()
    assert "tokens/s" in out[-1]
    assert script.main([str(tmp_path / "hf"), "--prompt", "5 99", "--tokenizer", "ids"]) == 2
    assert "outside the model's vocabulary" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("mech", ["softmax", "parallax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_kernel_matches_full_forward(mech, dtype):
    """On CUDA the cached path runs the split-KV Triton decode kernel (prefill TQ > 1, then TQ = 1)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _tiny(mech).to("cuda", dtype)
    prompt = torch.randint(0, 53, (3, 37), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    res = generate(model, prompt, 8, greedy=True, keep_logits=True)
    toks = res.tokens
    with torch.no_grad():
        full = model(toks[:, :-1])[:, prompt.shape[1] - 1:].float()  # logits that chose each new token
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    for i, step in enumerate(res.step_logits):
        torch.testing.assert_close(step, full[:, i], rtol=tol, atol=tol)


def test_decode_builds_the_rope_table_once(monkeypatch):
    """Decoding gathers from the model's RoPE table: one table for the whole generation, none per step or layer
    (a per-step table grows with the position), and the tokens equal the full forward's."""
    from attnlab.attention import base as attention_base
    from attnlab.models import model as model_module

    model = _tiny("parallax")
    prompt = torch.randint(0, 53, (2, 5), generator=torch.Generator().manual_seed(3))
    ref, _ = _full_greedy(model, prompt, 4)
    model._rope_tables.clear()
    built = []
    real = model_module.precompute_rope_cache
    monkeypatch.setattr(model_module, "precompute_rope_cache", lambda *a: built.append(a) or real(*a))
    monkeypatch.setattr(attention_base, "precompute_rope_cache", lambda *a: pytest.fail("RoPE table built per step"))
    res = generate(model, prompt, 4, greedy=True)
    assert torch.equal(res.tokens, ref) and len(built) == 1
