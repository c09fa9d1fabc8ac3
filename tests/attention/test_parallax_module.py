"""Parallax/softmax modules and the Parallax reference against an independent float64 per-token loop."""


import pytest
import torch

from attnlab import attention
from attnlab.attention.base import AttentionArgs, AttentionContext
from attnlab.attention.ops import parallax as parallax_ops
from attnlab.attention.ops.parallax.naive import naive_parallax


def loop_parallax(q, k, v, r, scale, doc=None):
    """Eq. (8) token by token in float64: o_i = Σ_j p_ij (1 + t̄_i − t_ij) v_j over visible j ≤ i."""
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    o = torch.zeros(B, T, HQ, D, dtype=torch.float64)
    for b in range(B):
        for h in range(HQ):
            for i in range(T):
                js = [j for j in range(i + 1) if doc is None or doc[b, j] == doc[b, i]]
                kk, vv = k[b, js, h // G].double(), v[b, js, h // G].double()
                p = torch.softmax(kk @ q[b, i, h].double() * scale, 0)
                t = kk @ r[b, i, h].double() if r is not None else torch.zeros(len(js), dtype=torch.float64)
                tbar = (p * t).sum()
                o[b, i, h] = ((p * (1 + tbar - t))[:, None] * vv).sum(0)
    return o


@pytest.mark.parametrize("HQ,HKV", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("T", [1, 7, 13])
def test_naive_matches_loop(HQ, HKV, T):
    B, D = 2, 8
    q, r = torch.randn(B, T, HQ, D, dtype=torch.float64), torch.randn(B, T, HQ, D, dtype=torch.float64)
    k, v = torch.randn(B, T, HKV, D, dtype=torch.float64), torch.randn(B, T, HKV, D, dtype=torch.float64)
    out = naive_parallax(q, k, v, r, scale=0.3)
    torch.testing.assert_close(out, loop_parallax(q, k, v, r, 0.3), rtol=1e-10, atol=1e-10)


def test_naive_documents_and_window():
    B, T, D = 2, 11, 8
    q, k, v, r = (torch.randn(B, T, 2, D, dtype=torch.float64) for _ in range(4))
    cu = torch.tensor([0, 4, 11, 13, 22], dtype=torch.int32)  # docs over the flattened 22 tokens
    doc = attention.ops.common.document_ids(cu, B, T)
    torch.testing.assert_close(naive_parallax(q, k, v, r, cu_seqlens=cu), loop_parallax(q, k, v, r, D**-0.5, doc))
    # a window of 3 equals a loop restricted to the last 3 keys: check one row by hand
    out = naive_parallax(q, k, v, None, window_size=3)
    p = torch.softmax(k[0, 4:7, 0] @ q[0, 6, 0] * D**-0.5, 0)
    torch.testing.assert_close(out[0, 6, 0], p @ v[0, 4:7, 0])


def _module(name, head_dim=8, **opts):
    args = AttentionArgs(dim=32, n_heads=4, n_kv_heads=2, head_dim=head_dim, impl="reference")
    mech = attention.get_mechanism(name)
    m = mech.cls(args, mech.options(**opts)).double()
    with torch.no_grad():
        m.init_weights(0.02)
        for p in m.parameters():  # non-trivial norms so the test sees them
            p.add_(0.1 * torch.randn_like(p))
    return m


def _rope_complex(x, pos, theta=1e6):
    """Independent RoPE (half-rotation pairs (i, i + D/2) as complex numbers)."""
    D = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[..., None, None].double() * freqs  # [B, T, 1, D/2]
    z = torch.complex(x[..., : D // 2], x[..., D // 2:]) * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([z.real, z.imag], -1)


@pytest.mark.parametrize("rope_on_rho", [True, False])
def test_module_matches_loop_with_gqa_and_rope_on_rho(rope_on_rho):
    m = _module("parallax", rope_on_rho=rope_on_rho)
    B, T = 2, 9
    x = torch.randn(B, T, 32, dtype=torch.float64)
    pos = torch.arange(T).expand(B, T)
    ctx = AttentionContext.from_positions(pos, False, 1e6)
    q = _rope_complex(m.q_norm(m.wq(x).view(B, T, 4, 8)), pos)
    k = _rope_complex(m.k_norm(m.wk(x).view(B, T, 2, 8)), pos)
    v = m.wv(x).view(B, T, 2, 8)
    r = m.r_norm(m.wr(x).view(B, T, 4, 8))
    r = _rope_complex(r, pos) if rope_on_rho else r
    expect = m.wo(loop_parallax(q, k, v, r, 8**-0.5).reshape(B, T, -1))
    # the RoPE table is float32 (as in torchtitan), so agreement is ~1e-7, not float64-exact
    torch.testing.assert_close(m(x, ctx), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gate", [False, True])
def test_parallax_with_zero_wr_equals_softmax_exactly(gate):
    p = _module("parallax", rho_gate=gate)
    s = _module("softmax")
    s.load_state_dict({k: v for k, v in p.state_dict().items() if k in s.state_dict()})
    with torch.no_grad():
        p.wr.weight.zero_()
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    ctx = AttentionContext.from_positions(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]] * 2), True, 1e6)
    assert torch.equal(p(x, ctx), s(x, ctx))


def test_wr_zero_init_option_and_bad_value():
    m = _module("parallax", wr_init="zero")
    with torch.no_grad():
        m.init_weights(0.02)
    assert m.wr.weight.abs().max() == 0
    with pytest.raises(ValueError, match="wr_init"):
        _module("parallax", wr_init="ones")


@pytest.mark.parametrize("gain", [1.0, 0.3, 0.0])
def test_rho_norm_init_sets_gain_and_probe_norm(gain):
    """r_norm.weight = gain everywhere after init_weights, and ‖ρ_i‖ = √head_dim · gain for every token and head
    (RMSNorm, then RoPE, a rotation)."""
    args = AttentionArgs(dim=32, n_heads=4, n_kv_heads=2, head_dim=16, impl="reference")
    mech = attention.get_mechanism("parallax")
    m = mech.cls(args, mech.options(rho_norm_init=gain)).double()
    with torch.no_grad():
        m.init_weights(0.02)
    assert torch.equal(m.r_norm.weight, torch.full((16,), gain, dtype=torch.float64))
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    ctx = AttentionContext.from_positions(torch.arange(10).expand(2, 10), False, 1e6)
    norms = m.probe(x, ctx).norm(dim=-1)  # [B, T, HQ]
    torch.testing.assert_close(norms, torch.full_like(norms, 4.0 * gain), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_rho_norm_init_bad_value(bad):
    with pytest.raises(ValueError, match=r"attention.parallax.rho_norm_init=.*>= 0"):
        _module("parallax", rho_norm_init=bad)


def test_unknown_mechanism_lists_valid_names():
    with pytest.raises(ValueError, match=r"model.attention='nope' is not registered; choose from \[.*'parallax'.*'softmax'"):
        attention.build_attention("nope", AttentionArgs(dim=8, n_heads=1, n_kv_heads=1, head_dim=8))


def test_flops_parallax_twice_softmax():
    assert _module("parallax").flops_per_token(128) == 2 * _module("softmax").flops_per_token(128)
    assert _module("softmax").flops_per_token(128) == 4 * 4 * 8 * 129 // 2  # (T + 1) / 2 causal keys per query


def test_auto_falls_back_where_the_kernels_do_not_apply():
    """impl="auto" takes the Triton kernels only on CUDA with a head dim/dtype they support (tiny test models
    use head dim 8, below tl.dot's K >= 16); everything else runs the reference."""
    from attnlab.attention.ops.parallax import triton as kernels

    assert kernels.supports(torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16))
    assert not kernels.supports(torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16))
    assert not kernels.supports(torch.zeros(1, 1, 1, 64, dtype=torch.float64))
    assert parallax_ops.resolve_impl("auto", torch.zeros(1, 1, 1, 64)) == "reference"  # CPU
    with pytest.raises(ValueError, match="attention.impl"):
        parallax_ops.resolve_impl("flash", torch.zeros(1, 1, 1, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("name,window,head_dim", [("softmax", 0, 16), ("softmax", 5, 16), ("parallax", 0, 16),
                                                   ("softmax", 0, 24), ("softmax", 5, 24)])
def test_cuda_auto_path_matches_reference_with_packed_documents(name, window, head_dim):
    """The CUDA fast paths in bf16 (the Triton kernel; torch's flash varlen for a head dim the kernel lacks, 24) are
    causal and document-masked like the float32 oracle (the flash kernels take half precision only; bf16 budget
    as in the kernel tests)."""
    m = _module(name, head_dim=head_dim, window_size=window).float().cuda()
    B, T = 2, 64
    x = torch.randn(B, T, 32, device="cuda")
    pos = torch.cat([torch.arange(20), torch.arange(44)]).expand(B, T).cuda()
    ctx = AttentionContext.from_positions(pos, True, 1e6)
    q, k, v = m.project_qkv(x, ctx)
    r = m.probe(x, ctx)
    expect = m.mix(q, k, v, r, ctx)  # impl "reference", float32
    m.args.impl = "auto"
    half = [t.bfloat16() if t is not None else None for t in (q, k, v, r)]
    assert parallax_ops.resolve_impl("auto", half[0]) == ("triton" if head_dim == 16 else "reference")
    got = m.mix(*half, ctx).float()
    torch.testing.assert_close(got, expect, rtol=4e-2, atol=4e-2)
    if name == "softmax":  # float32 on CUDA (attnlab/tools/analyze.py) must not reach the half-only flash varlen kernel
        torch.testing.assert_close(m.mix(q, k, v, r, ctx), expect, rtol=2e-3, atol=2e-3)
