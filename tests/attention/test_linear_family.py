"""Modules gla, gated_linear, linear, fox, path: impl parity, decode == full forward, packed documents,
meta-device init, declared parameter roles."""

import pytest
import torch

from attnlab import attention  # noqa: F401  (registers every mechanism)
from attnlab.attention.base import AttentionArgs, AttentionContext
from attnlab.attention.registry import build_attention, get_mechanism
from attnlab.optim.config import Optimizer
from attnlab.optim.groups import route_parameters

D64 = torch.float64

CASES = [
    ("gla", {}),
    ("gla", dict(use_short_conv=True, gate_clamp_min=-2.0)),
    ("gated_linear", {}),
    ("gated_linear", dict(gate="logsigmoid")),
    ("gated_linear", dict(gate="retnet", output_gate=False)),
    ("linear", {}),
    ("linear", dict(normalize=True, use_short_conv=True, output_gate=True, feature_map="relu")),
    ("fox", {}),
    ("fox", dict(pro=True)),
    ("path", {}),
    ("path", dict(use_forget_gate=True, qk_norm=True)),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}" for n, kw in CASES]
BLOCK = {"gla": "chunk_size", "gated_linear": "chunk_size", "linear": "chunk_size", "fox": "block_size", "path": "block_size"}


def build(name, kw, impl="chunk", dtype=D64):
    args = AttentionArgs(dim=24, n_heads=4, n_kv_heads=2, head_dim=8, impl=impl)
    opts = get_mechanism(name).options(**{BLOCK[name]: 8, **kw})
    m = build_attention(name, args, opts).to(dtype)
    with torch.no_grad():
        m.init_weights(0.02)
    return m


def ctx_for(positions, block_causal=False):
    return AttentionContext.from_positions(positions, block_causal, 1e6)


@pytest.mark.parametrize("name,kw", CASES, ids=IDS)
def test_chunk_matches_reference_and_decode(name, kw):
    m = build(name, kw)
    B, T = 2, 21
    x = torch.randn(B, T, 24, dtype=D64, requires_grad=True)
    pos = torch.arange(T).expand(B, T)
    y = m(x, ctx_for(pos))
    m.args.impl = "reference"
    y_ref = m(x, ctx_for(pos))
    torch.testing.assert_close(y, y_ref, rtol=1e-8, atol=1e-10)
    gx, gx_ref = (torch.autograd.grad(t.square().sum(), x)[0] for t in (y, y_ref))
    torch.testing.assert_close(gx, gx_ref, rtol=1e-8, atol=1e-10)
    m.args.impl = "chunk"
    with torch.no_grad():  # step by step, then a prefill of 6 followed by the rest
        cache = m.init_cache(B, T, x.device, x.dtype)
        steps = torch.cat([m(x[:, t:t + 1], AttentionContext(positions=pos[:, t:t + 1], cache=cache)) for t in range(T)], 1)
        cache = m.init_cache(B, T, x.device, x.dtype)
        pre = [m(x[:, a:b], AttentionContext(positions=pos[:, a:b], cache=cache)) for a, b in ((0, 6), (6, 7), (7, T))]
    torch.testing.assert_close(steps, y.detach(), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(torch.cat(pre, 1), y.detach(), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("name,kw", CASES, ids=IDS)
def test_packed_documents_do_not_leak(name, kw):
    m = build(name, kw)
    B, T = 2, 19
    lens = [[4, 11, 4], [19]]
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lens])
    x = torch.randn(B, T, 24, dtype=D64, requires_grad=True)
    y = m(x, ctx_for(pos, block_causal=True))
    # each document equals the same tokens run alone
    for b, row in enumerate(lens):
        s = 0
        for n in row:
            alone = m(x[b:b + 1, s:s + n], ctx_for(torch.arange(n)[None]))
            torch.testing.assert_close(y[b:b + 1, s:s + n], alone, rtol=1e-8, atol=1e-10)
            s += n
    # no gradient from document 2 of row 0 into any other token (FoX/PaTH subtract a shared cumulative
    # gate offset, so their cross-document gradient is rounding noise, not exactly 0)
    gx = torch.autograd.grad(y[0, 4:15].sum(), x)[0]
    inside = gx[0, 4:15].abs().max()
    assert inside > 0
    for outside in (gx[0, :4], gx[0, 15:], gx[1]):
        assert outside.abs().max() <= 1e-12 * inside


