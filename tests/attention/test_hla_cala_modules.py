"""hla and cala modules: registry/options, shapes, causality, packed documents, decode == full forward,
meta-device construction + init_weights, option validation naming the TOML key."""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import build_attention, get_mechanism
from attnlab.attention.base import AttentionArgs, AttentionContext
from attnlab.attention.cala import CALAOptions
from attnlab.attention.hla import HLAOptions
from attnlab.attention.ops.cala import naive_cala

ARGS = AttentionArgs(dim=32, n_heads=4, n_kv_heads=2, head_dim=8)
HLA_OPTS = [
    HLAOptions(),
    HLAOptions(variant="asymmetric", decay="fixed", normalize=True),
    HLAOptions(order=3, decay="none", normalize=True, qk_norm="rms", rope=True, output_gate=True),
    HLAOptions(decay="fixed", gamma_init=0.99, gamma_init_min=0.5, chunk_size=4),
]
CALA_OPTS = [CALAOptions(window_size=3), CALAOptions(window_size=2, feature_map="favor", feature_dim=6),
             CALAOptions(window_size=5, feature_map="relu", local_feature_map="softplus")]
CASES = [("hla", o) for o in HLA_OPTS] + [("cala", o) for o in CALA_OPTS]
IDS = ["hla2", "ahla-fixed-norm", "hla3-norm-rms-rope-gate", "hla2-spread", "cala", "cala-favor", "cala-relu"]


def _build(name, opts, dtype=torch.float64, args=ARGS):
    m = build_attention(name, args, opts).to(dtype)
    with torch.no_grad():
        m.init_weights(0.02)
    return m


def _ctx(B, T, cu=None):
    pos = torch.arange(T).repeat(B, 1)
    if cu is None:
        return AttentionContext(positions=pos)
    return AttentionContext.from_positions(cu, block_causal=True, rope_theta=1e6)


def test_registered_with_options():
    assert get_mechanism("hla").options is HLAOptions
    assert get_mechanism("cala").options is CALAOptions


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_causal_and_decode_equals_forward(name, opts):
    m = _build(name, opts)
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    y = m(x, _ctx(2, 11))
    assert y.shape == x.shape and torch.isfinite(y).all()
    x2 = x.clone()
    x2[:, 7:] += 1.0
    torch.testing.assert_close(m(x2, _ctx(2, 11))[:, :7], y[:, :7], rtol=1e-12, atol=1e-12)  # causal
    cache = m.init_cache(2, 11, x.device, x.dtype)
    pos = torch.arange(11).repeat(2, 1)
    outs = [m(x[:, :5], AttentionContext(positions=pos[:, :5], cache=cache))]  # prefill
    for t in range(5, 11):
        outs.append(m(x[:, t:t + 1], AttentionContext(positions=pos[:, t:t + 1], cache=cache)))
    torch.testing.assert_close(torch.cat(outs, 1), y, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_packed_documents_equal_separate_rows(name, opts):
    """Packing docs of 4 and 7 tokens into one row (positions restart) == running them as separate sequences."""
    m = _build(name, opts)
    a, b = torch.randn(1, 4, 32, dtype=torch.float64), torch.randn(1, 7, 32, dtype=torch.float64)
    pos = torch.cat([torch.arange(4), torch.arange(7)])[None]
    y = m(torch.cat([a, b], 1), _ctx(1, 11, pos))
    torch.testing.assert_close(y[:, :4], m(a, _ctx(1, 4)), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y[:, 4:], m(b, _ctx(1, 7)), rtol=1e-10, atol=1e-10)


def test_cala_module_matches_naive_loop():
    m = _build("cala", CALAOptions(window_size=3))
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    q, k, v = m.project(x)
    ref = m.wo(naive_cala(q, k, v, 3, m.q_ln, m.k_ln, m.phi).reshape(2, 9, -1))
    torch.testing.assert_close(m(x, _ctx(2, 9)), ref, rtol=1e-10, atol=1e-10)


def test_hla_gamma_gradient_and_init():
    m = _build("hla", HLAOptions(decay="learnable", gamma_init=0.9, gamma_init_min=0.5), dtype=torch.float32)
    gam = torch.exp(m.log_gamma_per_head())
    torch.testing.assert_close(gam[0], torch.tensor(0.9))
    torch.testing.assert_close(gam[-1], torch.tensor(0.5))
    m(torch.randn(2, 9, 32), _ctx(2, 9)).square().sum().backward()
    assert m.decay_log.grad is not None and m.decay_log.grad.abs().sum() > 0


@pytest.mark.parametrize("name,opts", CASES[:1] + CASES[4:5], ids=["hla", "cala"])
def test_meta_construction_then_init(name, opts):
    with torch.device("meta"):
        m = build_attention(name, ARGS, opts)
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_weights(0.02)
    y = m(torch.randn(1, 5, 32), _ctx(1, 5))
    assert torch.isfinite(y).all()
    assert m.flops_per_token(4096) > 0


@pytest.mark.parametrize("name,opts,key", [
    ("hla", HLAOptions(order=4), "attention.hla.order"),
    ("hla", HLAOptions(order=3, variant="asymmetric"), "attention.hla.variant"),
    ("hla", HLAOptions(decay="exp"), "attention.hla.decay"),
    ("hla", HLAOptions(qk_norm="x"), "attention.hla.qk_norm"),
    ("cala", CALAOptions(feature_map="cosformer"), "attention.cala.feature_map"),
    ("cala", CALAOptions(window_size=0), "attention.cala.window_size"),
])
def test_invalid_options_name_the_key(name, opts, key):
    with pytest.raises(ValueError, match=key):
        build_attention(name, ARGS, opts)


@pytest.mark.parametrize("name", ["hla", "cala"])
def test_invalid_impl(name):
    args = AttentionArgs(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, impl="flash")
    with pytest.raises(ValueError, match="attention.impl"):
        build_attention(name, args)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hla", "cala"])
def test_module_gpu_bf16_matches_reference(name):
    """On CUDA: the auto (Triton) path in bf16 ≈ the PyTorch chunk path in fp32, packed documents."""
    args = AttentionArgs(dim=256, n_heads=4, n_kv_heads=2, head_dim=64)
    ref_args = AttentionArgs(dim=256, n_heads=4, n_kv_heads=2, head_dim=64, impl="chunk" if name == "hla" else "reference")
    m = _build(name, None, torch.float32, args).cuda()
    r = build_attention(name, ref_args).cuda()
    r.load_state_dict(m.state_dict())
    x = torch.randn(2, 300, 256, device="cuda")
    pos = torch.cat([torch.arange(100), torch.arange(200)]).repeat(2, 1).cuda()
    ctx = AttentionContext.from_positions(pos, block_causal=True, rope_theta=1e6)
    with torch.autocast("cuda", torch.bfloat16):
        y = m(x, ctx)
    yr = r(x, ctx)
    assert (y.float() - yr).abs().max() <= 5e-2 * yr.abs().max()
