"""The FLOP counts behind MFU: each mechanism's ``flops_per_token`` counts the (query, key) pairs its causal mask
keeps, checked against the pairs of the boolean mask the reference paths use; ``ModelArgs.training_flops`` over a
document-masked batch, checked against a count on the batch's block-causal mask."""

import pytest
import torch

from attnlab import attention
from attnlab.attention.base import AttentionArgs, AttentionContext, causal_pairs
from attnlab.attention.ops.common import visibility_mask
from attnlab.attention.registry import REGISTRY
from attnlab.data.loader import document_lengths
from attnlab.models.args import get_flavor
from attnlab.models.model import Transformer


def _pairs(T: int, window: int = 0) -> int:
    """(query, key) pairs of the mask the reference paths attend with."""
    return int(visibility_mask(1, T, "cpu", None, window or None).sum())


@pytest.mark.parametrize("window", [0, 1, 3, 8])
def test_causal_pairs_count_the_mask(window):
    for T in range(1, 20):
        assert causal_pairs(T, window) == _pairs(T, window), (T, window)


def _module(name: str, **opts) -> torch.nn.Module:
    args = AttentionArgs(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, impl="reference")
    with torch.device("meta"):
        return attention.build_attention(name, args, REGISTRY[name].options(**opts))


QUADRATIC = {"softmax", "parallax", "fox", "path", "lla"}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_mechanism_counts_causal_pairs_or_does_not_grow_with_T(name):
    """A quadratic mechanism's work over a causal sequence of T tokens is a fixed cost per kept (query, key) pair,
    so T·flops_per_token(T) = flops_per_token(1)·pairs(T) (the non-causal count T² would fail from T = 2); every
    other mechanism's cost per token is bounded: it stops growing once T passes its chunk (and, for CALA, its
    window: the average approaches w keys from below)."""
    m = _module(name)
    if name in QUADRATIC:
        per_pair = m.flops_per_token(1)
        for T in (2, 3, 7, 16, 33):
            assert T * m.flops_per_token(T) == per_pair * _pairs(T), (name, T)
    else:
        assert 0 < m.flops_per_token(4096) <= m.flops_per_token(1 << 20) <= 1.01 * m.flops_per_token(4096), name


def test_sliding_window_counts_the_window():
    for name in ("softmax", "parallax"):
        full, windowed = _module(name), _module(name, window_size=4)
        per_pair = full.flops_per_token(1)
        for T in (1, 3, 4, 5, 17):
            assert abs(T * windowed.flops_per_token(T) - per_pair * _pairs(T, 4)) <= 2 * T, (name, T)  # whole FLOPs
        assert abs(windowed.flops_per_token(1 << 16) - 4 * per_pair) <= 2  # 4 keys a query, past the first 3
    cala, cala_w1 = _module("cala", window_size=8), _module("cala", window_size=1)
    # the local step's two streams cost 2·2·2·H·D a kept pair; the window changes nothing else
    for T in (5, 8, 100):
        diff = 2 * 2 * 2 * 4 * 16 * (_pairs(T, 8) - _pairs(T, 1))
        got = T * cala.flops_per_token(T) - T * cala_w1.flops_per_token(T)
        assert got == pytest.approx(diff, abs=2 * 4 * T)  # each of H heads floors its per-token count


def _debug_model(**kw) -> Transformer:
    args = get_flavor("debug")
    for k, v in kw.items():
        setattr(args, k, v)
    with torch.device("meta"):
        return Transformer(args)


def test_training_flops_of_a_document_masked_batch_count_its_mask():
    """Positions of two packed rows (documents of 3, 5, 2 | 6, 4 tokens) → their lengths → training FLOPs equal
    6·dense·tokens + 3·layers·4·H·D·(pairs of the batch's block-causal mask), counted on that mask."""
    model = _debug_model(attention="softmax", attn_mask_type="block_causal")
    a = model.model_args
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    lens = document_lengths(positions)
    assert lens == [3, 5, 2, 6, 4]
    ctx = AttentionContext.from_positions(positions, True, 1e6)
    pairs = int(visibility_mask(2, 10, "cpu", ctx.cu_seqlens).sum())
    assert pairs == sum(n * (n + 1) // 2 for n in lens)
    nparams = sum(p.numel() for p in model.parameters())
    dense = nparams - model.tok_embeddings.weight.numel() + a.vocab_size * a.dim  # tied: the LM head matmul counts
    expect = 6 * dense * 20 + 3 * a.n_layers * 4 * a.n_heads * a.head_dim * pairs
    assert a.training_flops(model, lens) == expect
    # one causal row of 10 tokens does more attention than the same tokens cut into documents
    assert a.training_flops(model, [10, 10]) > expect
    # linear in the documents: a trainer may cache the count per length and sum over a step's documents
    assert a.training_flops(model, lens) == sum(a.training_flops(model, [n]) for n in lens)
    with pytest.raises(ValueError, match="document lengths must be >= 1"):
        a.training_flops(model, [3, 0])


@pytest.mark.parametrize("mech", ["softmax", "parallax", "gdn", "cala"])
def test_per_token_flops_are_one_causal_document(mech):
    model = _debug_model(attention=mech)
    nparams, per_token = model.model_args.get_nparams_and_flops(model, 64)
    assert nparams == sum(p.numel() for p in model.parameters())
    assert per_token * 64 == model.model_args.training_flops(model, [64])


def test_document_lengths_start_every_row():
    """A row that begins mid-document (position ≠ 0) still starts a document: the mask cuts at row starts."""
    positions = torch.tensor([[5, 6, 0, 1], [2, 3, 4, 5]])
    assert document_lengths(positions) == [2, 2, 4]
