"""Triton softmax/Parallax kernels against the float64 reference: output and all four gradients, decode.

CPU runs go through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1; blocks are 16×16 there,
so T = 17 / 61 / 100 cover partial tiles, several key blocks, and windows below and above the block size).
Every kernel output is poisoned with NaN before the launch (``attnlab/attention/ops/outputs.py``, set in ``tests/conftest.py``), so an element the kernel
forgets to write fails the comparison.

Error budgets (relative Frobenius norm against float64 on the same input values):
- float32: 2e-5 (fp32 accumulation, exact fp32 products; observed ~1e-7 in the interpreter);
- float16: 5e-3 forward, 1e-2 gradients (P, P⊙t and g1/g2 are rounded to fp16 before the GEMMs: 2^-11 each);
- bfloat16: 2e-2 forward, 4e-2 gradients (the same roundings at 2^-8; the probe branch adds the rounding of
  P2 = P1⊙t whose magnitude grows with |ρ·k|).
"""

from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace

import pytest
import torch

from attnlab.attention.ops.parallax.triton import ops as kops
from attnlab.attention.ops.parallax.triton import parallax_decode_triton, parallax_triton
from attnlab.attention.ops.parallax.naive import naive_parallax, naive_parallax_decode

BUDGET = {  # dtype: (forward, gradients)
    torch.float32: (2e-5, 2e-5),
    torch.float16: (5e-3, 1e-2),
    torch.bfloat16: (2e-2, 4e-2),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖, with ‖b‖ floored at 0.1·sqrt(numel) (O(1) entries) for exactly-zero references (dq, dk at T = 1)."""
    den = max(b.double().norm().item(), 0.1 * b.numel() ** 0.5)
    return (a.double() - b.double()).norm().item() / den


def make_inputs(B, T, HQ, HKV, D, probe, device="cpu", rho_std=0.3, dtype=torch.float32):
    """Inputs rounded to ``dtype`` (so the float64 reference sees the kernel's exact values)."""
    g = lambda *s: torch.randn(*s, device=device).to(dtype)  # noqa: E731
    q, k, v = g(B, T, HQ, D), g(B, T, HKV, D), g(B, T, HKV, D)
    r = (torch.randn(B, T, HQ, D, device=device) * rho_std).to(dtype) if probe else None
    return q, k, v, r


def check_against_reference(q, k, v, r, cu=None, window=None, max_seqlen=0, ref_dtype=torch.float64, cu_k=None,
                            max_seqlen_k=0):
    """Output and every gradient of the kernels against ``naive_parallax`` in ``ref_dtype``; returns the kernels'
    gradients (dq, dk, dv[, dr])."""
    dtype = q.dtype
    ins = [t for t in (q, k, v, r) if t is not None]
    ref_ins = [t.detach().to(ref_dtype).requires_grad_(True) for t in ins]
    ker_ins = [t.detach().clone().requires_grad_(True) for t in ins]
    ref = naive_parallax(*ref_ins[:3], ref_ins[3] if r is not None else None, cu_seqlens=cu, window_size=window,
                         cu_seqlens_k=cu_k)
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ref_ins, do)
    out = parallax_triton(*ker_ins[:3], ker_ins[3] if r is not None else None, cu_seqlens=cu,
                          max_seqlen=max_seqlen, window_size=window, cu_seqlens_k=cu_k, max_seqlen_k=max_seqlen_k)
    grads = torch.autograd.grad(out, ker_ins, do.to(dtype))
    fwd_tol, grad_tol = BUDGET[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "kernel left unwritten (NaN) outputs"
    assert rel_err(out, ref) < fwd_tol, f"forward rel err {rel_err(out, ref):.3g}"
    for name, g, gr in zip("qkvr", grads, ref_grads):
        assert torch.isfinite(g).all(), f"d{name} has unwritten (NaN) elements"
        assert rel_err(g, gr) < grad_tol, f"d{name} rel err {rel_err(g, gr):.3g}"
    return grads


# id: (B, T, HQ, HKV, D, probe, window)
CASES = {
    "B1-T1-H2-KV1-D16-probe": (1, 1, 2, 1, 16, True, None),
    "B2-T17-H2-KV1-D16-probe": (2, 17, 2, 1, 16, True, None),
    "B2-T17-H2-KV1-D16-softmax": (2, 17, 2, 1, 16, False, None),
    "B1-T100-H4-KV1-D16-probe": (1, 100, 4, 1, 16, True, None),
    "B1-T33-H2-KV1-D32-probe": (1, 33, 2, 1, 32, True, None),
    "B1-T61-H4-KV2-D16-probe-W5": (1, 61, 4, 2, 16, True, 5),
    "B1-T61-H4-KV2-D16-softmax-W5": (1, 61, 4, 2, 16, False, 5),
    "B1-T100-H2-KV1-D16-probe-W40": (1, 100, 2, 1, 16, True, 40),
    "B1-T40-H2-KV1-D128-probe-W20": (1, 40, 2, 1, 128, True, 20),  # D >= 128: the column pass's EARLY products
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fwd_bwd_fp32(case):
    B, T, HQ, HKV, D, probe, window = CASES[case]
    check_against_reference(*make_inputs(B, T, HQ, HKV, D, probe), window=window)


@pytest.mark.parametrize("probe", [True, False], ids=["probe", "softmax"])
def test_packed_documents(probe):
    """Three documents of unequal length over two rows (the row boundary is a document boundary too)."""
    B, T = 2, 40
    cu = torch.tensor([0, 9, 40, 80], dtype=torch.int32)  # lengths 9, 31, 40
    check_against_reference(*make_inputs(B, T, 4, 2, 16, probe), cu=cu, max_seqlen=40)


def test_packed_documents_window_unknown_max_seqlen():
    cu = torch.tensor([0, 3, 37, 61], dtype=torch.int32)  # lengths 3, 34, 24; window inside the block size
    check_against_reference(*make_inputs(1, 61, 2, 1, 16, True), cu=cu, window=7, max_seqlen=0)


@pytest.mark.parametrize("probe", [True, False], ids=["probe", "softmax"])
@pytest.mark.parametrize("layout", ["dense", "docs-window"])
def test_score_jumps(probe, layout):
    """Keys whose scores jump by ~5, ~16 and ~22 log2 units (the online max moves by that much inside one key
    block), then one by ~200, which overflows fp32 (2^128) unless the accumulators are rescaled to the new max:
    forward and gradients within the fp32 budget, then the forward finite and within budget."""
    T, D = 100, 16
    q, k, v, r = make_inputs(1, T, 2, 1, D, probe)
    u = torch.ones(D) / D**0.5
    q = q * 0.3 + 4.0 * u
    k = k * 0.5
    per_unit = 4.0 * D**-0.5 * 1.4426950408889634  # log2 units added to q·k·scale per unit of u in a key
    for j, jump in ((20, 5.0), (45, 16.0), (80, 22.0)):
        k[:, j] += jump / per_unit * u
    cu, window = (torch.tensor([0, 37, 100], dtype=torch.int32), 30) if layout == "docs-window" else (None, None)
    max_seqlen = T if cu is not None else 0
    check_against_reference(q, k, v, r, cu=cu, window=window, max_seqlen=max_seqlen)
    k[:, 60] += 196.0 / per_unit * u
    out = parallax_triton(q, k, v, r, cu_seqlens=cu, window_size=window, max_seqlen=max_seqlen)
    ref = naive_parallax(*(t.double() if t is not None else None for t in (q, k, v, r)), cu_seqlens=cu,
                         window_size=window)
    assert torch.isfinite(out).all() and rel_err(out, ref) < BUDGET[torch.float32][0]


def test_half_precision_fp16():
    """bf16 is tested on the GPU only: the Triton interpreter's tl.dot mis-reads bf16 tiles (wrong by 1e10)."""
    check_against_reference(*make_inputs(1, 33, 4, 2, 16, True, dtype=torch.float16))


def test_zero_probe_is_softmax():
    q, k, v, _ = make_inputs(1, 37, 2, 1, 16, False)
    o_soft = parallax_triton(q, k, v, None)
    o_zero = parallax_triton(q, k, v, torch.zeros_like(q))
    assert torch.equal(o_soft, o_zero)


def test_probe_changes_output():
    """Guards against a probe branch that is silently compiled out."""
    q, k, v, r = make_inputs(1, 20, 2, 1, 16, True)
    assert rel_err(parallax_triton(q, k, v, r), parallax_triton(q, k, v, None)) > 1e-2


def _flatten(*ts):
    """[B, T, H, D] tensors as one row [1, B*T, H, D] (None stays None): the layout of packed documents."""
    return [t.reshape(1, -1, *t.shape[2:]) if t is not None else None for t in ts]


def run_fwd_at(q, k, v, r, config, cu=None, window=None, max_seqlen=0, cu_k=None, max_seqlen_k=0):
    """The forward kernel alone at one pinned config (no autotuner); o poisoned with NaN first."""
    B, T, HQ, D = q.shape
    if cu is not None:
        q, k, v, r = _flatten(q, k, v, r)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((HQ, B * T), float("nan"), device=q.device)
    vbar, tbar = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
    kops.launch_fwd(q, k, v, r, o, lse, vbar, tbar, cu, D**-0.5, max_seqlen, window or 0, config=config,
                    cu_seqlens_k=cu_k, max_seqlen_k=max_seqlen_k)
    return o.view(B, T, HQ, D)


@pytest.mark.parametrize("flags", [(True, False), (True, True)], ids=["tma", "tma-ws"])
@pytest.mark.parametrize("layout", ["dense", "docs", "window"])
def test_fwd_tma_variant(flags, layout):
    """The TMA / WS forward candidates (descriptor loads in the mask-free key blocks) against float64, with GQA,
    T not a multiple of the tiles, packed documents and a window."""
    q, k, v, r = make_inputs(2, 45, 4, 2, 16, True)
    cu = torch.tensor([0, 7, 45, 90], dtype=torch.int32) if layout == "docs" else None
    window = 9 if layout == "window" else None
    cfg = dict(BM=16, BN=16, num_warps=1, num_stages=1, TMA=flags[0], WS=flags[1])
    out = run_fwd_at(q, k, v, r, cfg, cu=cu, window=window, max_seqlen=45 if cu is not None else 0)
    ref = naive_parallax(*(t.double() for t in (q, k, v, r)), cu_seqlens=cu, window_size=window)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < BUDGET[torch.float32][0]


def run_bwd_at(q, k, v, r, do, dq_config, dkv_config, cu=None, window=None, max_seqlen=0, cu_k=None,
               max_seqlen_k=0):
    """Forward at a 16 × 16 tile, then the row and column passes alone at pinned configs; every output poisoned with
    NaN first. Returns (dq, dk, dv, dr) in the inputs' shapes."""
    shapes = [t.shape for t in (q, k, v, r) if t is not None]
    B, T, HQ, D = q.shape
    do = do.contiguous()  # the kernels take contiguous [B, T, H, D] tensors (the op's backward makes dO so)
    if cu is not None:
        q, k, v, r, do = _flatten(q, k, v, r, do)
    nan = lambda t: torch.full_like(t, float("nan"))  # noqa: E731
    o, vbar = nan(q), nan(q)
    lse = torch.full((HQ, B * T), float("nan"), device=q.device)
    tbar, tau, beta = nan(lse), nan(lse), nan(lse)
    scale, window = D**-0.5, window or 0
    keys = dict(cu_seqlens_k=cu_k, max_seqlen_k=max_seqlen_k)
    kops.launch_fwd(q, k, v, r, o, lse, vbar, tbar, cu, scale, max_seqlen, window,
                    config=dict(BM=16, BN=16, num_warps=1, num_stages=1), **keys)
    dq, dr, dk, dv = nan(q), nan(q), nan(k), nan(v)
    args = (do, q, k, v, r, o, lse, vbar, tbar, tau, beta, cu, scale, max_seqlen, window)
    kops.launch_dq(*args, dq, dr, config=dq_config, **keys)
    kops.launch_dkv(*args, dk, dv, config=dkv_config, **keys)
    return tuple(g.reshape(s) for g, s in zip((dq, dk, dv, dr), shapes))


@pytest.mark.parametrize("probe", [True, False], ids=["probe", "softmax"])
@pytest.mark.parametrize("layout", ["dense", "docs", "window"])
def test_bwd_tma_variant(layout, probe):
    """The backward's TMA candidates (descriptor loads of K/V in the row pass's and of Q/ρ/dO in the column pass's
    mask-free blocks) against float64: every gradient, GQA, T not a multiple of the tiles, packed documents and a
    window. T = 130 and the window of 70 leave both passes mask-free blocks at tiles of 32 × 16."""
    q, k, v, r = make_inputs(1, 130, 4, 2, 16, probe)
    cu = torch.tensor([0, 9, 100, 130], dtype=torch.int32) if layout == "docs" else None
    window = 70 if layout == "window" else None
    ins = [t.double().requires_grad_(True) for t in (q, k, v, r) if t is not None]
    ref = naive_parallax(*ins[:3], ins[3] if probe else None, cu_seqlens=cu, window_size=window)
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ins, do)
    tiles = dict(num_warps=1, num_stages=1, TMA=True)
    grads = run_bwd_at(q, k, v, r, do.float(), dict(tiles, BM=32, BN=16), dict(tiles, BN=32, BM=16), cu=cu,
                       window=window, max_seqlen=91 if cu is not None else 0)
    for name, g, gr in zip("qkvr", grads, ref_grads):
        assert torch.isfinite(g).all(), f"d{name} has unwritten (NaN) elements"
        assert rel_err(g, gr) < BUDGET[torch.float32][1], f"d{name} rel err {rel_err(g, gr):.3g}"


def _compile_signature(job):
    """What a compiled kernel depends on in a launch: the kernel, its meta-parameters, the grid, and per argument
    the dtype, shape and contiguity of a tensor or the value of a scalar."""
    kernel, grid, args, meta = job
    sig = [(a.dtype, tuple(a.shape), a.is_contiguous()) if isinstance(a, torch.Tensor) else a for a in args]
    return kernel, meta, grid({"BM": 16, "BN": 16}), sig


def _forget_picks(monkeypatch) -> None:
    """Every autotune key new to the launches (no pick kept), undone after the test."""
    for fast in kops._FAST.values():
        monkeypatch.setattr(fast, "configs", {})


@pytest.mark.parametrize("probe", [True, False], ids=["probe", "softmax"])
@pytest.mark.parametrize("layout", ["dense", "docs-window", "offsets-window"])
def test_forward_compiles_the_backward_with_stand_ins(probe, layout, monkeypatch):
    """A forward whose inputs require grad hands the backward's two launches to ``compile_candidates`` with its own
    buffers standing in for do, tau, beta and the gradients: each must compile the same kernel as the backward's
    real launch (same meta, scalars, dtypes, shapes), or the cold first backward compiles everything again. Under
    ``torch.no_grad()`` the forward compiles its own candidates only. "offsets-window": query offsets, 65 keys for
    40 queries (the column pass's grid follows the longest key segment)."""
    seen = []
    monkeypatch.setattr(kops, "compile_candidates", lambda job, follow=None: seen.append([job, *(follow or list)()]))
    _forget_picks(monkeypatch)  # every key new: no launch skips compile_candidates
    q, k, v, r = make_inputs(1, 40, 4, 2, 16, probe, dtype=torch.float16)
    cu = torch.tensor([0, 9, 30, 40], dtype=torch.int32) if layout != "dense" else None
    window = 7 if cu is not None else None
    cu_k = torch.tensor([0, 9, 55, 65], dtype=torch.int32) if layout == "offsets-window" else None
    if cu_k is not None:
        k, v = (torch.cat([t, t[:, :25]], 1) for t in (k, v))
    with torch.no_grad():
        parallax_triton(q, k, v, r, cu_seqlens=cu, window_size=window, cu_seqlens_k=cu_k)
    assert len(seen) == 1 and len(seen[0]) == 1
    _forget_picks(monkeypatch)
    ins = [t.requires_grad_(True) for t in (q, k, v, r) if t is not None]
    out = parallax_triton(q, k, v, r, cu_seqlens=cu, window_size=window, cu_seqlens_k=cu_k)
    out.backward(torch.randn_like(out))
    (fwd, *stand_ins), dq, dkv = seen[1:]
    assert fwd[0] is kops._parallax_fwd_kernel and len(ins) == 3 + probe
    assert [_compile_signature(j) for j in stand_ins] == [_compile_signature(dq[0]), _compile_signature(dkv[0])]


class _Passthrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("probe", [True, False], ids=["probe", "softmax"])
def test_eager_path_equals_the_custom_op(probe, monkeypatch):
    """Eager calls skip the custom op's dispatch layers (``ops._Eager``, the same launches); under a dispatch mode
    (selective activation checkpointing's, fake tensors) the op runs, so the mode sees it. Both give the same
    output and gradients bit for bit and tell the forward whether a backward follows."""
    ops_called, flags = [], []
    op = kops.parallax_fwd
    monkeypatch.setattr(kops, "parallax_fwd", lambda *a: (ops_called.append(1), op(*a))[1])
    launch = kops.launch_fwd
    monkeypatch.setattr(kops, "launch_fwd", lambda *a, backward=False, **kw: (flags.append(backward),
                                                                             launch(*a, backward=backward, **kw)))
    q, k, v, r = make_inputs(1, 37, 4, 2, 16, probe)
    cu = torch.tensor([0, 11, 37], dtype=torch.int32)
    results = []
    for mode in (None, _Passthrough):
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v, r) if t is not None]
        with torch.no_grad(), mode() if mode else contextlib.nullcontext():  # no backward follows
            parallax_triton(*ins[:3], ins[3] if probe else None, cu_seqlens=cu, window_size=9)
        with mode() if mode else contextlib.nullcontext():
            out = parallax_triton(*ins[:3], ins[3] if probe else None, cu_seqlens=cu, window_size=9)
            out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append([out.detach(), *(t.grad for t in ins)])
        assert len(ops_called) == (0 if mode is None else 2)
    assert flags[:2] == [False, True] and flags[3]  # (the op under a mode reads requires_grad, not grad mode)
    for a, b in zip(*results):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_later_launches_run_the_autotuners_pick(monkeypatch):
    """The first launch at an autotune key goes through the autotuner, which picks; later launches at that key run
    the pick on the bare kernel (no ``Autotuner.run``, no ``compile_candidates``) with the same result; a new key
    (here another head count) goes through the autotuner again."""
    from triton.runtime.autotuner import Autotuner

    runs, compiles = [], []
    run = Autotuner.run
    monkeypatch.setattr(Autotuner, "run",
                        lambda self, *a, **kw: (runs.append(self.fn.__name__), run(self, *a, **kw))[1])
    monkeypatch.setattr(kops, "compile_candidates", lambda job, follow=None: compiles.append(job[0].fn.__name__))
    _forget_picks(monkeypatch)
    names = ["_parallax_fwd_kernel", "_parallax_bwd_dq_kernel", "_parallax_bwd_dkv_kernel"]

    def fwd_bwd(HQ):
        q, k, v, r = make_inputs(1, 23, HQ, 1, 16, True)
        ins = [t.requires_grad_(True) for t in (q, k, v, r)]
        out = parallax_triton(*ins)
        out.backward(torch.ones_like(out))
        return [out.detach(), *(t.grad for t in ins)]

    first = fwd_bwd(2)
    assert runs == names and compiles == names
    kernels = [kops._parallax_fwd_kernel, kops._parallax_bwd_dq_kernel, kops._parallax_bwd_dkv_kernel]
    assert [list(kops._FAST[kernel].configs.values()) for kernel in kernels] == [[k.best_config] for k in kernels]
    torch.manual_seed(0)  # the same inputs again
    again = fwd_bwd(2)
    assert runs == names and compiles == names  # the picks, on the bare kernels
    assert all(torch.isfinite(a).all() and torch.equal(a, b) for a, b in zip(first, again))
    fwd_bwd(4)
    assert runs == names * 2 and compiles == names * 2


