"""Delta-rule family modules (deltanet, gdn, kda): decode == full forward, packed documents do not leak,
recurrent == chunk at module level, every parameter gets a gradient, meta-device init, declared parameter roles;
KDA's bounded gate (``gate_lower_bound``, fla's safe_gate): its formula and range, decode and gradients, validation.

Float64 and tiny sizes (dim 24, 2 heads of K=8, V=12 via expand_v=1.5) so each mechanism runs in a few seconds.
"""

import pytest
import torch

from attnlab import attention  # noqa: F401  (registers the mechanisms)
from attnlab.attention.base import AttentionArgs, AttentionContext
from attnlab.attention.registry import REGISTRY
from attnlab.optim.config import Optimizer
from attnlab.optim.groups import route_parameters

MECHS = ["deltanet", "gdn", "kda"]
# (mechanism, extra options): every mechanism, plus KDA with fla's bounded gate
VARIANTS = [pytest.param(n, {}, id=n) for n in MECHS] + [
    pytest.param("kda", {"gate_lower_bound": -5.0}, id="kda-bounded")]
DIM = 24


def build(name, impl="chunk", device="cpu", **opts):
    args = AttentionArgs(dim=DIM, n_heads=2, n_kv_heads=2, head_dim=8, impl=impl)
    mech = REGISTRY[name]
    defaults = dict(chunk_size=16, expand_v=1.5)
    m = mech.cls(args, mech.options(**{**defaults, **opts})).to(device=device, dtype=torch.float64)
    with torch.no_grad():
        m.init_weights(0.02)
    return m


def ctx_for(B, T, offset=0, cache=None):
    return AttentionContext(positions=(torch.arange(T) + offset).expand(B, T), cache=cache)


