"""Context parallelism (attnlab/attention/cp.py) on CPU: the layout and the primitives in one process, the kernels
over each rank's segments, what the configuration refuses, and softmax trained on 2 gloo processes (CP = 2) against
one process on rows whose documents cross the shards (token throughput, the chunked loss; a hybrid at CP = 4 with
-m slow). Every registered mechanism's CP training and resume: the conformance matrix's CP column
(tests/test_conformance.py, attnlab.testing.conformance.check_context_parallel)."""

from __future__ import annotations

import functools

import pytest
import torch

from attnlab.attention.cp import ContextParallel, documents
from attnlab.attention.ops.common import visibility_mask
from attnlab.attention.registry import REGISTRY
from attnlab.config import DEFAULT_CONFIG, parse_config, validate_config
from attnlab.testing.tiny_runs import losses, make_corpus, read_metrics, tiny_args
from tests.utils import run_train

NAMES = sorted(n for n, e in REGISTRY.items() if getattr(e.cls, "context_parallel", False))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_shards_put_back_together_in_order(n):
    x = torch.arange(2 * 12 * n).view(2, 12 * n)
    ranks = [ContextParallel(None, n, r) for r in range(n)]
    parts = [cp.shard(x) for cp in ranks]
    assert all(p.shape == (2, 12) for p in parts)
    for cp, p in zip(ranks, parts):
        assert torch.equal(p[0], cp.global_index(12, "cpu"))  # x[0] counts positions
        assert torch.equal(cp.assemble(parts, 1), x)
    # the load balance: rank r's two chunks see (r + 1) + (2n - r) = 2n + 1 chunks of keys under a causal mask
    assert {sum(i + 1 for i in cp.chunks()) for cp in ranks} == {2 * n + 1}
    # the reduce-scatter layout (NCCL's backward of the gather): piece r is rank r's shard, the sequence dim first
    y = torch.arange(2 * 12 * n * 3).view(2, 12 * n, 3)
    pieces = ranks[0].by_rank(y, 1).chunk(n, 0)
    assert all(torch.equal(pieces[r], cp.shard(y, 1).movedim(1, 0)) for r, cp in enumerate(ranks))


def _group(n: int, local) -> list[ContextParallel]:
    """The n ranks of a CP group in one process: each rank's ``gather`` returns what every rank q hands it,
    ``local(rank q's ContextParallel)``, in global order (the communication the primitives build on)."""

    class OneProcess(ContextParallel):
        def gather(self, x, dim=1):
            parts = [local(ContextParallel(None, n, q)) for q in range(n)]
            assert torch.equal(x, parts[self.rank])
            return self.assemble(parts, dim)

    return [OneProcess(None, n, r) for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_halo_puts_the_tokens_before_each_chunk_in_front_of_it(n):
    B, c, w, C = 2, 4, 3, 5
    x = torch.randn(B, 2 * n * c, C)
    padded = torch.cat([x.new_zeros(B, w, C), x], 1)  # zeros before the row's start
    for cp in _group(n, lambda q: q.shard(x).view(B, 2, c, C)[:, :, c - w:]):
        ext = cp.halo(cp.shard(x), w)
        for half, i in enumerate(cp.chunks()):
            assert torch.equal(ext[:, half], padded[:, i * c:i * c + w + c]), (cp.rank, half)
    w = c + 2  # a window wider than a chunk: the history comes from the whole row
    padded = torch.cat([x.new_zeros(B, w, C), x], 1)
    for cp in _group(n, lambda q: q.shard(x)):
        ext = cp.halo(cp.shard(x), w)
        for half, i in enumerate(cp.chunks()):
            assert torch.equal(ext[:, half], padded[:, i * c:i * c + w + c]), (cp.rank, half, w)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_states_entering_composes_every_chunks_transition_in_order(n):
    """S_0 = 0, S_i = M_{i-1} S_{i-1} + B_{i-1}, reset where chunk i starts a document, from the [B | M] maps."""
    B, H, K, V = 2, 3, 4, 2
    maps = torch.randn(B, 2 * n, H, K, V + K, dtype=torch.float64)
    continues = torch.rand(B, 2 * n - 1) > 0.3
    states = [maps.new_zeros(B, H, K, V)]
    for i in range(1, 2 * n):
        step = maps[:, i - 1, ..., V:] @ states[-1] + maps[:, i - 1, ..., :V]
        states.append(torch.where(continues[:, i - 1, None, None, None], step, 0))
    for cp in _group(n, lambda q: q.shard(maps)):
        got = cp.states_entering(cp.shard(maps), continues)
        assert torch.allclose(got, torch.stack([states[i] for i in cp.chunks()], 1)), cp.rank


def test_row_segments_cut_the_whole_rows_at_every_document_start():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [3, 4, 5, 6, 0, 1, 2, 3]])  # row 1 starts inside a document
    cu = ContextParallel(None, 2, 0).row_segments(documents(positions))
    assert cu.tolist() == [0, 3, 5, 8, 12, 16]