def test_prune_fwd_keeps_tma_ws_at_d128_only(monkeypatch):
    """The autotuner's list holds TMA / warp-specialised tiles; they survive the prune at D >= 128 only (slower at
    D = 64 on an H100), and never with a probe's BN > 64 at D = 128."""
    from attnlab.attention.ops.parallax.triton.common import FWD_SPECS, configs, prune_fwd

    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "all")  # the whole list, not the test suite's first candidate

    def kept(D, probe):
        return {(c.kwargs["BM"], c.kwargs["BN"], c.kwargs.get("TMA", False), c.kwargs.get("WS", False))
                for c in prune_fwd(configs(FWD_SPECS, ("BM", "BN")), {}, D=D, HAS_PROBE=probe)}

    assert not any(t[2] or t[3] for p in (True, False) for t in kept(64, p))
    assert (128, 64, True, True) in kept(128, True) and (128, 128, True, True) not in kept(128, True)
    assert (128, 128, True, True) in kept(128, False)


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
def test_prune_fwd_by_compute_capability(capability, monkeypatch):
    """No TMA / warp-specialised tile below sm_90 (no TMA hardware); on sm_90 a plain tile gives way to its
    TMA + warp-specialised twin (measured faster on H100s, picked only about half the time when both were timed);
    elsewhere both stay. Tiles without a twin stay everywhere."""
    from attnlab.attention.ops.parallax.triton.common import FWD_SPECS, configs, prune_fwd

    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "all")

    def kept(D, probe):
        return {(c.kwargs["BM"], c.kwargs["BN"], c.num_warps, c.kwargs.get("TMA", False))
                for c in prune_fwd(configs(FWD_SPECS, ("BM", "BN")), {}, capability=capability, D=D,
                                   HAS_PROBE=probe)}

    for D, probe in ((128, True), (128, False)):
        k = kept(D, probe)
        assert (64, 64, 4, False) in k and (128, 64, 4, False) in k  # no twin: always kept
        assert ((128, 64, 8, True) in k) == (capability >= (9, 0))
        assert ((128, 64, 8, False) in k) == (capability[0] != 9)
    assert ((128, 128, 8, False) in kept(128, False)) == (capability[0] != 9)
    assert (128, 64, 8, False) in kept(64, True)  # below D = 128 there is no twin to give way to


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
def test_prune_bwd_tma_twins(capability, monkeypatch):
    """The backward lists' TMA twins stay at D >= 128 on sm_90+ only, and their plain tiles, where listed, stay
    everywhere (the autotuner times both: the twin won at some picks and lost at others)."""
    from attnlab.attention.ops.parallax.triton.common import DKV_SPECS, DQ_SPECS, configs, prune_bwd

    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "all")
    for specs, names in ((DQ_SPECS, ("BM", "BN")), (DKV_SPECS, ("BN", "BM"))):
        twins = [s for s in specs if len(s) == 6 and s[4]]
        assert twins
        for D, probe in ((64, True), (128, True), (128, False)):
            kept = {(c.kwargs[names[0]], c.kwargs[names[1]], c.num_warps, c.num_stages, c.kwargs.get("TMA", False))
                    for c in prune_bwd(configs(specs, names), {}, capability=capability, D=D, HAS_PROBE=probe)}
            for s in twins:
                assert (s[:4] + (True,) in kept) == (D >= 128 and capability >= (9, 0)), (D, s)
                assert s[:4] not in specs or s[:4] + (False,) in kept  # a plain twin never gives way


