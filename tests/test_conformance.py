"""The conformance matrix: every registered mechanism, and every layer pattern a shipped config uses, goes through
the same lifecycle at the debug size. A mechanism added to the registry (or a pattern added to a config) is added
here with no test edits.

Default suite, one row each (two gloo processes):
  - ``train.py`` on 2 processes: built on the meta device, ``init_weights`` on FSDP-sharded (DTensor) parameters,
    3 Muon steps, validation on both ranks at steps 1, 2 and 3, a checkpoint of the sharded state;
  - that checkpoint, read back offline as a tool reads it, exported to a Hugging Face folder and imported again
    (same logits), and decoded with the layers' caches (same logits as the full forward).
Slow (``-m slow``), per row and optimizer (Muon, AdamW): ``attnlab.tools.multigpu_check`` on 1 and 2 processes from one
seed checkpoint (loss parity at the same global batch) and the resumes 2 -> 1 and 1 -> 2 (losses continue as the
uninterrupted runs'), within its float32 tolerance.
"""

from __future__ import annotations

import math

import pytest
import tomli
import torch

from attnlab import attention
from attnlab.models.decode import generate
from attnlab.checkpoint.dcp import build_model
from attnlab.checkpoint.hf import save_hf
from attnlab.checkpoint.load import load_checkpoint, load_tool_checkpoint
from attnlab.checkpoint.layout import resolve
from attnlab.tools import multigpu_check
from tests.utils import REPO, losses, read_metrics, run_train, tiny_args


def shipped_patterns() -> list[tuple[str, ...]]:
    """The mixed layer patterns (more than one mechanism) of every TOML under ``attnlab/configs/``."""
    found = set()
    for f in sorted((REPO / "attnlab" / "configs").rglob("*.toml")):
        pattern = tomli.loads(f.read_text()).get("model", {}).get("layer_pattern") or []
        if len(set(pattern)) > 1:
            found.add(tuple(pattern))
    return sorted(found)


def _flags(pattern: tuple[str, ...]) -> list[str]:
    if len(pattern) == 1:
        return ["--model.attention", pattern[0]]
    return ["--model.layer_pattern", ",".join(pattern), "--model.n_layers", str(max(4, len(pattern)))]


def _mechanisms(model) -> list[str]:
    return [layer.attention.mechanism for layer in model.layers.values()]


ROWS = [pytest.param((m,), id=m) for m in sorted(attention.REGISTRY)] + [
    pytest.param(p, id="+".join(p)) for p in shipped_patterns()]


def test_matrix_covers_the_registry_and_the_shipped_hybrid():
    ids = {p.id for p in ROWS}
    assert set(attention.REGISTRY) <= ids
    assert "gdn+gdn+gdn+parallax" in ids  # attnlab/configs/paper/qwen3_0.6b_hybrid_gdn_parallax.toml


@pytest.mark.parametrize("pattern", ROWS)
def test_two_processes_from_meta_then_export_and_decode(pattern, corpus, tmp_path):
    check_lifecycle(pattern, corpus, tmp_path)


def check_lifecycle(pattern: tuple[str, ...], corpus, tmp_path, module: str | None = None) -> None:
    """One row of the matrix. ``module``: what the training processes run instead of ``train.py``
    (``python -m module``), for a mechanism a test registers (tests/attention/test_adding_a_mechanism.py)."""
    dump = tmp_path / "run"
    run_train(tiny_args(corpus, dump, 3, 16, 2, *_flags(pattern), "--optimizer.name", "muon",
                        "--optimizer.muon_ns_dtype", "float32", "--validation.freq", "2",
                        "--checkpoint.interval", "3"), nproc=2, module=module)
    recs = read_metrics(dump)
    train = losses(dump)
    assert sorted(train) == [1, 2, 3] and all(math.isfinite(v) for v in train.values()), train
    assert [r["step"] for r in recs if "val_loss" in r] == [1, 2, 3]  # step 1, every 2nd, the last
    assert all(math.isfinite(r["val_loss"]) for r in recs if "val_loss" in r)

    # the sharded checkpoint, as the export and generate tools read it (run folder -> config.toml -> model)
    ckpt = resolve(dump)
    fmt, args, sd, _ = load_tool_checkpoint(ckpt)
    assert (fmt, ckpt.step) == ("dcp", 3)
    model = build_model(args, sd).eval()
    assert _mechanisms(model) == [pattern[i % len(pattern)] for i in range(len(model.layers))]
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
    assert torch.isfinite(ref).all()

    save_hf(model.state_dict(), model.model_args, tmp_path / "hf")
    fmt, args, sd = load_checkpoint(tmp_path / "hf")
    imported = build_model(args, sd)
    assert fmt == "hf" and _mechanisms(imported) == _mechanisms(model)
    with torch.no_grad():
        torch.testing.assert_close(imported(tokens), ref, rtol=0, atol=0)

    res = generate(model, tokens[:, :6], 3, greedy=True, keep_logits=True)
    with torch.no_grad():
        full = model(res.tokens[:, :-1])[:, 5:]
    for i, step_logits in enumerate(res.step_logits):
        torch.testing.assert_close(step_logits, full[:, i], rtol=2e-4, atol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
@pytest.mark.parametrize("pattern", ROWS)
def test_one_vs_two_processes_and_resumes_both_ways(pattern, optimizer, tmp_path, capsys):
    rc = multigpu_check.main(["--device", "cpu", "--nprocs", "1,2", "--resume", "2:1,1:2", "--steps", "4",
                              "--attention", pattern[0], "--optimizer", optimizer, "--out", str(tmp_path),
                              "--", *_flags(pattern)])
    out = capsys.readouterr().out
    assert rc == 0 and "5/5 passed" in out, out