def _segment_mask(seg, B: int, c: int, T: int, window) -> torch.Tensor:
    """[B, c, T] bool: which keys of the row each of the chunk's queries sees, read off the segments as the kernels
    read them (query j of a segment of Lq queries and Lk keys sees its keys 0 .. Lk - Lq + j)."""
    mask = torch.zeros(B, c, T, dtype=torch.bool)
    for s in range(seg.cu_q.numel() - 1):
        q0, q1, k0, k1 = (int(x) for x in (seg.cu_q[s], seg.cu_q[s + 1], seg.cu_k[s], seg.cu_k[s + 1]))
        assert k1 - k0 >= q1 - q0 and (q1 == q0 or (q0 // c == (q1 - 1) // c == k0 // seg.keys))  # one row
        for j in range(q1 - q0):
            last = k0 + (k1 - k0) - (q1 - q0) + j  # flattened position of the query's own key
            first = k0 if not window else max(k0, last - window + 1)
            row = (q0 + j) // c
            mask[row, (q0 + j) % c, first % seg.keys:last % seg.keys + 1] = True
    return mask


def test_segments_give_each_chunk_the_full_masks_rows():
    """Causal and document masks (documents crossing the chunks, one starting at a chunk's first token), with and
    without a window: a chunk's segments see exactly the one-process mask's rows of its queries."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3],
                              [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    B, T = positions.shape
    starts = (positions.reshape(-1) == 0).nonzero().flatten()
    cu = torch.cat([starts, torch.tensor([B * T])]).to(torch.int32)
    for window in (None, 3):
        full = visibility_mask(B, T, "cpu", cu, window).expand(B, 1, T, T)[:, 0]
        for n in (2, 3):
            for r in range(n):
                cp = ContextParallel(None, n, r)
                rows = full[:, cp.global_index(T // n, "cpu")]  # [B, T / n, T]
                c = T // (2 * n)
                for half, chunk in enumerate(cp.chunks()):
                    seg = cp.segments(documents(positions), half)
                    assert seg.keys == (chunk + 1) * c and seg.cu_k[-1] == B * seg.keys and seg.cu_q[-1] == B * c
                    assert (seg.max_q, seg.max_k) == (int(seg.cu_q.diff().max()), int(seg.cu_k.diff().max()))
                    got = _segment_mask(seg, B, c, T, window)
                    assert torch.equal(got, rows[:, half * c:(half + 1) * c]), (window, n, r, half)


def _random_positions(rng: torch.Generator, B: int, T: int) -> torch.Tensor:
    """[B, T] per-document positions of documents of 1..T tokens packed into rows, a row starting inside a document
    (its positions not starting at 0) half of the time: boundaries land anywhere, on and across the chunks."""
    rows = []
    for _ in range(B):
        row = torch.cat([torch.arange(m) for m in torch.randint(1, T + 1, (2 * T,), generator=rng).tolist()])
        offset = int(torch.randint(0, T, (1,), generator=rng)) * int(torch.randint(0, 2, (1,), generator=rng))
        rows.append(row[offset:offset + T])
    return torch.stack(rows)


def _fields(x) -> list:
    return [x] if isinstance(x, torch.Tensor) else [getattr(x, f) for f in x.__dataclass_fields__]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_segments_built_on_the_host_equal_those_the_layers_build_on_the_device(n):
    """The trainer's layouts (:meth:`BatchSegments.on_host` from the whole rows' positions, copied over) equal the
    ones a layer builds from the context's device tensors (the document index from every rank's shard of the
    positions, as the model's context gathers them), on random document layouts and on causal rows; once copied,
    the layers read nothing back (no host sync: the CPU counter of attnlab/trainer/syncs.py)."""
    from attnlab.attention.cp import BatchSegments
    from attnlab.trainer.syncs import CpuSyncs

    rng = torch.Generator().manual_seed(n)
    to_device = functools.partial(torch.Tensor.to, device=torch.zeros(1).device, non_blocking=True)  # a device's
    widths = (1, 3, 7)  # a window wider than a chunk included
    for trial in range(6):
        B, c = int(torch.randint(1, 4, (1,), generator=rng)), int(torch.randint(1, 6, (1,), generator=rng))
        T = 2 * n * c
        positions = _random_positions(rng, B, T)
        ranks = [ContextParallel(None, n, r) for r in range(n)]
        for cp in ranks:
            for pos in (positions, None):
                with CpuSyncs() as counter:
                    counter.mark_host(pos)
                    host = BatchSegments.on_host(cp, pos, (B, T)).build(widths)
                    moved = host.to(to_device)
                    assert counter.take() == []
                    if pos is None:
                        docs, local = torch.zeros(B, T, dtype=torch.int64), cp.global_index(T // n, "cpu").expand(B, -1)
                    else:
                        docs = documents(cp.assemble([q.shard(pos) for q in ranks], 1))
                        local = cp.shard(pos)
                    device = BatchSegments(cp, to_device(docs), to_device(local))
                    built = [moved.segments(0), moved.segments(1), moved.chunk_segments(), moved.row_segments(),
                             *(moved.halo_segments(w) for w in widths)]
                    assert counter.take() == []  # the layers' reads of the copied layouts
                    want = [device.segments(0), device.segments(1), device.chunk_segments(), device.row_segments(),
                            *(device.halo_segments(w) for w in widths)]
                    assert counter.take(), "the device-built layouts read back (the test would see a sync)"
                for got, exp in zip(built, want):
                    assert type(got) is type(exp)
                    for a, b in zip(_fields(got), _fields(exp)):
                        if isinstance(b, torch.Tensor):
                            assert a.dtype == b.dtype and torch.equal(a, b), (trial, cp.rank, pos, a, b)
                        else:
                            assert a == b, (trial, cp.rank, pos, a, b)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _rank_outputs_against_one_process(impl, device, dtype, D, probe, window, n, T, tol):
    """Every rank's chunks through :func:`attend_chunks` (the whole row's keys handed over directly, as the
    all-gather would) against the float64 reference over the full rows: the relative error of the outputs and of
    the gradients of q, k, v (and ρ) summed over the ranks, within ``tol`` = (outputs, gradients). The kernels'
    outputs start as NaN (tests/conftest.py): an element left unwritten shows."""
    from attnlab.attention.base import AttentionContext
    from attnlab.attention.ops.parallax.naive import naive_parallax
    from attnlab.attention.softmax import attend_chunks

    torch.manual_seed(0)
    B, HQ, HKV = 2, 4, 2
    # row 0: documents of 5, 11, 1 tokens and the rest, crossing the chunks; row 1: one causal sequence
    row0 = torch.cat([torch.arange(m) for m in (5, 11, 1, T)])[:T]
    positions = torch.stack([row0, torch.arange(T)]).to(device)
    q, k, v = (torch.randn(B, T, h, D, device=device, dtype=dtype, requires_grad=True) for h in (HQ, HKV, HKV))
    r = (0.3 * torch.randn(B, T, HQ, D, device=device)).to(dtype).requires_grad_() if probe else None
    g = torch.randn(B, T, HQ, D, device=device, dtype=dtype)
    starts = (positions.reshape(-1) == 0).nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([B * T])]).to(torch.int32)
    leaves = [t for t in (q, k, v, r) if t is not None]
    ref = naive_parallax(*(t.double() for t in (q, k, v)), None if r is None else r.double(), cu_seqlens=cu,
                         window_size=window)
    want = torch.autograd.grad((ref * g.double()).sum(), leaves)
    loss = 0
    for rank in range(n):
        cp = ContextParallel(None, n, rank)
        ctx = AttentionContext(positions=cp.shard(positions), cp=cp, cp_docs=documents(positions))
        o = attend_chunks(cp.shard(q), k, v, None if r is None else cp.shard(r), ctx, window, D**-0.5, impl)
        assert _rel(o, cp.shard(ref)) < tol[0], (rank, _rel(o, cp.shard(ref)))
        loss = loss + (o.double() * cp.shard(g).double()).sum()
    got = torch.autograd.grad(loss, leaves)
    for name, a, b in zip("qkvr", got, want):
        assert torch.isfinite(a).all() and _rel(a, b) < tol[1], (f"d{name}", _rel(a, b))


@pytest.mark.parametrize("impl,probe,window", [("reference", False, None), ("reference", True, 5),
                                               ("triton", True, None), ("triton", False, 7)])
def test_each_ranks_chunks_attend_as_the_full_rows(impl, probe, window):
    """CPU: the reference and the Triton kernels (interpreter, T = 36: chunks of 9 and 4.5-tile rows) over the
    segments of 2 and 3 ranks."""
    for n in (2, 3):
        _rank_outputs_against_one_process(impl, "cpu", torch.float32, 16, probe, window, n, 36, (2e-6, 2e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("probe,window", [(False, None), (True, None), (True, 300), (False, 300)])
def test_each_ranks_chunks_attend_as_the_full_rows_on_gpu(probe, window):
    """CUDA, bf16, D = 128, 4 ranks over rows of 2040 tokens: softmax and Parallax through the Triton kernels
    ("auto"), with and without a window."""
    _rank_outputs_against_one_process("auto", "cuda", torch.bfloat16, 128, probe, window, 4, 2040, (2e-2, 4e-2))


def _cfg(*flags):
    return parse_config(["--job.config_file", DEFAULT_CONFIG, "--parallelism.context_parallel_degree", "2", *flags])


def test_every_registered_mechanism_declares_context_parallelism():
    assert NAMES == sorted(REGISTRY)


@pytest.mark.parametrize("flags,message", [
    (["--model.attention", "hla"], "mechanism 'hla' does not run under context parallelism (its class does not set "
                                   "context_parallel = True; docs/context_parallel.md"),
    (["--model.layer_pattern", "softmax,hla"], "mechanism 'hla' does not run under context parallelism"),
    (["--training.seq_len", "30"], "training.seq_len=30: must be a multiple of 2 x parallelism.context_parallel_degree"),
    (["--model.attention", "hla", "--compile.enable"], "compile.enable with parallelism.context_parallel_degree=2: "
                                                       "mechanism 'hla' is not known to compile under context "
                                                       "parallelism (docs/context_parallel.md"),
])
def test_what_context_parallelism_cannot_run_fails_naming_the_key(flags, message, monkeypatch):
    """A mechanism without ``context_parallel = True`` (HLA's class made one) is refused, naming it and the docs;
    so is compiling a mechanism without ``context_parallel_compiles = True`` (HLA's class made one)."""
    key = "context_parallel_compiles" if "--compile.enable" in flags else "context_parallel"
    monkeypatch.setattr(REGISTRY["hla"].cls, key, False, raising=False)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate_config(_cfg(*flags))


def test_compile_runs_with_context_parallelism_where_the_mechanisms_declare_it():
    validate_config(_cfg("--model.layer_pattern", "gdn,parallax", "--compile.enable"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    # documents of 5 words + BOS/EOS = 7 tokens packed into rows of 16 + 1: document boundaries fall inside and
    # across the four chunks of each row
    return make_corpus(tmp_path_factory.mktemp("cp_corpus"), seq_len=6, n_train=96, n_val=16)


def _train(corpus, dump, attention, nproc, *extra):
    flags = tiny_args(corpus, dump, 4, 16, 2, "--model.attention", attention, "--model.attn_mask_type", "block_causal",
                      "--optimizer.name", "adamw", "--checkpoint.enable", "--checkpoint.interval", "2",
                      "--validation.freq", "2", *extra)
    if nproc > 1:
        flags += ["--parallelism.context_parallel_degree", str(nproc)]
    run_train(flags, nproc=nproc)
    return losses(dump)


@pytest.fixture(scope="module", params=["softmax"])
def runs(request, corpus, tmp_path_factory):
    """(mechanism, one-process losses, CP = 2 losses, the CP run's folder), both runs from one seed checkpoint
    (sharded and unsharded initialisation draw different numbers)."""
    root = tmp_path_factory.mktemp(f"cp_{request.param}")
    _train(corpus, root / "seed", request.param, 1, "--checkpoint.create_seed_checkpoint")
    seed = ["--checkpoint.initial_load_path", str(root / "seed" / "checkpoint" / "step-0")]
    one = _train(corpus, root / "one", request.param, 1, *seed)
    two = _train(corpus, root / "cp2", request.param, 2, *seed)
    return request.param, one, two, root


def test_two_context_ranks_train_and_validate_as_one_process(runs):
    _, one, two, root = runs
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for s in one:
        assert abs(one[s] - two[s]) <= 1e-4, (s, one[s], two[s])
    val_one, val_two = ({r["step"]: r["val_loss"] for r in read_metrics(root / d) if "val_loss" in r}
                        for d in ("one", "cp2"))
    assert 4 in val_one and sorted(val_one) == sorted(val_two)
    for s in val_one:
        assert abs(val_one[s] - val_two[s]) <= 1e-4, (s, val_one[s], val_two[s])
    # tokens/s per GPU: each of the 2 ranks runs half of a step's 2 x 16 tokens in the step's time (torchtitan
    # divides by the CP degree; dividing twice would halve it). Step 4: no validation or save before it.
    rec = {r["step"]: r for r in read_metrics(root / "cp2") if "tps" in r}
    ratio = rec[4]["tps"] * 2 * (rec[4]["elapsed_s"] - rec[3]["elapsed_s"]) / 32
    assert 0.7 < ratio < 1.43, (rec[4]["tps"], ratio)


def test_the_chunked_loss_under_context_parallelism_trains_as_one_process(runs, corpus, tmp_path):
    """``training.loss_chunk_tokens = 5`` on each rank's shard (2 rows of 8 tokens: chunks of 5, the last of 1)
    against the logits' loss on one process: training and validation losses."""
    attention, one, _, root = runs
    seed = ("--checkpoint.initial_load_path", str(root / "seed" / "checkpoint" / "step-0"))
    got = _train(corpus, tmp_path, attention, 2, *seed, "--training.loss_chunk_tokens", "5")
    assert sorted(got) == sorted(one)
    for s in one:
        assert abs(got[s] - one[s]) <= 1e-4, (s, got[s], one[s])
    val_one, val_got = ({r["step"]: r["val_loss"] for r in read_metrics(d) if "val_loss" in r}
                        for d in (root / "one", tmp_path))
    assert val_one and sorted(val_one) == sorted(val_got)
    assert all(abs(val_one[s] - val_got[s]) <= 1e-4 for s in val_one), (val_one, val_got)


@pytest.mark.slow
def test_four_context_ranks_train_a_hybrid_as_one_process(corpus, tmp_path):
    """CP = 4 (8 chunks of 4 tokens, each holding a short convolution's 3 inputs of history) on the GDN + Parallax
    layer pattern of the hybrid config, against one process."""
    flags = ("--model.layer_pattern", "gdn,parallax", "--training.seq_len", "32", "--validation.seq_len", "32")
    _train(corpus, tmp_path / "seed", "gdn", 1, "--checkpoint.create_seed_checkpoint", *flags)
    seed = ("--checkpoint.initial_load_path", str(tmp_path / "seed" / "checkpoint" / "step-0"))
    one = _train(corpus, tmp_path / "one", "gdn", 1, *seed, *flags)
    four = _train(corpus, tmp_path / "cp4", "gdn", 4, *seed, *flags)
    assert sorted(one) == sorted(four) == [1, 2, 3, 4]
    for s in one:
        assert abs(one[s] - four[s]) <= 1e-4, (s, one[s], four[s])
