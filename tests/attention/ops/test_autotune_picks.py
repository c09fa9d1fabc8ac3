"""attention.ops.autotune_picks: a shipped pick stands in for the autotuner's search at the first launch of a key
(only where GPU, Triton and fla-core match and the config is still in the list); recording writes the autotuner's
choices and merges them into a picks file (CPU, interpreter)."""

import json
import sys
import types

import pytest
import torch
import triton
import triton.language as tl

from attnlab.attention.ops import autotune_picks
from attnlab.attention.ops.autotune_picks import autotune_key
from attnlab.attention.ops.fla_launch import FastLaunch

N = 37


def _make_kernel(timings=(2.0, 1.0), prune=None):
    """A heuristics/autotune/jit chain over two configs; the autotuner's timings are ``timings`` (by config), and
    every timed call is counted in ``kernel.benched``."""
    benched = []

    def do_bench(kernel_call, quantiles):
        kernel_call()
        t = timings[len(benched) % len(timings)]
        benched.append(t)
        return [t, t, t]

    @triton.heuristics({"HAS_B": lambda a: a["b"] is not None})
    @triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)],
                     key=["N"], do_bench=do_bench, prune_configs_by={"early_config_prune": prune} if prune else None)
    @triton.jit
    def kernel(a, b, out, N, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        x = tl.load(a + offs, mask=m)
        if HAS_B:
            x += tl.load(b + offs, mask=m)
        tl.store(out + offs, x * 2.0, mask=m)

    kernel.benched = benched
    return kernel


def _launch(fast, first_launch=None):
    """One launch at key (N, float32 x3); the output checked against a·2 + b·2."""
    a, b = torch.randn(N), torch.randn(N)
    out = torch.full((N,), float("nan"))
    fast[lambda meta: (triton.cdiv(N, meta["BLOCK"]),)](a, b, out=out, N=N, first_launch=first_launch)
    torch.testing.assert_close(out, (a + b) * 2.0, rtol=0, atol=0)


KEY = [N, "torch.float32", "torch.float32", "torch.float32"]


def _entry(name, **changes):
    e = {"gpu": "sm90", "triton": triton.__version__, "fla": None, "kernel": name, "key": KEY,
         "config": {"kwargs": {"BLOCK": 32}, "num_warps": 2, "num_stages": 3, "num_ctas": 1, "maxnreg": None}}
    return {**e, **changes}


@pytest.fixture
def picks(tmp_path, monkeypatch):
    """The shipped file at a temporary path (unread), an H100 as the GPU, nothing recorded; returns a writer."""
    path = tmp_path / "picks.json"
    monkeypatch.setattr(autotune_picks, "PATH", path)
    monkeypatch.setattr(autotune_picks, "_picks", None)
    monkeypatch.setattr(autotune_picks, "gpu", lambda: "sm90")
    monkeypatch.delenv("ATTNLAB_PICKS", raising=False)
    monkeypatch.delenv("ATTNLAB_RECORD_PICKS", raising=False)

    def write(*entries):
        path.write_text(json.dumps({"about": "test", "entries": list(entries)}))

    return write


def test_autotune_key_is_tritons(picks):
    """The key computed for picks is the one Triton's Autotuner.run caches under (positional and keyword arguments,
    an outer heuristic's value, dtypes)."""
    kernel = _make_kernel()
    fast = FastLaunch(kernel)
    _launch(fast)
    assert list(fast.autotuner.cache) == [tuple(KEY)]
    kw = {"a": torch.randn(N), "b": torch.randn(N), "out": torch.empty(N), "N": N, "HAS_B": True}
    assert autotune_key(fast.autotuner, kw) == tuple(KEY)
    assert len(kernel.benched) == 2  # no picks file: the autotuner searched


def test_pick_stands_in_for_the_search(picks):
    """With a pick (the second config, not the first) the first launch times nothing, compiles nothing else and
    runs the picked config; later launches keep it."""
    kernel = _make_kernel(timings=(1.0, 2.0))  # a search would choose the first config
    fast = FastLaunch(kernel)
    picks(_entry(fast.name))
    first = []
    for _ in range(2):
        _launch(fast, first_launch=lambda: first.append(1))
    at = fast.autotuner
    assert kernel.benched == [] and first == []
    assert at.cache[tuple(KEY)] is at.configs[1] and at.best_config is at.configs[1]
    assert list(fast.configs.values()) == [at.configs[1]]


@pytest.mark.parametrize("change", ["other_sm", "other_triton", "other_config", "other_kernel", "disabled", "pruned"])
def test_pick_ignored_unless_it_applies(picks, monkeypatch, change):
    """A pick for another GPU or Triton, or whose config is no longer in the list (or pruned away at these
    arguments), or for another kernel, or with ATTNLAB_PICKS=0: the autotuner searches as before."""
    prune = (lambda configs, nargs, **kw: configs[:1]) if change == "pruned" else None
    kernel = _make_kernel(prune=prune)
    fast = FastLaunch(kernel)
    entry = _entry(fast.name)
    entry = {"other_sm": _entry(fast.name, gpu="sm80"), "other_triton": _entry(fast.name, triton="0.0.0"),
             "other_config": _entry(fast.name, config={**entry["config"], "num_stages": 4}),
             "other_kernel": _entry(fast.name + "_other")}.get(change, entry)
    picks(entry)
    if change == "disabled":
        monkeypatch.setenv("ATTNLAB_PICKS", "0")
    first = []
    _launch(fast, first_launch=lambda: first.append(1))
    at = fast.autotuner
    assert first == [1]
    if change == "pruned":  # one config left: Triton takes it untimed
        assert at.best_config is at.configs[0]
    else:
        assert len(kernel.benched) == 2 and at.best_config is at.configs[1]  # the faster by the timings


def test_fla_kernel_picks_need_the_running_fla_version(picks, monkeypatch):
    kernel = _make_kernel()
    at = kernel.fn
    name = "fla.ops.fake.kernel"
    picks(_entry(name, fla="0.6.0"))
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.5.0"))
    assert autotune_picks.pick(name, tuple(KEY), at.configs) is None
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.6.0"))
    assert autotune_picks.pick(name, tuple(KEY), at.configs) is at.configs[1]
    assert autotune_picks.pick(name, (N + 1, *KEY[1:]), at.configs) is None  # another key


def test_missing_picks_file_is_no_pick(picks):
    assert not autotune_picks.PATH.exists()
    assert autotune_picks.pick("any", tuple(KEY), _make_kernel().fn.configs) is None


def test_record_merges_into_the_file_and_round_trips(picks, tmp_path, monkeypatch):
    """ATTNLAB_RECORD_PICKS: the autotuner's choice per searched key is merged into the file (an entry of the same
    gpu/triton/fla/kernel/key replaced, others kept); that file as the shipped picks skips the search."""
    kernel = _make_kernel()  # the second config times faster
    fast = FastLaunch(kernel)
    recorded = tmp_path / "recorded.json"
    stale = _entry(fast.name, config={"kwargs": {"BLOCK": 16}, "num_warps": 1, "num_stages": 3, "num_ctas": 1,
                                      "maxnreg": None})
    other = _entry("elsewhere.kernel")
    recorded.write_text(json.dumps({"about": "kept", "entries": [stale, other]}))
    monkeypatch.setenv("ATTNLAB_RECORD_PICKS", str(recorded))
    _launch(fast)
    _launch(fast)  # not a new key: nothing more recorded
    autotune_picks.record("x", (object(),), fast.autotuner.configs[0])  # a key that is not JSON: skipped
    data = json.loads(recorded.read_text())
    assert data["about"] == "kept"
    assert sorted(data["entries"], key=lambda e: e["kernel"]) == sorted([_entry(fast.name), other],
                                                                        key=lambda e: e["kernel"])
    monkeypatch.delenv("ATTNLAB_RECORD_PICKS")

    autotune_picks.main(["merge", str(recorded)])  # into the (temporary) shipped file
    assert autotune_picks.read(autotune_picks.PATH) == autotune_picks.read(recorded)
    monkeypatch.setattr(autotune_picks, "_picks", None)  # as in a new process: the file is read at the first lookup
    again = _make_kernel(timings=(1.0, 2.0))
    fast = FastLaunch(again)
    _launch(fast)
    assert again.benched == [] and fast.autotuner.best_config is fast.autotuner.configs[1]


def test_nothing_recorded_for_a_single_config_or_a_picked_key(picks, tmp_path, monkeypatch):
    """Only searches are recorded: not a one-config list (ATTNLAB_AUTOTUNE=first), not a key a pick stood in for."""
    monkeypatch.setenv("ATTNLAB_RECORD_PICKS", str(tmp_path / "recorded.json"))
    single = _make_kernel()
    del single.fn.configs[1:]
    _launch(FastLaunch(single))
    fast = FastLaunch(_make_kernel())
    picks(_entry(fast.name))
    _launch(fast)
    assert not (tmp_path / "recorded.json").exists()


def test_shipped_picks_are_well_formed():
    """The committed file parses; every entry names a GPU, Triton version, kernel, JSON-scalar key and a complete
    config, once per (kernel, key, gpu, triton, fla); our own kernels' names resolve to their kernel function (FastLaunch.name)."""
    import importlib

    entries = autotune_picks.read(autotune_picks.PATH)
    seen = set()
    for e in entries:
        assert e["gpu"].startswith("sm") and e["triton"] and e["kernel"], e
        assert set(e["config"]) == {"kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg"}, e
        assert all(isinstance(v, (bool, int, float, str, type(None))) for v in e["key"]), e
        ident = (e["kernel"], json.dumps(e["key"]), e["gpu"], e["triton"], e["fla"])
        assert ident not in seen, e
        seen.add(ident)
        if e["fla"] is None:  # ours: module.function of the jit kernel (fla's need fla-core, not installed in CI)
            module, name = e["kernel"].rsplit(".", 1)
            obj = getattr(importlib.import_module(module), name)
            while hasattr(obj, "fn"):  # through heuristics, autotuner and jit to the Python function
                obj = obj.fn
            assert f"{obj.__module__}.{obj.__qualname__}" == e["kernel"], e
