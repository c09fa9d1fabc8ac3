"""Model: parameter counts on the meta device, document isolation, hybrid layer patterns, the per-step context
(RoPE table built once, host syncs)."""

import pytest
import torch

from attnlab.attention.base import AttentionContext
from attnlab.models.args import FLAVORS, get_flavor
from torchtitan.models.qwen3.model.model import precompute_rope_cache

from attnlab.models import model as model_module
from attnlab.models.model import Transformer

# Qwen3-0.6B as published (tied embeddings): 596,049,920 parameters.
QWEN3_06B = 596_049_920


def _count(flavor, **kw):
    args = get_flavor(flavor)
    for k, v in kw.items():
        setattr(args, k, v)
    with torch.device("meta"):
        model = Transformer(args)
    return model, sum(p.numel() for p in model.parameters())


def arch_count(dim, L, HQ, HKV, D, F, V, probe=False):
    """Independent count: embeddings (tied) + per layer attention, q/k(/ρ) norms, SwiGLU, 2 norms + final norm."""
    attn = dim * HQ * D + 2 * dim * HKV * D + HQ * D * dim + 2 * D
    if probe:
        attn += dim * HQ * D + D
    return V * dim + L * (attn + 3 * dim * F + 2 * dim) + dim


@pytest.mark.parametrize("flavor,mech,expect", [
    ("0.6B", "softmax", QWEN3_06B),
    ("0.6B", "parallax", arch_count(1024, 28, 16, 8, 128, 3072, 151936, probe=True)),
    ("0.6B-T24", "softmax", arch_count(1024, 28, 24, 8, 128, 3072, 151936)),
    ("0.6B-P64", "parallax", arch_count(1024, 28, 16, 8, 64, 4480, 151936, probe=True)),
    ("1.7B", "softmax", arch_count(2048, 28, 16, 8, 128, 6144, 151936)),
    ("1.7B", "parallax", arch_count(2048, 28, 16, 8, 128, 6144, 151936, probe=True)),
])
def test_param_counts_on_meta(flavor, mech, expect):
    assert arch_count(1024, 28, 16, 8, 128, 3072, 151936) == QWEN3_06B
    model, n = _count(flavor, attention=mech)
    assert n == expect
    nparams, flops = model.model_args.get_nparams_and_flops(model, 4096)
    assert nparams == expect
    # causal: query i sees i keys, (4096 + 1) / 2 per query on average
    mixing = (2 if mech == "parallax" else 1) * 4 * model.model_args.n_heads * model.model_args.head_dim * 4097 // 2
    # tied weights: the embedding lookup costs nothing, but the LM head matmul is real, so 6·(all parameters)
    assert flops == 6 * expect + 3 * 28 * mixing


def test_layer_pattern_repeats_over_depth():
    model, _ = _count("debug", layer_pattern=["softmax", "softmax", "parallax"], n_layers=5)
    kinds = [type(layer.attention).__name__ for layer in model.layers.values()]
    assert kinds == ["SoftmaxAttention", "SoftmaxAttention", "ParallaxAttention", "SoftmaxAttention", "SoftmaxAttention"]


def _tiny(mech, impl="auto"):
    args = get_flavor("debug")
    args.attention, args.attn_impl, args.attn_mask_type, args.n_layers, args.vocab_size = mech, impl, "block_causal", 2, 64
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


@pytest.mark.parametrize("mech,impl", [("softmax", "auto"), ("softmax", "reference"), ("parallax", "auto")])
def test_no_attention_across_documents(mech, impl):
    model = _tiny(mech, impl)
    tokens = torch.randint(0, 64, (2, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])
    ref = model(tokens, pos)
    changed = tokens.clone()
    changed[0, :5] = (changed[0, :5] + 7) % 64  # rewrite document 1 of row 0
    changed[1, 8:] = (changed[1, 8:] + 3) % 64  # rewrite the last document of row 1
    out = model(changed, pos)
    torch.testing.assert_close(out[0, 5:], ref[0, 5:], rtol=0, atol=1e-6)  # document 2 of row 0 unchanged
    torch.testing.assert_close(out[1, :8], ref[1, :8], rtol=0, atol=1e-6)
    assert (out[0, :5] - ref[0, :5]).abs().max() > 1e-3  # and the edit did change the edited document