# -------------------------------------------------------------------- query offsets (context parallelism)
def offset_inputs(lq, lk, HQ, HKV, D, probe, dtype=torch.float32, device="cpu"):
    """Segments of lq[s] queries over lk[s] keys in one row: q, r [1, Σlq, HQ, D], k, v [1, Σlk, HKV, D] (rounded to
    ``dtype``), and their offsets cu_seqlens, cu_seqlens_k [S+1] int32."""
    cu, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=device) for n in (lq, lk))
    g = lambda *shape, std=1.0: (std * torch.randn(*shape, device=device)).to(dtype)  # noqa: E731
    q, k, v = g(1, sum(lq), HQ, D), g(1, sum(lk), HKV, D), g(1, sum(lk), HKV, D)
    r = g(1, sum(lq), HQ, D, std=0.3) if probe else None
    return q, k, v, r, cu, cu_k


def brute_force_offsets(q, k, v, r, cu, cu_k, window):
    """Eq. (8) query by query over its visible keys, listed one by one from the bottom-right rule (query j of a
    segment at key position Lk - Lq + j), in float64: independent of the mask helper and of ``naive_parallax``."""
    HQ, HKV, D = q.shape[2], k.shape[2], q.shape[3]
    o = torch.zeros(q.shape[1:], dtype=torch.float64)
    for s in range(len(cu) - 1):
        bq, bk = int(cu[s]), int(cu_k[s])
        lq, lk = int(cu[s + 1]) - bq, int(cu_k[s + 1]) - bk
        for j in range(lq):
            pos = lk - lq + j
            keys = [bk + n for n in range(lk) if n <= pos and not (window and pos - n >= window)]
            for h in range(HQ):
                kk, vv = k[0, keys, h // (HQ // HKV)].double(), v[0, keys, h // (HQ // HKV)].double()
                p = torch.softmax(kk @ q[0, bq + j, h].double() * D**-0.5, 0)
                w = p
                if r is not None:
                    t = kk @ r[0, bq + j, h].double()
                    w = p * (1 + (p * t).sum() - t)
                o[bq + j, h] = w @ vv
    return o[None]


def test_offset_visibility_mask_small():
    """Three segments: 2 queries over 3 keys, none over 2 keys (an empty segment between two others), 1 over 1."""
    from attnlab.attention.ops.common import offset_visibility_mask

    cu, cu_k = torch.tensor([0, 2, 2, 3]), torch.tensor([0, 3, 5, 6])
    full = torch.tensor([[1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0],
                         [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    window1 = torch.tensor([[0, 1, 0, 0, 0, 0],
                            [0, 0, 1, 0, 0, 0],
                            [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(offset_visibility_mask(cu, cu_k)[0, 0], full)
    assert torch.equal(offset_visibility_mask(cu, cu_k, window_size=1)[0, 0], window1)


@pytest.mark.parametrize("probe", [True, False], ids=["probe", "softmax"])
@pytest.mark.parametrize("window", [None, 3], ids=["full", "W3"])
def test_offset_reference_against_brute_force(probe, window):
    """``naive_parallax(cu_seqlens_k=...)``, output and the reference every kernel test trusts, against the query by
    query loop in float64: GQA, a segment without queries, one with Lq == Lk, one with Lq < Lk."""
    q, k, v, r, cu, cu_k = offset_inputs([0, 7, 13], [5, 20, 13], 4, 2, 16, probe, dtype=torch.float64)
    ref = naive_parallax(q, k, v, r, cu_seqlens=cu, cu_seqlens_k=cu_k, window_size=window)
    assert ref.shape == q.shape
    assert (ref - brute_force_offsets(q, k, v, r, cu, cu_k, window)).abs().max() < 1e-12


# id: (query lengths, key lengths, max_seqlen, max_seqlen_k); 16-token tiles in the interpreter
OFFSET_CASES = {
    # context-parallel zigzag shard: a segment with no query here, one of a later chunk, one whole
    "zigzag": ([0, 7, 13], [5, 20, 13], 0, 0),
    # long key prefixes (offsets 40, 33): mask-free key blocks in the row pass and query blocks in the column pass
    # at offsets that are not tile-aligned; with a window, key tiles that no query sees
    "long-prefix": ([10, 37], [50, 70], 37, 70),
    # Lq == Lk segments (offset 0) between Lq < Lk ones, lengths not multiples of 16, and an empty segment
    "mixed-equal": ([17, 9, 0, 30], [17, 40, 0, 30], 0, 40),
}


def _unseen_keys(cu, cu_k, window):
    """[Nk] bool: keys that no query sees (they must get dk = dv = 0)."""
    from attnlab.attention.ops.common import offset_visibility_mask

    return ~offset_visibility_mask(cu, cu_k, window)[0, 0].any(0)


@pytest.mark.parametrize("window", [None, 5, 16], ids=["full", "W5", "W16"])
@pytest.mark.parametrize("probe", [True, False], ids=["probe", "softmax"])
@pytest.mark.parametrize("case", list(OFFSET_CASES))
def test_query_offsets(case, probe, window):
    """Queries aligned to the end of longer key segments (``cu_seqlens_k``) against the float64 reference: output
    and every gradient, GQA 4:2, D = 16, a window shorter than the query segments (W5) or, in the zigzag, longer
    than every query segment and shorter than the longest key segment (W16: still a window); keys that no query
    sees (a segment without queries, the left of a window) get exactly zero dk and dv, though the buffers start
    NaN."""
    lq, lk, max_seqlen, max_seqlen_k = OFFSET_CASES[case]
    q, k, v, r, cu, cu_k = offset_inputs(lq, lk, 4, 2, 16, probe)
    grads = check_against_reference(q, k, v, r, cu=cu, window=window, max_seqlen=max_seqlen, cu_k=cu_k,
                                    max_seqlen_k=max_seqlen_k)
    unseen = _unseen_keys(cu, cu_k, window)
    assert unseen.any() == (case == "zigzag" or window is not None)  # the zigzag's first segment has no query
    for g in grads[1:3]:
        assert g[0, unseen].eq(0).all()


@pytest.mark.parametrize("probe", [True, False], ids=["probe", "softmax"])
def test_query_offsets_equal_lengths_are_documents(probe):
    """With cu_seqlens_k == cu_seqlens every offset is 0: the same output and gradients, bit for bit, as packed
    documents without query offsets (the same phases and the same sums)."""
    q, k, v, r, cu, _ = offset_inputs([17, 3, 33], [17, 3, 33], 4, 2, 16, probe)
    results = []
    for cu_k in (None, cu):
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v, r) if t is not None]
        out = parallax_triton(*ins[:3], ins[3] if probe else None, cu_seqlens=cu, window_size=7, cu_seqlens_k=cu_k)
        results.append([out, *torch.autograd.grad(out, ins, torch.linspace(-1, 1, out.numel()).view_as(out))])
    for a, b in zip(*results):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("window", [None, 20], ids=["full", "W20"])
@pytest.mark.parametrize("tma", [False, True], ids=["plain", "tma"])
def test_query_offsets_pinned_tiles(tma, window):
    """Query offsets at tiles of 32 × 16 (row passes: key positions m0 + offset not aligned to BN; column pass:
    BN = 32 > BM) and with the TMA candidates, whose K/V descriptors span the key tokens (not the queries'):
    forward and the two backward passes, pinned, against float64."""
    lq, lk = [10, 37], [50, 70]
    q, k, v, r, cu, cu_k = offset_inputs(lq, lk, 4, 2, 16, True)
    ins = [t.double().requires_grad_(True) for t in (q, k, v, r)]
    ref = naive_parallax(*ins, cu_seqlens=cu, window_size=window, cu_seqlens_k=cu_k)
    do = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ins, do)
    tiles = dict(num_warps=1, num_stages=1, TMA=tma)
    keys = dict(cu=cu, window=window, max_seqlen=37, cu_k=cu_k, max_seqlen_k=70)
    out = run_fwd_at(q, k, v, r, dict(tiles, BM=32, BN=16), **keys)
    assert torch.isfinite(out).all() and rel_err(out, ref) < BUDGET[torch.float32][0]
    grads = run_bwd_at(q, k, v, r, do.float(), dict(tiles, BM=32, BN=16), dict(tiles, BN=32, BM=16), **keys)
    for name, g, gr in zip("qkvr", grads, ref_grads):
        assert torch.isfinite(g).all(), f"d{name} has unwritten (NaN) elements"
        assert rel_err(g, gr) < BUDGET[torch.float32][1], f"d{name} rel err {rel_err(g, gr):.3g}"


def test_query_offsets_through_the_custom_op():
    """Under a dispatch mode the op ``attnlab::parallax_fwd`` runs (its schema takes cu_seqlens_k, max_seqlen_k; its
    autograd returns no gradient for them): the same output and gradients as the eager path, dk/dv in k's shape."""
    q, k, v, r, cu, cu_k = offset_inputs([0, 7, 13], [5, 20, 13], 4, 2, 16, True)
    results = []
    for mode in (contextlib.nullcontext, _Passthrough):
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v, r)]
        with mode():
            out = parallax_triton(*ins, cu_seqlens=cu, window_size=6, cu_seqlens_k=cu_k)
            out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append([out.detach(), *(t.grad for t in ins)])
    assert results[0][2].shape == k.shape
    for a, b in zip(*results):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_query_offsets_torch_compile_fullgraph():
    """The fake kernels give dk, dv k's token count, not q's: torch.compile traces fwd and bwd as one graph."""
    q, k, v, r, cu, cu_k = offset_inputs([4, 13], [20, 13], 2, 1, 16, True)
    q, k, v, r = (t.requires_grad_(True) for t in (q, k, v, r))

    def f(q, k, v, r):
        return (parallax_triton(q, k, v, r, cu_seqlens=cu, max_seqlen=13, cu_seqlens_k=cu_k,
                                max_seqlen_k=20) * 2).sum()

    torch._dynamo.reset()
    grads = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, r), (q, k, v, r))
    ref_grads = torch.autograd.grad(f(q, k, v, r), (q, k, v, r))
    for g, gr in zip(grads, ref_grads):
        assert g.shape == gr.shape and rel_err(g, gr) < 1e-6


