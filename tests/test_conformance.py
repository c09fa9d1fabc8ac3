"""The conformance matrix: every registered mechanism, and every layer pattern a shipped config uses, goes through
the same lifecycle at the debug size. A mechanism added to the registry (or a pattern added to a config) is added
here with no test edits.

Default suite: :func:`attnlab.testing.conformance.check_lifecycle` without its resume leg (two gloo processes from a
meta build under FSDP, Muon steps, validation, a checkpoint; the checkpoint read back as the tools read it, HF export
and import, decoding with the layers' caches) for one model whose layers are every registered mechanism in turn (one
launch instead of one per mechanism, about a tenth of the time on 2 cores) and for each shipped hybrid pattern. The
whole cell, resume included, runs in the default suite for a mechanism from outside the package
(tests/attention/test_adding_a_mechanism.py).
Slow (``-m slow``): the same cell per mechanism, so a failure names its mechanism; per row and optimizer (Muon,
AdamW), ``attnlab.tools.multigpu_check`` on 1 and 2 processes from one seed checkpoint (loss parity at the same global
batch) and the resumes 2 -> 1 and 1 -> 2 (losses continue as the uninterrupted runs'), within its float32 tolerance.

The context-parallel column: :func:`attnlab.testing.conformance.check_context_parallel`, CP = 2 on 2 gloo processes
against one process on rows whose documents cross the chunks, training and validation losses. Default suite: the
every-mechanism model (within 5e-4: its 17 float32 layers accumulate 1.6e-4 of summation-order differences; every
mechanism's CP path is exact in float64 in tests/attention/test_context_parallel_modules.py). Slow: each mechanism
alone within 1e-4, the resume of its CP checkpoint on one process and, where the mechanism declares it compiles under
CP, its compiled CP run against the eager one.
"""

from __future__ import annotations

import pytest
import tomli

from attnlab import attention
from attnlab.testing.conformance import check_context_parallel, check_lifecycle, cp_corpus, pattern_flags
from attnlab.tools import multigpu_check
from tests.utils import REPO


def shipped_patterns() -> list[tuple[str, ...]]:
    """The mixed layer patterns (more than one mechanism) of every TOML under ``attnlab/configs/``."""
    found = set()
    for f in sorted((REPO / "attnlab" / "configs").rglob("*.toml")):
        pattern = tomli.loads(f.read_text()).get("model", {}).get("layer_pattern") or []
        if len(set(pattern)) > 1:
            found.add(tuple(pattern))
    return sorted(found)


EVERY_MECHANISM = tuple(sorted(attention.REGISTRY))
"""One layer of each registered mechanism, in name order: the default suite's row."""

ROWS = [pytest.param(EVERY_MECHANISM, id="every-mechanism")] + [
    pytest.param(p, id="+".join(p)) for p in shipped_patterns()] + [
    pytest.param((m,), id=m, marks=pytest.mark.slow) for m in sorted(attention.REGISTRY)]


def test_matrix_covers_the_registry_and_the_shipped_hybrid():
    ids = {p.id for p in ROWS}
    assert set(attention.REGISTRY) <= ids and set(EVERY_MECHANISM) == set(attention.REGISTRY)
    assert "gdn+gdn+gdn+parallax" in ids  # attnlab/configs/paper/qwen3_0.6b_hybrid_gdn_parallax.toml


@pytest.mark.parametrize("pattern", ROWS)
def test_two_processes_from_meta_then_export_and_decode(pattern, corpus, tmp_path):
    check_lifecycle(pattern, tmp_path, corpus=corpus, resume=False)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
@pytest.mark.parametrize("pattern", [p for p in ROWS if p.id != "every-mechanism"])
def test_one_vs_two_processes_and_resumes_both_ways(pattern, optimizer, tmp_path, capsys):
    rc = multigpu_check.main(["--device", "cpu", "--nprocs", "1,2", "--resume", "2:1,1:2", "--steps", "4",
                              "--attention", pattern[0], "--optimizer", optimizer, "--out", str(tmp_path),
                              "--", *pattern_flags(pattern)])
    out = capsys.readouterr().out
    assert rc == 0 and "5/5 passed" in out, out


@pytest.fixture(scope="module")
def cp_rows_corpus(tmp_path_factory):
    return cp_corpus(tmp_path_factory.mktemp("cp_corpus"))


def test_context_parallel_of_every_mechanism_trains_and_validates_as_one_process(cp_rows_corpus, tmp_path):
    check_context_parallel(EVERY_MECHANISM, tmp_path, corpus=cp_rows_corpus, resume=False, tol=5e-4)


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", sorted(attention.REGISTRY))
def test_context_parallel_trains_and_validates_as_one_process(mechanism, cp_rows_corpus, tmp_path):
    check_context_parallel(mechanism, tmp_path, corpus=cp_rows_corpus, resume=False)


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", sorted(attention.REGISTRY))
def test_context_parallel_checkpoint_resumes_on_one_process_and_compiles(mechanism, cp_rows_corpus, tmp_path):
    """The resume of the CP checkpoint on one process; compiled CP against eager CP where the mechanism declares that
    its CP path compiles (``context_parallel_compiles``; the configuration refuses the others)."""
    compiled = getattr(attention.REGISTRY[mechanism].cls, "context_parallel_compiles", False)
    check_context_parallel(mechanism, tmp_path, corpus=cp_rows_corpus, compiled=compiled)
