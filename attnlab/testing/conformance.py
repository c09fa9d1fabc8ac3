"""The conformance cell: the lifecycle every mechanism (or mix of mechanisms over depth) goes through at the debug
size, as one function a test calls, the project's matrix (tests/test_conformance.py) and a researcher's own::

    from attnlab.testing.conformance import check_lifecycle

    def test_my_mechanism(tmp_path):
        check_lifecycle("my_mech", tmp_path, train_flags=["--experimental.custom_import", "mypkg.my_mech"],
                        pythonpath=["/path/to/folder/holding/mypkg"])

:func:`check_lifecycle` trains real (tiny) runs in subprocesses on gloo (CPU is enough), and reads their output back
in the calling process:

  - ``attnlab.train`` on 2 processes: the model built on the meta device, ``init_weights`` on FSDP-sharded (DTensor)
    parameters, Muon steps, validation on both ranks, and a checkpoint of the sharded state at step 3 (the run
    stops there as if preempted, ``training.stop_after_step``);
  - the same command without the stop, on one process: the run resumes from the 2-process checkpoint, resharded
    onto one, and trains step 4;
  - the last checkpoint read back offline as the tools read it (the run folder's config.toml, which imports
    ``experimental.custom_import`` here too), exported to a Hugging Face folder and imported again (the same
    logits), and decoded with the layers' caches (the same logits as the full forward).

Any failure is an AssertionError saying which step failed (with the training output's tail).

:func:`check_context_parallel` is the cell's context-parallel column (docs/context_parallel.md): the same mechanism
trained with ``parallelism.context_parallel_degree = 2`` on 2 gloo processes and on one process from one seed
checkpoint, on rows of several documents that cross the ranks' chunks, the training and validation losses within
1e-4; and the CP run's step-2 checkpoint resumed on one process, its steps 3 and 4 as the CP run's.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from attnlab.testing.tiny_runs import losses, make_corpus, read_metrics, tiny_args
from attnlab.tools.launch import child_env, train_command

__all__ = ["check_context_parallel", "check_lifecycle", "cp_corpus", "pattern_flags"]


def pattern_flags(pattern: str | Sequence[str]) -> list[str]:
    """train.py flags of a mechanism (``"gdn"`` or ``("gdn",)``: every layer) or a layer pattern repeated over depth
    (``("gdn", "gdn", "gdn", "parallax")``, with at least 4 layers)."""
    pattern = (pattern,) if isinstance(pattern, str) else tuple(pattern)
    if len(pattern) == 1:
        return ["--model.attention", pattern[0]]
    return ["--model.layer_pattern", ",".join(pattern), "--model.n_layers", str(max(4, len(pattern)))]


def _train(args: list[str], cwd: Path, pythonpath: Sequence[str | os.PathLike], timeout: int, what: str,
           nproc: int) -> None:
    """``python -m attnlab.train args`` on ``nproc`` processes, with ``pythonpath`` after this attnlab on
    PYTHONPATH."""
    env = child_env(OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *map(str, pythonpath)])
    proc = subprocess.run(train_command(args, nproc), env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{what}: training failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")


def check_lifecycle(pattern: str | Sequence[str], workdir: str | os.PathLike, *, train_flags: Sequence[str] = (),
                    pythonpath: Sequence[str | os.PathLike] = (), corpus: dict[str, str] | None = None,
                    timeout: int = 600, resume: bool = True) -> None:
    """Run the conformance cell (this module's docstring) for ``pattern``: a registered mechanism's name, or a
    layer pattern (:func:`pattern_flags`). Raises AssertionError at the first step that fails.

    ``workdir``: an empty folder for the run, the export and (without ``corpus``) the tiny corpus, e.g. pytest's
    ``tmp_path``. ``train_flags``: train.py flags added to both training commands, after the cell's own (so they
    override them), e.g. ``["--experimental.custom_import", "mypkg.my_mech", "--attention.my_mech.decay", "0.5"]``.
    ``pythonpath``: folders the training processes import from (after this ``attnlab``), e.g. the one holding
    ``mypkg``; they are also on this process's ``sys.path`` while the run is rebuilt from its config.toml, which
    imports ``experimental.custom_import`` here (its mechanism stays registered afterwards).
    ``corpus``: :func:`attnlab.testing.tiny_runs.make_corpus`'s paths, to share one corpus between calls.
    ``timeout``: seconds each training command may take. ``resume``: whether the cell resumes the run (its second
    launch, about half the cell's time on a CPU); without it the offline steps read the step-3 checkpoint.
    """
    import torch

    from attnlab.checkpoint.dcp import build_model
    from attnlab.checkpoint.hf import save_hf
    from attnlab.checkpoint.load import load_checkpoint, load_tool_checkpoint
    from attnlab.checkpoint.layout import resolve
    from attnlab.models.decode import generate

    pattern = (pattern,) if isinstance(pattern, str) else tuple(pattern)
    workdir = Path(workdir)
    corpus = corpus or make_corpus(workdir / "corpus")
    dump = workdir / "run"
    args = tiny_args(corpus, dump, 4, 16, 2, *pattern_flags(pattern), "--optimizer.name", "muon",
                     "--optimizer.muon_ns_dtype", "float32", "--validation.freq", "2", *train_flags)

    _train([*args, "--training.stop_after_step", "3"], workdir, pythonpath, timeout, "steps 1-3 on 2 processes",
           nproc=2)
    train = losses(dump)
    assert sorted(train) == [1, 2, 3] and all(math.isfinite(v) for v in train.values()), f"steps 1-3: {train}"
    val = {r["step"]: r["val_loss"] for r in read_metrics(dump) if "val_loss" in r}
    assert sorted(val) == [1, 2] and all(map(math.isfinite, val.values())), f"validation at 1 and 2: {val}"
    assert resolve(dump).step == 3, "no checkpoint of step 3 (the stop step)"

    if resume:
        _train(args, workdir, pythonpath, timeout, "the resume to step 4 on 1 process", nproc=1)
        recs = read_metrics(dump)
        steps = [r["step"] for r in recs if "loss" in r]
        assert steps == [1, 2, 3, 4], f"the resumed run did not continue at step 4 (steps logged: {steps})"
        assert all(math.isfinite(r["loss"]) for r in recs if "loss" in r), f"resume: {losses(dump)}"
        val = [r["step"] for r in recs if "val_loss" in r]
        assert val == [1, 2, 4] and all(math.isfinite(r["val_loss"]) for r in recs if "val_loss" in r), \
            f"validation at 1, 2 and the last step 4: {val}"

    # the sharded checkpoint, as the export and generate tools read it (run folder -> config.toml -> model)
    ckpt = resolve(dump)
    saved_path = list(sys.path)
    sys.path[:0] = map(str, pythonpath)
    try:
        fmt, model_args, sd, _ = load_tool_checkpoint(ckpt)
    finally:
        sys.path[:] = saved_path
    last = 4 if resume else 3
    assert (fmt, ckpt.step) == ("dcp", last), f"the last checkpoint is {fmt} step {ckpt.step}, not DCP step {last}"
    model = build_model(model_args, sd).eval()
    mechanisms = [layer.attention.mechanism for layer in model.layers.values()]
    assert mechanisms == [pattern[i % len(pattern)] for i in range(len(model.layers))], mechanisms
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
    assert torch.isfinite(ref).all(), "the checkpoint's logits are not finite"

    save_hf(model.state_dict(), model.model_args, workdir / "hf")
    fmt, hf_args, hf_sd = load_checkpoint(workdir / "hf")
    imported = build_model(hf_args, hf_sd)
    assert fmt == "hf" and [layer.attention.mechanism for layer in imported.layers.values()] == mechanisms
    with torch.no_grad():
        torch.testing.assert_close(imported(tokens), ref, rtol=0, atol=0, msg="HF export -> import changed the logits")

    res = generate(model, tokens[:, :6], 3, greedy=True, keep_logits=True)
    with torch.no_grad():
        full = model(res.tokens[:, :-1])[:, 5:]
    for i, step_logits in enumerate(res.step_logits):
        torch.testing.assert_close(step_logits, full[:, i], rtol=2e-4, atol=2e-4,
                                   msg=f"decode step {i}: the cached logits differ from the full forward's")


def cp_corpus(root: str | os.PathLike) -> dict[str, str]:
    """A corpus for :func:`check_context_parallel`: documents of 5 words + BOS/EOS = 7 tokens packed into rows of
    16 + 1, so document boundaries fall inside and across the four chunks of each row at CP = 2."""
    return make_corpus(Path(root), seq_len=6, n_train=96, n_val=16)


def check_context_parallel(pattern: str | Sequence[str], workdir: str | os.PathLike, *, degree: int = 2,
                           train_flags: Sequence[str] = (), pythonpath: Sequence[str | os.PathLike] = (),
                           corpus: dict[str, str] | None = None, timeout: int = 600, resume: bool = True,
                           compiled: bool = False, tol: float = 1e-4) -> dict[str, float]:
    """The context-parallel column of the cell for ``pattern`` (a mechanism's name or a layer pattern,
    :func:`pattern_flags`): a seed checkpoint, 4 AdamW steps (validation at 1, 2 and 4, checkpoints at 2 and 4) on one
    process and with ``context_parallel_degree = degree`` on ``degree`` gloo processes from it, block-causal rows
    whose documents cross the chunks; the losses must agree within ``tol``. The learning rate is 1e-3: at the debug
    config's 3e-3 without warmup AdamW's first steps amplify float32 summation-order differences (HLA's chunked
    passes against its one-process kernel: 2e-3 by step 4, 1.8e-5 at 1e-3) past the tolerance; that the CP path is
    exact is checked in float64 by tests/attention/test_context_parallel_modules.py. With ``resume``, the CP run's step-2
    checkpoint resumes on one process and steps 3-4 must match the CP run's. With ``compiled``, the CP run again with
    ``compile.enable`` (every block one graph, the collectives in it) must match the eager CP run's losses. ``corpus``: :func:`cp_corpus`'s paths
    (made in ``workdir`` without it). Returns the largest difference of each comparison ("training", "validation",
"resume"). Raises AssertionError."""
    import shutil

    pattern = (pattern,) if isinstance(pattern, str) else tuple(pattern)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = corpus or cp_corpus(workdir / "corpus")

    def train(name: str, nproc: int, *extra: str) -> Path:
        dump = workdir / name
        args = tiny_args(corpus, dump, 4, 16, 2, *pattern_flags(pattern), "--model.attn_mask_type", "block_causal",
                         "--optimizer.name", "adamw", "--optimizer.lr", "1e-3", "--checkpoint.enable",
                         "--checkpoint.interval", "2", "--validation.freq", "2", *train_flags, *extra)
        if nproc > 1:
            args += ["--parallelism.context_parallel_degree", str(nproc)]
        _train(args, workdir, pythonpath, timeout, f"{name} on {nproc} process(es)", nproc)
        return dump

    seed = train("seed", 1, "--checkpoint.create_seed_checkpoint")
    init = ("--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"))
    one, cp = train("one", 1, *init), train(f"cp{degree}", degree, *init)
    diffs = {}
    for what, key in (("training", "loss"), ("validation", "val_loss")):
        a, b = ({r["step"]: r[key] for r in read_metrics(d) if key in r} for d in (one, cp))
        want = [1, 2, 3, 4] if key == "loss" else [1, 2, 4]
        assert sorted(a) == sorted(b) == want, f"{what} steps: one process {sorted(a)}, CP = {degree} {sorted(b)}"
        diffs[what] = max(abs(a[s] - b[s]) for s in a)
        assert diffs[what] <= tol, \
            f"{what} losses, one process {a} vs CP = {degree} {b}: differ by {diffs[what]:.2e} > {tol}"
    cp_losses = losses(cp)
    if compiled:
        a, b = (read_metrics(d) for d in (cp, train(f"cp{degree}_compiled", degree, *init, "--compile.enable")))
        pick = lambda recs: {(k, r["step"]): r[k] for r in recs for k in ("loss", "val_loss") if k in r}  # noqa: E731
        a, b = pick(a), pick(b)
        assert sorted(a) == sorted(b), f"compiled CP logged {sorted(b)}, eager CP {sorted(a)}"
        diffs["compiled"] = max(abs(a[s] - b[s]) for s in a)
        assert diffs["compiled"] <= tol, f"compiled CP {b} vs eager CP {a}: differ by {diffs['compiled']:.2e} > {tol}"
    if resume:
        resumed = workdir / "resumed"
        shutil.copytree(cp / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
        got = losses(train("resumed", 1))
        assert sorted(got) == [3, 4], f"the CP checkpoint resumed on one process logged steps {sorted(got)}"
        diffs["resume"] = max(abs(got[s] - cp_losses[s]) for s in got)
        assert diffs["resume"] <= tol, \
            f"resumed on one process {got} vs CP = {degree} {cp_losses}: differ by {diffs['resume']:.2e} > {tol}"
    return diffs
