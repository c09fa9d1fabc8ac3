"""The short convolution's Triton kernels (attnlab/attention/ops/short_conv/triton/conv.py) against the float64
reference.

CPU (TRITON_INTERPRET=1, float32, tiny shapes): forward, dx and dweight at pinned tiles smaller than the shapes (T
not a multiple of BT, C not a multiple of BC, backward programs walking several tiles), B > 1 per-row and varlen
documents of length 1, 2 and > K, K = 1..4 and 8 (the maximum), with and without SiLU; in bf16 (dpre stored in
x's dtype) against eager bf16 autograd's error; every kernel output is NaN-poisoned before the launch
(tests/conftest.py). The custom op pair: opcheck (schema, fake, autograd registration, AOT dispatch) and
torch.compile(fullgraph=True). The ``gpu`` test repeats the comparison at the training shape in bf16.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.attention.linear_common import ShortConvolution
from attnlab.attention.ops.short_conv import naive_short_conv, short_conv
from attnlab.attention.ops.short_conv.triton.conv import conv_bwd, conv_fwd, short_conv_bwd, short_conv_fwd

D64 = torch.float64
CU = torch.tensor([0, 1, 3, 10, 11, 37], dtype=torch.int32)  # documents of length 1, 2, 7, 1, 26 in one row
TILE = (8, 16, 1)  # BT, BC, num_warps: T = 37 and C = 20 are not multiples


def _reference(x, w, cu, act, dy):
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    y, _ = naive_short_conv(xd, wd, cu, None, act)
    return (y, *torch.autograd.grad(y, (xd, wd), dy.double()))


def _close(got, ref, tol=1e-5):
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("act", [True, False], ids=["silu", "none"])
@pytest.mark.parametrize("K", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["varlen", "rows"])
def test_kernels_vs_float64_reference(layout, K, act):
    """y, dx, dweight at a pinned 8 x 16 tile; the backward walks 16 rows per program (two tiles, a ragged end)."""
    B, T, C = (1, 37, 20) if layout == "varlen" else (3, 13, 20)
    cu = CU if layout == "varlen" else None
    x, dy = torch.randn(B, T, C), torch.randn(B, T, C)
    w = torch.randn(C, K)
    y_ref, dx_ref, dw_ref = _reference(x, w, cu, act, dy)
    _close(conv_fwd(x, w, cu, act, config=TILE), y_ref)
    dx, dw = conv_bwd(dy, x, w, cu, act, config=TILE, rows_per_program=16)
    _close(dx, dx_ref)
    _close(dw, dw_ref)


def test_bf16_backward_rounding():
    """bf16 x, dy and weight at the pinned tile, dpre stored in bf16; relative norm errors against the float64
    reference. dweight's partials take dpre in fp32, before its rounding, so dweight is the reference rounded to bf16
    (up to fp32 sums); summed from the rounded dpre it would be about twice as far. dx reads the rounded dpre: at
    most 2.5 times the error of eager autograd of the bf16 reference, since the interpreter truncates fp32 to bf16
    where a GPU rounds to nearest (about twice the error per rounding)."""
    x, dy = torch.randn(1, 37, 20, dtype=torch.bfloat16), torch.randn(1, 37, 20, dtype=torch.bfloat16)
    w = torch.randn(20, 4, dtype=torch.bfloat16)
    _, dx_ref, dw_ref = _reference(x, w, CU, True, dy)
    xb = x.clone().requires_grad_()
    dx_eager = torch.autograd.grad(naive_short_conv(xb, w, CU, None, True)[0], xb, dy)[0]
    dx, dw = conv_bwd(dy, x, w, CU, True, config=TILE, rows_per_program=16)
    assert dx.dtype == dw.dtype == torch.bfloat16 and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    rel = lambda a, ref: ((a.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    assert rel(dw, dw_ref) <= 1.25 * rel(dw_ref.to(torch.bfloat16), dw_ref)
    assert rel(dx, dx_ref) <= 2.5 * rel(dx_eager, dx_ref)


def test_varlen_across_batch_rows():
    """cu_seqlens over the flattened B*T tokens with B = 2 (the row boundary is a document boundary), K = 4."""
    B, T, C, K = 2, 11, 5, 4
    cu = torch.tensor([0, 2, 11, 12, 22], dtype=torch.int32)
    x, dy, w = torch.randn(B, T, C), torch.randn(B, T, C), torch.randn(C, K)
    y_ref, dx_ref, dw_ref = _reference(x, w, cu, True, dy)
    _close(conv_fwd(x, w, cu, True, config=(4, 4, 1)), y_ref)
    dx, dw = conv_bwd(dy, x, w, cu, True, config=(4, 4, 1), rows_per_program=4)
    _close(dx, dx_ref)
    _close(dw, dw_ref)


def test_autotuned_entry_and_op_gradients():
    """The op (autotuned launch, first candidate under ATTNLAB_AUTOTUNE=first) through autograd."""
    x = torch.randn(1, 37, 20, requires_grad=True)
    w = torch.randn(20, 4, requires_grad=True)
    dy = torch.randn(1, 37, 20)
    y = short_conv_fwd(x, w, CU, True)
    got = torch.autograd.grad(y, (x, w), dy)
    ref = _reference(x.detach(), w.detach(), CU, True, dy)
    for a, b in zip((y, *got), ref):
        _close(a, b)


def test_opcheck():
    x = torch.randn(2, 9, 6, requires_grad=True)
    w = torch.randn(6, 3, requires_grad=True)
    cu = torch.tensor([0, 4, 9, 18], dtype=torch.int32)
    torch.library.opcheck(short_conv_fwd, (x, w, cu, True))
    torch.library.opcheck(short_conv_fwd, (x, w, None, False))
    torch.library.opcheck(short_conv_bwd, (torch.randn(2, 9, 6), x.detach(), w.detach(), cu, True))


def test_compiles_with_fullgraph():
    """The op inside a compiled function (fullgraph, aot_eager): one graph, the eager values and gradients."""
    x = torch.randn(1, 37, 20, requires_grad=True)
    w = torch.randn(20, 4, requires_grad=True)

    def loss(x, w):
        return (short_conv_fwd(x * 2, w, CU, True) + 1).square().mean()

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(x, w), (x, w))
    ref = torch.autograd.grad(loss(x, w), (x, w))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


def test_dispatch_and_new_state():
    """"auto" runs the reference on the CPU; "triton" gives the reference's new_state (last K-1 inputs, zero-padded
    ahead of a row shorter than K-1); a decode state is the reference's alone."""
    x, w = torch.randn(2, 2, 6), torch.randn(6, 4)
    y_ref, st_ref = naive_short_conv(x, w)
    y, st = short_conv(x, w, impl="triton")
    _close(y, y_ref.double())
    torch.testing.assert_close(st, st_ref)
    # both paths share naive.last_inputs: check it against the state written out (a zero row, then x's two rows)
    torch.testing.assert_close(st, torch.cat([torch.zeros(2, 1, 6), x], dim=1).transpose(1, 2))
    y_auto, st_auto = short_conv(x, w)
    torch.testing.assert_close(y_auto, y_ref)
    with pytest.raises(ValueError, match="decode state"):
        short_conv(x, w, state=st, impl="triton")