@pytest.mark.parametrize("name, extra", VARIANTS)
def test_decode_matches_full_forward(name, extra):
    m = build(name, use_output_gate=True, **extra)
    B, T = 2, 21
    x = torch.randn(B, T, DIM, dtype=torch.float64)
    full = m(x, ctx_for(B, T))
    # token by token
    cache = m.init_cache(B, T, "cpu", torch.float64)
    steps = torch.cat([m(x[:, t:t + 1], ctx_for(B, 1, t, cache)) for t in range(T)], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-10)
    assert cache.seen == T
    # prefill 13 tokens, then 2 chunks of decode
    cache = m.init_cache(B, T, "cpu", torch.float64)
    parts = [m(x[:, :13], ctx_for(B, 13, 0, cache)), m(x[:, 13:14], ctx_for(B, 1, 13, cache)),
             m(x[:, 14:], ctx_for(B, T - 14, 14, cache))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", MECHS)
def test_packed_documents_do_not_leak(name):
    m = build(name)
    B, T = 2, 37
    lens = [11, 26]  # row 0 and row 1 both hold two documents: positions restart at 11
    pos = torch.cat([torch.arange(lens[0]), torch.arange(lens[1])]).expand(B, T).contiguous()
    ctx = AttentionContext.from_positions(pos, block_causal=True, rope_theta=1e6)
    x = torch.randn(B, T, DIM, dtype=torch.float64)
    y = m(x, ctx)
    x2 = x.clone()
    x2[:, :lens[0]] += torch.randn(B, lens[0], DIM, dtype=torch.float64)  # perturb document 1
    y2 = m(x2, AttentionContext.from_positions(pos, block_causal=True, rope_theta=1e6))
    torch.testing.assert_close(y2[:, lens[0]:], y[:, lens[0]:], rtol=1e-12, atol=1e-12)
    assert (y2[:, :lens[0]] - y[:, :lens[0]]).abs().max() > 1e-3  # document 1 did change
    # document 2 equals running it alone
    alone = m(x[:, lens[0]:], ctx_for(B, lens[1]))
    torch.testing.assert_close(y[:, lens[0]:], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name, extra", VARIANTS)
def test_recurrent_equals_chunk_and_gradients_reach_every_parameter(name, extra):
    m = build(name, use_output_gate=True, allow_neg_eigval=True, **extra)
    B, T = 2, 19
    x = torch.randn(B, T, DIM, dtype=torch.float64, requires_grad=True)
    y_chunk = m(x, ctx_for(B, T))
    y_chunk.square().sum().backward()
    g_chunk = {n: p.grad.clone() for n, p in m.named_parameters()}
    dx_chunk = x.grad.clone()
    for n, g in g_chunk.items():
        assert torch.isfinite(g).all() and g.abs().max() > 0, f"no gradient reaches {n}"
    m.zero_grad()
    x.grad = None
    m.args.impl = "reference"
    y_rec = m(x, ctx_for(B, T))
    y_rec.square().sum().backward()
    torch.testing.assert_close(y_chunk, y_rec, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dx_chunk, x.grad, rtol=1e-9, atol=1e-9)
    for n, p in m.named_parameters():
        torch.testing.assert_close(g_chunk[n], p.grad, rtol=1e-9, atol=1e-9, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("name", MECHS)
def test_meta_init_and_declared_roles(name):
    args = AttentionArgs(dim=DIM, n_heads=2, n_kv_heads=2, head_dim=8)
    mech = REGISTRY[name]
    with torch.device("meta"):
        m = mech.cls(args, mech.options())
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_weights(0.01)
    for n, p in m.named_parameters():
        assert torch.isfinite(p).all(), n
    vector = {r.name for r in route_parameters(m, Optimizer()) if r.reason == "declared" and r.role == "vector"}
    expected = {"b_proj.weight", "conv_q.weight", "conv_k.weight", "conv_v.weight"}
    if name in ("gdn", "kda"):
        expected |= {"A_log", "dt_bias"}
        assert (m.A_log.exp() > 0).all() and torch.isfinite(m.dt_bias).all()
    assert expected <= vector, expected - vector
    for n in vector:  # every parameter declared "vector" carries one of the agreed names
        assert n.split(".")[0] in ("b_proj", "a_proj", "g_proj", "A_log", "dt_bias") or n.startswith("conv"), n
    assert "q_proj.weight" not in vector and "o_proj.weight" not in vector
    assert m.flops_per_token(4096) > 0


@pytest.mark.parametrize("name", MECHS)
def test_options_and_errors(name):
    m = build(name, num_heads=3, head_k_dim=4, expand_v=2.0, use_short_conv=False, use_output_gate=False)
    assert (m.n_heads, m.head_k_dim, m.head_v_dim) == (3, 4, 8)
    y = m(torch.randn(1, 5, DIM, dtype=torch.float64), ctx_for(1, 5))
    assert y.shape == (1, 5, DIM)
    with pytest.raises(ValueError, match="attention.impl"):
        build(name, impl="flash")


@pytest.mark.parametrize("lb", [-5.0, -0.5])
def test_kda_bounded_gate_formula_and_range(lb):
    """log_decay with gate_lower_bound = lb is lb * sigmoid(exp(A_log) * (a_proj(x) + dt_bias)), written out here
    independently, and lies in [lb, 0), float32 for float32 input; A_log starts at 0 (fla's safe_gate init)."""
    m = build("kda", gate_lower_bound=lb)
    assert torch.equal(m.A_log, torch.zeros_like(m.A_log))
    assert (build("kda").A_log > 0).all()  # softplus gate: A ~ U(1, 16) as before
    H, K = m.n_heads, m.head_k_dim
    with torch.no_grad():
        m.A_log.normal_(0.0, 1.0)
        m.dt_bias.normal_(0.0, 2.0)
    x = 3.0 * torch.randn(2, 9, DIM, dtype=torch.float64)
    g = m.log_decay(x)
    a = m.a_proj(x).view(2, 9, H, K) + m.dt_bias.view(H, K)
    ref = lb / (1.0 + torch.exp(-m.A_log.exp().view(H, 1) * a))
    torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)
    assert g.shape == (2, 9, H, K) and (g >= lb).all() and (g < 0).all()
    assert g.min() < 0.9 * lb and g.max() > 0.1 * lb  # the inputs do span the range
    g32 = m.float().log_decay(x.float())
    assert g32.dtype == torch.float32 and (g32 >= lb).all() and (g32 < 0).all()
    torch.testing.assert_close(g32.double(), g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lb", [0.0, -6.0, 0.5])
def test_kda_gate_lower_bound_out_of_range(lb):
    with pytest.raises(ValueError, match=r"attention\.kda\.gate_lower_bound=.* must be in \[-5, 0\)"):
        build("kda", gate_lower_bound=lb)


@pytest.mark.parametrize("name, extra, expected", [("kda", {"gate_lower_bound": -2.0}, -2.0), ("kda", {}, None),
                                                   ("gdn", {}, None), ("deltanet", {}, None)])
def test_gate_lower_bound_reaches_delta_rule(name, extra, expected, monkeypatch):
    """The module hands its bound to delta_rule (prefill and decode): KDA's when set, None otherwise."""
    import attnlab.attention.deltanet as dn

    seen = []
    real = dn.delta_rule
    monkeypatch.setattr(dn, "delta_rule", lambda *a, **kw: seen.append(kw["gate_lower_bound"]) or real(*a, **kw))
    m = build(name, **extra)
    x = torch.randn(1, 5, DIM, dtype=torch.float64)
    m(x, ctx_for(1, 5))
    cache = m.init_cache(1, 6, "cpu", torch.float64)
    m(x[:, :1], ctx_for(1, 1, 0, cache))
    assert seen == [expected, expected]


@pytest.mark.gpu
@pytest.mark.parametrize("name", MECHS)
def test_module_auto_matches_chunk_on_gpu(name):
    """impl="auto" (fla where it runs) agrees with the PyTorch chunk path at module level, bf16, with packing."""
    torch.manual_seed(0)
    args = AttentionArgs(dim=256, n_heads=4, n_kv_heads=4, head_dim=64, impl="auto")
    mech = REGISTRY[name]
    m = mech.cls(args, mech.options()).cuda()
    with torch.no_grad():
        m.init_weights(0.02)
    m = m.bfloat16()
    B, T = 2, 300
    pos = torch.cat([torch.arange(100), torch.arange(200)]).expand(B, T).contiguous().cuda()
    ctx = AttentionContext.from_positions(pos, block_causal=True, rope_theta=1e6)
    x = torch.randn(B, T, 256, device="cuda", dtype=torch.bfloat16)
    y_auto = m(x, ctx)
    m.args.impl = "chunk"
    y_chunk = m(x, ctx)
    err = (y_auto.float() - y_chunk.float()).abs().max() / y_chunk.float().abs().max()
    assert err < 3e-2, f"auto vs chunk relative error {err:.3g}"