def test_context_from_positions():
    pos = torch.tensor([[0, 1, 0, 1, 2], [3, 4, 0, 1, 2]])  # row 1 starts mid-document: still a boundary
    ctx = AttentionContext.from_positions(pos, True, 1e6)
    assert ctx.cu_seqlens.tolist() == [0, 2, 5, 7, 10] and ctx.max_seqlen == 3


def test_rope_table_is_built_once_and_matches_torchtitan(monkeypatch):
    model = _tiny("softmax")
    built = []
    monkeypatch.setattr(model_module, "precompute_rope_cache", lambda *a: built.append(a) or precompute_rope_cache(*a))
    D, L, theta = model.model_args.head_dim, model.model_args.max_seq_len, model.model_args.rope_theta
    for T in (12, 12, 7):  # three steps, two shapes: one table of max_seq_len rows serves them all
        tokens = torch.randint(0, 64, (2, T))
        pos = torch.cat([torch.arange(5), torch.arange(T - 5)]).expand(2, T)
        ctx = model.context(tokens, pos)
        table = precompute_rope_cache(D, L, theta)  # torchtitan's table, indexed by position
        cos, sin = ctx.rope(D)
        assert cos.shape == (2, T, 1, D) and sin.shape == (2, T, 1, D)
        assert torch.equal(cos[:, :, 0], table[pos][..., :D]) and torch.equal(sin[:, :, 0], table[pos][..., D:])
    assert built == [(D, L, theta)]
    assert torch.equal(model.rope_table(D, L, "cpu"), precompute_rope_cache(D, L, theta))


SYNCS = {"item", "tolist", "nonzero", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"}


class _SyncSpy(torch.Tensor):
    """Positions that record every call which reads tensor data back to the host (a host sync on a GPU);
    results of ops on them are spies too, so derived tensors are followed."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS or (name == "to" and "cpu" in map(str, [*args[1:], *(kwargs or {}).values()])):
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("mask, reads, host_documents", [
    ("causal", [], False),
    ("block_causal", ["nonzero", "__int__"], False),  # the document starts and the longest document
    ("block_causal", [], True),  # the trainer's case: the offsets computed on the host (attnlab/trainer/step.py)
])
def test_context_reads_the_device_only_without_host_documents(mask, reads, host_documents):
    """No host sync per step for causal rows, nor for packed documents whose offsets the trainer computed on the host
    before the copy; without them, two reads (the size of cu_seqlens depends on the data)."""
    model = _tiny("softmax")
    model.model_args.attn_mask_type = mask
    T = 12
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])
    documents = AttentionContext.document_offsets(pos) if host_documents else None
    _SyncSpy.reads = []
    ctx = model.context(torch.randint(0, 64, (2, T)).as_subclass(_SyncSpy), pos.as_subclass(_SyncSpy), documents)
    ctx.rope(model.model_args.head_dim)
    assert _SyncSpy.reads == reads
    _SyncSpy.reads = []  # the causal case again with the spy as the positions themselves (the model makes its own)
    ctx = AttentionContext.from_positions(pos.as_subclass(_SyncSpy), mask == "block_causal", 1e6, documents)
    ctx.use_rope_table(model.rope_table(model.model_args.head_dim, T, "cpu"))
    ctx.rope(model.model_args.head_dim)
    assert _SyncSpy.reads == reads
    if mask == "block_causal":
        cu = ctx.cu_seqlens.as_subclass(torch.Tensor)
        assert torch.equal(cu, torch.tensor([0, 5, 12, 20, 24], dtype=torch.int32))
        assert ctx.max_seqlen == 8


def test_flavors_are_fresh_copies():
    a = get_flavor("debug")
    a.vocab_size = 1
    assert FLAVORS["debug"].vocab_size == 4096 and get_flavor("debug").vocab_size == 4096
    with pytest.raises(ValueError, match="model.flavor='2B'"):
        get_flavor("2B")