def test_query_offsets_argument_checks():
    q, k, v, r, cu, cu_k = offset_inputs([3, 5], [4, 9], 2, 1, 16, True)
    with pytest.raises(ValueError, match="cu_seqlens_k"):  # keys of another length need their own segments
        parallax_triton(q, k, v, r, cu_seqlens=cu)
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        parallax_triton(q, k, v, r, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        parallax_triton(q, k, v, r, cu_seqlens=cu[:2], cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        naive_parallax(q, k, v, r, cu_seqlens_k=cu_k)


def test_public_dispatch_query_offsets():
    """``parallax_attention(cu_seqlens_k=...)``: impl='triton' (interpreter here) equals impl='reference'."""
    from attnlab.attention.ops.parallax import parallax_attention

    q, k, v, r, cu, cu_k = offset_inputs([0, 7, 13], [5, 20, 13], 2, 1, 16, True)
    a = parallax_attention(q, k, v, r, cu_seqlens=cu, cu_seqlens_k=cu_k, window_size=4, impl="triton")
    b = parallax_attention(q, k, v, r, cu_seqlens=cu, cu_seqlens_k=cu_k, window_size=4, impl="reference")
    assert rel_err(a, b) < 2e-5


# -------------------------------------------------------------------- decode
def decode_inputs(B, LMAX, HQ, HKV, D, TQ, probe):
    k, v = torch.randn(B, LMAX, HKV, D), torch.randn(B, LMAX, HKV, D)
    q = torch.randn(B, TQ, HQ, D)
    r = 0.3 * torch.randn(B, TQ, HQ, D) if probe else None
    return q, k, v, r


def decode_reference(q, k, v, seqlens, r, window=None):
    return naive_parallax_decode(q.double(), k.double(), v.double(), seqlens, r.double() if r is not None else None,
                                 window_size=window)


@pytest.mark.parametrize("probe", [True, False], ids=["probe", "softmax"])
@pytest.mark.parametrize("window", [None, 20], ids=["full", "W20"])
@pytest.mark.parametrize("splits", [1, 4], ids=["S1", "S4"])
def test_decode_vs_reference(probe, window, splits):
    """Per-row lengths (one shorter than a block, one filling the cache), TQ=2 new tokens, GQA 2:1."""
    B, LMAX, HQ, HKV, D, TQ = 3, 150, 4, 2, 16, 2
    q, k, v, r = decode_inputs(B, LMAX, HQ, HKV, D, TQ, probe)
    seqlens = torch.tensor([5, 150, 77], dtype=torch.int32)
    ref = decode_reference(q, k, v, seqlens, r, window)
    out = parallax_decode_triton(q, k, v, seqlens, r, window_size=window, num_splits=splits)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-5


def test_decode_tile_rule():
    """The long-program tile for ≥ LONG_MIN_KEYS keys per program in grids of ≤ LONG_MAX_PROGRAMS_PER_SM programs
    per SM; the many-program tile for ≥ MANY_MIN_KEYS keys in larger grids; DECODE_CFG otherwise."""
    cpu = torch.device("cpu")  # 4 "SMs"
    few, many = 4 * kops.LONG_MAX_PROGRAMS_PER_SM, 4 * kops.LONG_MAX_PROGRAMS_PER_SM + 1
    assert kops.decode_cfg(kops.LONG_MIN_KEYS, few, cpu) is kops.DECODE_CFG_LONG
    assert kops.decode_cfg(kops.LONG_MIN_KEYS - 1, few, cpu) is kops.DECODE_CFG
    assert kops.decode_cfg(kops.LONG_MIN_KEYS, many, cpu) is kops.DECODE_CFG
    assert kops.decode_cfg(kops.MANY_MIN_KEYS, many, cpu) is kops.DECODE_CFG_MANY
    assert kops.decode_cfg(kops.MANY_MIN_KEYS - 1, many, cpu) is kops.DECODE_CFG
    assert kops.decode_cfg(kops.MANY_MIN_KEYS, few, cpu) is kops.DECODE_CFG_LONG
    assert kops.decode_cfg(kops.MANY_MIN_KEYS, many, cpu, probe=False) is kops.DECODE_CFG_MANY_SOFTMAX


def test_decode_many_tile_needs_the_shared_memory(monkeypatch):
    """The many-program tiles only where the GPU has their shared memory per program (Parallax 128 KB of K/V stages
    at D=128, softmax 192 KB): an A100 (163 KB) keeps Parallax's, a consumer GPU (99 KB) only the D=64 one."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(kops, "_n_sm", lambda device: 4)
    many = 4 * kops.LONG_MAX_PROGRAMS_PER_SM + 1
    px, sm, base = kops.DECODE_CFG_MANY, kops.DECODE_CFG_MANY_SOFTMAX, kops.DECODE_CFG
    # shared memory: (Parallax D=128, D=64, softmax D=128, D=64)
    for smem, want in ((227 * 1024, (px, px, sm, sm)), (163 * 1024, (px, px, base, sm)),
                       (99 * 1024, (base, px, base, base))):
        monkeypatch.setattr(kops, "_props", lambda index, _s=smem: SimpleNamespace(shared_memory_per_block_optin=_s))
        got = tuple(kops.decode_cfg(kops.MANY_MIN_KEYS, many, cuda, D, probe)
                    for probe in (True, False) for D in (128, 64))
        assert all(g is w for g, w in zip(got, want)), smem


@pytest.mark.parametrize("tile", ["long", "many", "many-softmax"])
@pytest.mark.parametrize("window", [None, 20], ids=["full", "W20"])
def test_decode_long_tile(window, tile, monkeypatch):
    """The long-program tile (BN 32) and the many-program tiles (BN 128: with 4 splits of 150 keys, splits 2 and 3
    start past the cache and hold no key) against float64, per-row lengths, GQA 2:1, TQ=2."""
    monkeypatch.setattr(kops, "LONG_MIN_KEYS", 0)
    monkeypatch.setattr(kops, "MANY_MIN_KEYS", 0)
    monkeypatch.setattr(kops, "LONG_MAX_PROGRAMS_PER_SM", float("inf") if tile == "long" else 0)
    B, LMAX, HQ, HKV, D, TQ = 3, 150, 4, 2, 16, 2
    q, k, v, r = decode_inputs(B, LMAX, HQ, HKV, D, TQ, tile != "many-softmax")
    seqlens = torch.tensor([5, 150, 77], dtype=torch.int32)
    ref = decode_reference(q, k, v, seqlens, r, window)
    out = parallax_decode_triton(q, k, v, seqlens, r, window_size=window, num_splits=4)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-5


# id: (HQ, HKV, TQ, splits, probe); cache LMAX=90 in blocks of 16 (interpreter), so 3/5/7 splits leave some
# splits empty for the short rows (m = -inf partials) and give chunks that are not a multiple of the split size
MERGE_CASES = {
    "G4-TQ1-S3-probe": (4, 1, 1, 3, True),
    "G2-TQ2-S5-probe": (4, 2, 2, 5, True),
    "G1-TQ3-S2-softmax": (2, 2, 3, 2, False),
    "G4-TQ1-S7-softmax": (8, 2, 1, 7, False),
}


@pytest.mark.parametrize("case", list(MERGE_CASES), ids=list(MERGE_CASES))
@pytest.mark.parametrize("merge", ["fused", "fused-chunk2", "kernel", "kernel-BD4"])
def test_decode_merge_paths(case, merge, monkeypatch):
    """Fused (last-arriver) and two-launch merges against float64; the counters are zero afterwards and a second
    call gives the same output bit for bit (nothing left over from the first). fused-chunk2: the fused merge
    loads 2 splits at a time (several online-merge chunks, the last one partly masked for odd split counts).
    kernel-BD4: the merge kernel's programs each take 4 of the 16 channels."""
    HQ, HKV, TQ, splits, probe = MERGE_CASES[case]
    B, LMAX, D = 2, 90, 16
    if merge == "fused-chunk2":
        rows = max(2, 1 << ((HQ // HKV) * TQ - 1).bit_length())
        monkeypatch.setattr(kops, "MERGE_TILE", 2 * rows * D)
        merge = "fused"
    if merge == "kernel-BD4":
        monkeypatch.setitem(kops.MERGE_CFG, "BD", 4)
        assert kops.merge_grid(B * TQ * HQ, D) == (B * TQ * HQ, 4)
        merge = "kernel"
    q, k, v, r = decode_inputs(B, LMAX, HQ, HKV, D, TQ, probe)
    seqlens = torch.tensor([TQ + 4, 90], dtype=torch.int32)
    ref = decode_reference(q, k, v, seqlens, r)
    out = parallax_decode_triton(q, k, v, seqlens, r, num_splits=splits, merge=merge)
    assert torch.isfinite(out).all(), "unwritten (NaN) output rows"
    assert rel_err(out, ref) < 2e-5
    counters = kops.decode_counters(q.device, B * HKV)
    assert counters.eq(0).all(), f"counters not reset: {counters[:B * HKV].tolist()}"
    again = parallax_decode_triton(q, k, v, seqlens, r, num_splits=splits, merge=merge)
    assert torch.equal(again, out)
    assert counters.eq(0).all()


def test_decode_fused_merge_counts_arrivals():
    """A counter that is not zero before the call makes the fused merge skip (no program sees S − 1 first):
    the output stays NaN-poisoned. Shows the output really comes from the last-arriver branch."""
    q, k, v, r = decode_inputs(1, 64, 2, 1, 16, 1, True)
    seqlens = torch.tensor([64], dtype=torch.int32)
    counters = kops.decode_counters(q.device, 1)
    counters[0] = 100
    try:
        out = parallax_decode_triton(q, k, v, seqlens, r, num_splits=2, merge="fused")
        assert torch.isnan(out).all()
    finally:
        counters.zero_()


def test_decode_rejects_unknown_merge():
    q, k, v, r = decode_inputs(1, 16, 2, 1, 16, 1, True)
    with pytest.raises(ValueError, match="PARALLAX_DECODE_MERGE"):
        parallax_decode_triton(q, k, v, torch.tensor([16], dtype=torch.int32), r, merge="atomic")


def test_decode_matches_full_forward_last_rows():
    """The decode of the last TQ tokens equals the last TQ rows of the training forward."""
    T, HQ, HKV, D, TQ = 45, 4, 1, 16, 3
    q, k, v, r = make_inputs(1, T, HQ, HKV, D, True)
    full = parallax_triton(q, k, v, r)
    cache_k = torch.zeros(1, 64, HKV, D)
    cache_v = torch.zeros(1, 64, HKV, D)
    cache_k[:, :T], cache_v[:, :T] = k, v
    seqlens = torch.tensor([T], dtype=torch.int32)
    out = parallax_decode_triton(q[:, -TQ:], cache_k, cache_v, seqlens, r[:, -TQ:], num_splits=2)
    assert rel_err(out, full[:, -TQ:]) < 2e-5


# -------------------------------------------------------------------- integration
def test_torch_compile_fullgraph_no_graph_break():
    """fake + autograd registrations let torch.compile trace fwd and bwd as one graph."""
    q, k, v, r = (t.requires_grad_(True) for t in make_inputs(1, 17, 2, 1, 16, True))

    def f(q, k, v, r):
        return (parallax_triton(q, k, v, r) * 2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v, r)
    grads = torch.autograd.grad(loss, (q, k, v, r))
    ref_grads = torch.autograd.grad(f(q, k, v, r), (q, k, v, r))
    for g, gr in zip(grads, ref_grads):
        assert rel_err(g, gr) < 1e-6


def test_rejects_unsupported_head_dim():
    q, k, v, _ = make_inputs(1, 4, 2, 1, 16, False)
    with pytest.raises(ValueError, match="head dim"):
        parallax_triton(q[..., :12], k[..., :12], v[..., :12])


# -------------------------------------------------------------------- GPU, realistic shapes
GPU_CASES = {  # id: (B, T, HQ, HKV, D, probe, window, cu)
    "B2-T1000-H4-KV2-D64-probe": (2, 1000, 4, 2, 64, True, None, None),
    "B1-T4096-H4-KV2-D128-probe": (1, 4096, 4, 2, 128, True, None, None),
    "B1-T4096-H4-KV2-D128-softmax": (1, 4096, 4, 2, 128, False, None, None),
    "B1-T8192-H2-KV1-D64-probe": (1, 8192, 2, 1, 64, True, None, None),
    "B1-T8192-H2-KV1-D128-probe": (1, 8192, 2, 1, 128, True, None, None),
    "B1-T3000-H4-KV1-D128-probe-W700": (1, 3000, 4, 1, 128, True, 700, None),
    "B1-T3000-H4-KV2-D64-probe-docs": (1, 3000, 4, 2, 64, True, None, (0, 123, 1900, 3000)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_gpu_realistic(case, dtype):
    B, T, HQ, HKV, D, probe, window, cu = GPU_CASES[case]
    cu = torch.tensor(cu, dtype=torch.int32, device="cuda") if cu is not None else None
    q, k, v, r = make_inputs(B, T, HQ, HKV, D, probe, device="cuda", dtype=dtype)
    check_against_reference(q, k, v, r, cu=cu, window=window, ref_dtype=torch.float32)


def gpu_segments(layout, D, probe):
    """bf16 inputs on the GPU and their segments (keywords of ``run_fwd_at`` / ``run_bwd_at``): "docs", packed
    documents of 300, 1400 and 348 tokens; "offsets", a context-parallel shard of 0, 300, 1400 and 348 queries over
    200, 800, 1800 and 400 keys (query offsets)."""
    if layout == "docs":
        q, k, v, r = make_inputs(1, 2048, 4, 2, D, probe, device="cuda", dtype=torch.bfloat16)
        return q, k, v, r, dict(cu=torch.tensor([0, 300, 1700, 2048], dtype=torch.int32, device="cuda"),
                                max_seqlen=1400)
    q, k, v, r, cu, cu_k = offset_inputs([0, 300, 1400, 348], [200, 800, 1800, 400], 4, 2, D, probe,
                                         dtype=torch.bfloat16, device="cuda")
    return q, k, v, r, dict(cu=cu, max_seqlen=1400, cu_k=cu_k, max_seqlen_k=1800)


@pytest.mark.gpu_sweep
@pytest.mark.parametrize("layout", ["docs", "offsets"])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_every_fwd_candidate(D, layout, monkeypatch):
    """Each forward candidate of the short list and of the tune report's extras (TMA / warp-specialised ones
    included) pinned, probe and softmax, bf16, packed documents or query offsets (the TMA descriptors of K/V span
    the key tokens), against the float32 reference."""
    from attnlab.attention.ops.parallax.triton.common import FWD_SPECS, TUNE_EXTRA_FWD, configs, prune_fwd

    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "all")  # the whole list, not the test suite's first candidate
    for probe in (True, False):
        q, k, v, r, seg = gpu_segments(layout, D, probe)
        ref = naive_parallax(*(t.float() for t in (q, k, v)), r.float() if probe else None, cu_seqlens=seg["cu"],
                             cu_seqlens_k=seg.get("cu_k"))
        for c in prune_fwd(configs(FWD_SPECS + TUNE_EXTRA_FWD, ("BM", "BN")), {}, D=D, HAS_PROBE=probe):
            cfg = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
            spec = tuple(cfg.items())
            out = run_fwd_at(q, k, v, r, cfg, **seg)
            assert torch.isfinite(out).all(), spec
            assert rel_err(out, ref) < BUDGET[torch.bfloat16][0], (spec, rel_err(out, ref))


@pytest.mark.gpu
def test_gpu_tma_launch_in_a_new_thread():
    """Autograd runs the backward in its own thread, where Triton's allocator (a ContextVar) starts unset: a TMA
    launch there must set it itself even after one in this thread did, and match the plain tile."""
    import threading

    q, k, v, r = make_inputs(1, 512, 4, 2, 128, True, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(q)
    tiles = dict(num_warps=8, num_stages=3, BM=128, BN=64)
    out, errors = {}, []

    def run(tma):
        try:
            out[tma] = run_bwd_at(q, k, v, r, do, dict(tiles, TMA=tma), dict(BN=64, BM=64, num_warps=4,
                                                                               num_stages=2, TMA=tma))
        except Exception as e:  # noqa: BLE001 — re-raised in the test's thread below
            errors.append(e)

    run(False)
    run(True)  # this thread's context gets the allocator
    out["here"] = out.pop(True)
    t = threading.Thread(target=run, args=(True,))
    t.start()
    t.join()
    assert not errors, errors
    for a, b, c in zip(out[True], out["here"], out[False]):
        assert torch.isfinite(a).all() and rel_err(a, c) < 1e-2 and torch.equal(a, b)


@pytest.mark.gpu_sweep
@pytest.mark.parametrize("layout", ["docs", "offsets"])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_every_bwd_candidate(D, layout, monkeypatch):
    """Each row-pass and column-pass candidate of the short lists and the tune report's extras (TMA twins included)
    pinned, in pairs, probe and softmax, bf16, packed documents or query offsets: every gradient against the float32
    reference (with offsets, the 200 keys of the segment without queries get exactly zero dk, dv)."""
    from attnlab.attention.ops.parallax.triton.common import (DKV_SPECS, DQ_SPECS, TUNE_EXTRA_DKV, TUNE_EXTRA_DQ,
                                                              configs, prune_bwd)

    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "all")  # the whole list, not the test suite's first candidate
    pinned = lambda c: dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)  # noqa: E731
    for probe in (True, False):
        q, k, v, r, seg = gpu_segments(layout, D, probe)
        ins = [t.float().requires_grad_(True) for t in (q, k, v, r) if t is not None]
        ref = naive_parallax(*ins[:3], ins[3] if probe else None, cu_seqlens=seg["cu"], cu_seqlens_k=seg.get("cu_k"))
        do = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, ins, do)
        dqs = [pinned(c) for c in prune_bwd(configs(DQ_SPECS + TUNE_EXTRA_DQ, ("BM", "BN")), {}, D=D,
                                            HAS_PROBE=probe)]
        dkvs = [pinned(c) for c in prune_bwd(configs(DKV_SPECS + TUNE_EXTRA_DKV, ("BN", "BM")), {}, D=D,
                                             HAS_PROBE=probe)]
        for i in range(max(len(dqs), len(dkvs))):
            dq_cfg, dkv_cfg = dqs[i % len(dqs)], dkvs[i % len(dkvs)]
            grads = run_bwd_at(q, k, v, r, do.bfloat16(), dq_cfg, dkv_cfg, **seg)
            for name, g, gr in zip("qkvr", grads, ref_grads):
                assert torch.isfinite(g).all(), (name, dq_cfg, dkv_cfg)
                assert rel_err(g, gr) < BUDGET[torch.bfloat16][1], (name, dq_cfg, dkv_cfg, rel_err(g, gr))
            if layout == "offsets":
                assert all(g[0, :200].eq(0).all() for g in grads[1:3]), (dq_cfg, dkv_cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("probe", [True, False], ids=["probe", "softmax"])
def test_gpu_decode_vs_full_forward(D, probe):
    B, T, HQ, HKV, LMAX = 4, 3000, 16, 8, 4096
    q, k, v, r = make_inputs(B, T, HQ, HKV, D, probe, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([3000, 1, 1500, 2999], dtype=torch.int32, device="cuda")
    cache_k = torch.zeros(B, LMAX, HKV, D, device="cuda", dtype=torch.bfloat16)
    cache_v = torch.zeros_like(cache_k)
    cache_k[:, :T], cache_v[:, :T] = k, v
    q_new = torch.stack([q[b, lens[b] - 1] for b in range(B)])[:, None]  # [B, 1, HQ, D]
    r_new = torch.stack([r[b, lens[b] - 1] for b in range(B)])[:, None] if probe else None
    out = parallax_decode_triton(q_new, cache_k, cache_v, lens, r_new)
    full = parallax_triton(q, k, v, r)
    ref = torch.stack([full[b, lens[b] - 1] for b in range(B)])[:, None]
    assert rel_err(out, ref) < 1e-2
    ref32 = naive_parallax_decode(q_new.float(), cache_k.float(), cache_v.float(), lens,
                                  r_new.float() if probe else None)
    assert rel_err(out, ref32) < 1e-2


def test_public_dispatch_reference_and_triton_agree():
    """attention.ops.parallax entry points: impl='triton' (interpreter here) equals impl='reference'."""
    from attnlab.attention.ops.parallax import parallax_attention, parallax_decode

    q, k, v, r = make_inputs(1, 19, 2, 1, 16, True)
    a = parallax_attention(q, k, v, r, impl="triton")
    b = parallax_attention(q, k, v, r, impl="reference")
    assert rel_err(a, b) < 2e-5
    seqlens = torch.tensor([19], dtype=torch.int32)
    c = parallax_decode(q[:, -1:], k, v, seqlens, r[:, -1:], impl="triton")
    d = parallax_decode(q[:, -1:], k, v, seqlens, r[:, -1:], impl="reference")
    assert rel_err(c, d) < 2e-5 and rel_err(c, a[:, -1:]) < 2e-5
    with pytest.raises(ValueError, match="attention.impl"):
        parallax_decode(q[:, -1:], k, v, seqlens, impl="cuda")


@pytest.mark.gpu
def test_gpu_inductor_fullgraph_block():
    """Inductor compiles projections + the custom op + backward as one graph (fullgraph=True raises on a break)."""
    torch._dynamo.reset()
    lin = torch.nn.Linear(256, 2 * 256 + 2 * 128, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def block(x):
        q, r, k, v = lin(x).split([256, 256, 128, 128], dim=-1)
        B, T = x.shape[:2]
        o = parallax_triton(q.reshape(B, T, 4, 64), k.reshape(B, T, 2, 64), v.reshape(B, T, 2, 64),
                            r.reshape(B, T, 4, 64))
        return o.float().square().mean()

    loss = torch.compile(block, fullgraph=True)(x)
    (gx,) = torch.autograd.grad(loss, x)
    (gx_eager,) = torch.autograd.grad(block(x), x)
    assert rel_err(gx, gx_eager) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("B, HQ, HKV, L, splits", [(1, 16, 8, 4096, 0), (1, 4, 1, 32768, 64), (3, 8, 2, 2000, 13)])
def test_gpu_decode_fused_merge_graph_replay(B, HQ, HKV, L, splits):
    """Fused merge on the GPU: matches the two-launch merge and the fp32 reference, with many splits racing on one
    counter (64 splits of one row; 13 splits, two merge chunks), and inside a CUDA graph replayed 3 times (same
    bits each time, the counters back to 0)."""
    D, dt = 128, torch.bfloat16
    q, r = torch.randn(B, 1, HQ, D, device="cuda", dtype=dt), 0.3 * torch.randn(B, 1, HQ, D, device="cuda", dtype=dt)
    kc, vc = (torch.randn(B, L, HKV, D, device="cuda", dtype=dt) for _ in range(2))
    lens = torch.randint(1, L + 1, (B,), device="cuda", dtype=torch.int32)
    lens[0] = L
    fused = parallax_decode_triton(q, kc, vc, lens, r, num_splits=splits, merge="fused")
    two = parallax_decode_triton(q, kc, vc, lens, r, num_splits=splits, merge="kernel")
    ref = naive_parallax_decode(q.float(), kc.float(), vc.float(), lens, r.float())
    assert rel_err(fused, ref) < 1e-2
    assert rel_err(fused, two) < 4e-3  # same partials, another merge order: bf16 roundings of o may differ
    counters = kops.decode_counters(q.device, B * HKV)
    assert counters.eq(0).all()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = parallax_decode_triton(q, kc, vc, lens, r, num_splits=splits, merge="fused")
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused)  # the merging program reads the splits in a fixed order: deterministic
        assert counters.eq(0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
def test_gpu_decode_two_launch_graph_replay(pdl, monkeypatch):
    """The default two-launch merge, its merge kernel launched as a programmatic dependent (Hopper) or not: equal
    to the fp32 reference, and inside a CUDA graph (captured with the dependency edge) replayed 3 times after the
    inputs change between replays, so a merge that ran before the split kernel's stores landed would show."""
    monkeypatch.setattr(kops, "DECODE_PDL", pdl)
    B, HQ, HKV, L, D, dt = 2, 8, 4, 8192, 128, torch.bfloat16  # a merge grid small enough for the PDL rule
    q, r = torch.randn(B, 1, HQ, D, device="cuda", dtype=dt), 0.3 * torch.randn(B, 1, HQ, D, device="cuda", dtype=dt)
    kc, vc = (torch.randn(B, L, HKV, D, device="cuda", dtype=dt) for _ in range(2))
    lens = torch.tensor([L, L // 3], device="cuda", dtype=torch.int32)
    assert kops.decode_splits(B, HKV, L, q.device) > 1
    rows, blocks = kops.merge_grid(B * HQ, D)
    assert kops._pdl(q.device, rows * blocks) == (pdl and torch.cuda.get_device_capability()[0] >= 9)  # path under test
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = parallax_decode_triton(q, kc, vc, lens, r, merge="kernel")
    for _ in range(3):
        q.normal_(); vc.normal_()
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = naive_parallax_decode(q.float(), kc.float(), vc.float(), lens, r.float())
        assert rel_err(out, ref) < 1e-2