@pytest.mark.parametrize("name,kw", CASES[::2], ids=IDS[::2])
def test_meta_init_grads_and_declared_roles(name, kw):
    args = AttentionArgs(dim=24, n_heads=4, n_kv_heads=2, head_dim=8, impl="auto")
    with torch.device("meta"):
        m = build_attention(name, args, get_mechanism(name).options(**kw))
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_weights(0.01)
    x = torch.randn(2, 70, 24)
    y = m(x, ctx_for(torch.arange(70).expand(2, 70)))
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().sum().backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    vector = {r.name for r in route_parameters(m, Optimizer()) if r.reason == "declared" and r.role == "vector"}
    for n, _ in m.named_parameters():  # gates, conv kernels, A_log, dt_bias: declared "vector"; hidden matrices: not
        declared = any(s in n for s in ("conv", "A_log", "dt_bias", "gk_proj", "a_proj", "f_proj", "bt_proj", "w_proj"))
        assert (n in vector) == declared, n
    assert m.flops_per_token(4096) > 0


@pytest.mark.parametrize("name", ["gla", "gated_linear", "linear", "fox", "path"])
def test_invalid_options_name_the_key(name):
    with pytest.raises(ValueError, match="attention.impl"):
        build(name, {}, impl="bogus")
    bad = {"gla": dict(chunk_size=24), "gated_linear": dict(gate="mamba3"), "linear": dict(feature_map="cos"),
           "fox": None, "path": None}[name]
    if bad is not None:
        with pytest.raises(ValueError, match=f"attention.{name}."):
            build(name, bad)


@pytest.mark.parametrize("name,kw", [c for c in CASES if c[0] in ("gated_linear", "linear")],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] in ("gated_linear", "linear")])
def test_triton_impl_matches_reference_with_packed_documents(name, kw):
    """gated_linear and linear take the Triton gated-linear-attention kernel (per-head gates): fp32 through the
    interpreter vs the float64 reference, forward and input gradient, two rows with documents across them."""
    m = build(name, {**kw, "chunk_size": 16}, impl="triton", dtype=torch.float32)
    lens = [[5, 14, 4], [23]]
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lens])
    x = torch.randn(2, 23, 24, requires_grad=True)
    y = m(x, ctx_for(pos, block_causal=True))
    m64 = m.to(D64)
    m64.args.impl = "reference"
    x64 = x.detach().double().requires_grad_()
    y_ref = m64(x64, ctx_for(pos, block_causal=True))
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-5)
    gx, gx_ref = (torch.autograd.grad(t.square().sum(), inp)[0] for t, inp in ((y, x), (y_ref, x64)))
    torch.testing.assert_close(gx.double(), gx_ref, rtol=1e-4, atol=1e-5)


def test_gla_refuses_the_triton_impl():
    with pytest.raises(ValueError, match="attention.impl='triton' is not valid for gla"):
        build("gla", {}, impl="triton")


def test_auto_without_fla_takes_the_triton_kernel_on_cuda(monkeypatch):
    """Where fla cannot train (Hopper with Triton < 3.7.1), "auto" runs gated and plain linear attention on the
    project's Triton kernel, and only what it does not cover (per-channel gates, states, other chunk sizes) on the
    PyTorch chunk path."""
    from attnlab.attention.ops import linear_attn

    monkeypatch.setattr(linear_attn, "fla_usable", lambda device, needs_grad: (False, "Triton 3.6 on Hopper"))
    cuda = torch.device("cuda")
    assert linear_attn.resolve_impl("auto", cuda, True) == "triton"
    assert linear_attn.resolve_impl("auto", cuda, True, per_channel=True) == "chunk"
    assert linear_attn.resolve_impl("auto", cuda, True, stateful=True) == "chunk"
    assert linear_attn.resolve_impl("auto", cuda, True, chunk_size=48) == "chunk"
    assert linear_attn.resolve_impl("fla", cuda, True) == "chunk"
    assert linear_attn.resolve_impl("auto", torch.device("cpu"), True) == "chunk"