def test_module_decode_matches_prefill():
    """ShortConvolution: a token-by-token decode through the state equals the whole-sequence forward."""
    m = ShortConvolution(6, 4).double()
    m.reset_parameters()
    x = torch.randn(2, 7, 6, dtype=D64)
    y, st = m(x)
    state, outs = m.init_state(2, "cpu", D64), []
    for t in range(7):
        o, state = m(x[:, t:t + 1], state=state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), y)
    torch.testing.assert_close(state, st)


@pytest.mark.gpu
def test_gpu_bf16_training_shape():
    """B=2, T=4096, C=2048, K=4, bf16, ~8 packed documents over the flattened tokens, autotuned launches."""
    B, T, C, K = 2, 4096, 2048, 4
    cu = torch.tensor([0, 1, 700, 702, 2900, 4096, 5000, 7777, 8192], dtype=torch.int32, device="cuda")
    x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
    w = (torch.rand(C, K, device="cuda") - 0.5).to(torch.bfloat16)
    y_ref, dx_ref, dw_ref = _reference(x, w, cu, True, dy)
    y = short_conv_fwd(x, w, cu, True)
    dx, dw = short_conv_bwd(dy, x, w, cu, True)
    for got, ref, tol in [(y, y_ref, 1e-2), (dx, dx_ref, 1e-2), (dw, dw_ref, 1e-2)]:
        assert torch.isfinite(got).all()
        assert ((got.double() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernels():
    """On a GPU the ops are triton_ops: torch.compile (inductor, fullgraph) traces into them and its generated code
    launches our kernels; values and gradients equal eager's, and no custom-op call is left in the graph."""
    from torch._inductor.utils import run_and_get_code

    B, T, C, K = 2, 300, 96, 4
    cu = torch.tensor([0, 5, 300, 301, 600], dtype=torch.int32, device="cuda")
    x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.rand(C, K, device="cuda") - 0.5).requires_grad_(True)
    dy = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)

    def f(x, w):
        return short_conv_fwd(x * 2, w.to(x.dtype), cu, True) + 1

    ref = (f(x, w), *torch.autograd.grad(f(x, w), (x, w), dy))
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    (y, code) = run_and_get_code(compiled, x, w)
    got = (y, *torch.autograd.grad(compiled(x, w), (x, w), dy))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2)
    src = "\n".join(code)
    assert "_fwd_kernel" in src and "attnlab.short_conv_fwd" not in src


_AOT = """
from attnlab.attention.ops.short_conv.triton import conv as tc
from attnlab.attention.ops.sm90 import compile_sm90
ptr = dict(cu="*i32", dwp="*fp32", w="*bf16")
ints = dict(T=4096, C=2048, n_iter=4, N=8, TS=256, NS=16)
for fn, spec, const in [(tc._fwd_kernel, tc.FWD_SPEC, dict(K=4, ACT=True, HAS_CU=True)),
                        (tc._bwd_dpre_kernel, tc.DPRE_SPEC, dict(K=4, KP=4, ACT=True, HAS_CU=True)),
                        (tc._bwd_dx_kernel, tc.FWD_SPEC, dict(K=4, HAS_CU=True))]:
    for bt, bc, nw in spec:
        c = dict(const, BT=bt, BC=bc)
        sig = {a: "constexpr" if a in c else "i32" if a in ints else ptr.get(a, "*bf16") for a in fn.arg_names}
        compile_sm90(fn, sig, c, nw, 2, ints={a: v for a, v in ints.items() if a in fn.arg_names})
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Ahead-of-time compile of the three kernels at every autotune tile for an H100 target (sm_90, bf16,
    documents, K=4): what the interpreter does not check, without a GPU. A subprocess: the kernels are interpreter
    objects here."""
    import os
    import subprocess
    import sys

    from tests.utils import REPO

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-2000:]
