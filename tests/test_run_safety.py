"""Run-folder safety (docs/failures.md): step folders are trusted by their contents, not their names;
rotation and resume see exact ``step-N`` folders only; the checkpoint folder is locked; the user's config file and
a run's tokenizer are never replaced; a missing ``load_step`` is named; SIGTERM/SIGUSR1 save and exit cleanly."""

import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.utils import REPO, losses, read_metrics, run_train, tiny_args

NO_VAL = ("--validation.no-enable",)


@pytest.fixture(scope="module")
def run4(corpus, tmp_path_factory):
    """4 steps with checkpoints at steps 2 and 4, its config.toml and tokenizer/."""
    dump = tmp_path_factory.mktemp("run4")
    run_train(tiny_args(corpus, dump, 4, 16, 2, "--checkpoint.interval", "2", *NO_VAL))
    return dump


def _copy_run(src, dump):
    shutil.copytree(src / "checkpoint", dump / "checkpoint")
    shutil.copytree(src / "tokenizer", dump / "tokenizer")
    shutil.copy(src / "config.toml", dump / "config.toml")
    return dump


def _listing(dump):
    """Every file under the run's checkpoint folder with its size and modification time."""
    return {str(p.relative_to(dump)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted((dump / "checkpoint").rglob("*"))}


def _trained(dump):
    return (dump / "metrics.jsonl").is_file() and bool(read_metrics(dump))


def test_step_folder_holding_another_step_is_refused(corpus, run4, tmp_path):
    """A ``step-16`` copied in from elsewhere (it holds step 2) was resumed as the newest and retrained over step-4;
    now the load fails before training, naming the folder and both steps, and nothing changes."""
    dump = _copy_run(run4, tmp_path / "run")
    shutil.copytree(dump / "checkpoint" / "step-2", dump / "checkpoint" / "step-16")
    before = _listing(dump)
    with pytest.raises(AssertionError, match=r"checkpoint '.*step-16' holds step 2, not step 16: it was copied in or "
                                             r"renamed from another run\. Move it out of"):
        run_train(tiny_args(corpus, dump, 8, 16, 2, "--checkpoint.interval", "2", *NO_VAL))
    assert _listing(dump) == before
    assert not _trained(dump)


def test_rotation_and_resume_consider_exact_step_folders_only(corpus, run4, tmp_path):
    """User copies whose names contain ``step-N`` are neither deleted by ``keep_latest_k`` rotation nor resumed
    from (``step-99.bak`` made torchtitan look for a missing ``step-99``)."""
    dump = _copy_run(run4, tmp_path / "run")
    ck = dump / "checkpoint"
    for name in ("step-2.bak", "step-4 copy"):
        shutil.copytree(ck / "step-2", ck / name)
    rotate = ("--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2", *NO_VAL)
    run_train(tiny_args(corpus, dump, 8, 16, 2, *rotate))
    assert sorted(p.name for p in ck.iterdir()) == ["step-2.bak", "step-4 copy", "step-6", "step-8"]
    shutil.copytree(ck / "step-6", ck / "step-99.bak")
    out = run_train(tiny_args(corpus, dump, 10, 16, 2, *rotate))
    assert "Training starts at step 9" in out.stdout + out.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["step-10", "step-2.bak", "step-4 copy", "step-8", "step-99.bak"]
    assert sorted(losses(dump)) == list(range(5, 11))


def test_checkpoint_folder_outside_the_run_folder_is_locked(corpus, tmp_path):
    """Two runs with different dump folders and one absolute checkpoint.folder: the second fails at start; a lock of
    a process that is gone is taken over; the lock lies beside the checkpoint folder and is released at the end."""
    ck = tmp_path / "ckpts"
    lock = tmp_path / ".ckpts.attnlab.lock"
    lock.write_text(f"{socket.gethostname()} {os.getpid()}")  # this (live) process holds the checkpoint folder
    args = ("--checkpoint.folder", str(ck), *NO_VAL)
    with pytest.raises(AssertionError, match=rf"checkpoint.folder '{ck}' is in use by another run \(process "
                                             rf"{os.getpid()} on host .*lock file {lock}\)"):
        run_train(tiny_args(corpus, tmp_path / "b", 1, 16, 2, *args))
    assert not ck.exists() and not _trained(tmp_path / "b")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(f"{socket.gethostname()} {dead.pid}")
    out = run_train(tiny_args(corpus, tmp_path / "b", 1, 16, 2, *args))
    assert f"Taking over the stale lock {lock} of process {dead.pid}" in out.stdout + out.stderr
    assert (ck / "step-1" / ".metadata").is_file() and not lock.exists()


def test_config_file_in_the_run_folder_is_kept(corpus, tmp_path):
    """``--job.config_file RUN/config.toml --job.dump_folder RUN``: the user's commented file stays byte-identical
    (the tools read it), the resolved configuration goes beside it."""
    dump = tmp_path / "run"
    dump.mkdir()
    mine = dump / "config.toml"
    mine.write_bytes(b"# my notes\n" + (REPO / "attnlab" / "configs" / "debug_cpu.toml").read_bytes())
    before = mine.read_bytes()
    args = tiny_args(corpus, dump, 1, 16, 2, *NO_VAL)
    args[1] = str(mine)
    out = run_train(args)
    assert mine.read_bytes() == before
    log = out.stdout + out.stderr
    assert f"{mine} is this run's job.config_file and is kept as written; the resolved configuration" in log
    assert "steps = 1\n" in (dump / "config.resolved.toml").read_text()


def test_resume_with_another_tokenizer_is_refused(corpus, run4, tmp_path):
    """Same vocabulary size, two token ids swapped: the resume fails naming both tokenizer.json files, and the run's
    tokenizer/ and checkpoints are untouched."""
    dump = _copy_run(run4, tmp_path / "run")
    other = tmp_path / "other_tokenizer"
    shutil.copytree(corpus["tokenizer"], other, ignore=shutil.ignore_patterns("*.jsonl"))
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["w0"], vocab["w1"] = vocab["w1"], vocab["w0"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    stored = dump / "tokenizer" / "tokenizer.json"
    stored_bytes, before = stored.read_bytes(), _listing(dump)
    with pytest.raises(AssertionError, match=rf"model.hf_assets_path='{other}': its tokenizer.json differs from "
                                             rf"{stored}, the tokenizer the checkpoints in '.*checkpoint' were"):
        run_train(tiny_args(corpus, dump, 6, 16, 2, "--model.hf_assets_path", str(other), *NO_VAL))
    assert stored.read_bytes() == stored_bytes
    assert _listing(dump) == before and not _trained(dump)


def _refused(args) -> str:
    """The one line a run refused before the trainer started exits with (``train.main`` in this process: the refusals
    come from ``train.preflight``, which starts nothing), checked to be one line."""
    from attnlab.train import main

    env = dict(os.environ)
    try:
        with pytest.raises(SystemExit) as e:
            main(args)
    finally:  # main sets up a world of one process in the environment
        os.environ.clear()
        os.environ.update(env)
    line = str(e.value.code)
    assert line.startswith("train.py: error: ") and "\n" not in line, line
    return line


def test_missing_load_step_is_named_with_the_steps_that_exist(corpus, run4, tmp_path):
    dump = _copy_run(run4, tmp_path / "run")
    before = _listing(dump)
    line = _refused(tiny_args(corpus, dump, 8, 16, 2, "--checkpoint.load_step", "7", *NO_VAL))
    assert re.fullmatch(r"train.py: error: checkpoint.load_step=7: .*step-7 does not exist; the checkpoints in "
                        r"'.*checkpoint' are of steps \[2, 4\]\. Pick one of them, or -1 for the latest\.", line)
    assert _listing(dump) == before


def test_loading_an_older_step_is_refused_naming_the_later_steps_and_the_branch(corpus, run4, tmp_path):
    """``--checkpoint.load_step 2`` on a run with steps 2 and 4 trained on and overwrote step-4; now it is refused
    naming the later steps and how to branch the run."""
    dump = _copy_run(run4, tmp_path / "run")
    before = _listing(dump)
    line = _refused(tiny_args(corpus, dump, 4, 16, 2, "--checkpoint.load_step", "2", "--optimizer.lr", "1e-2", *NO_VAL))
    step2 = dump / "checkpoint" / "step-2"
    assert line == (f"train.py: error: checkpoint.load_step=2: '{dump / 'checkpoint'}' has later steps [4], which "
                    "training on from step 2 would overwrite; a run continues only from its newest step. To branch it "
                    f"from step 2, start a new run: --checkpoint.initial_load_path {step2} "
                    "--checkpoint.no-initial_load_model_only --job.dump_folder NEW_FOLDER (or add "
                    "--checkpoint.load_only to train without saving)")
    assert _listing(dump) == before


@pytest.mark.slow
def test_the_branch_the_load_step_refusal_names_continues_the_run_exactly(corpus, run4, tmp_path):
    """The branch of an older step (``checkpoint.initial_load_path`` of the full state in a new folder) trains the
    steps after it as the run did, and leaves the run's folder as it was."""
    dump = _copy_run(run4, tmp_path / "run")
    before = _listing(dump)
    step2 = dump / "checkpoint" / "step-2"
    branch = tmp_path / "branch"
    out = run_train(tiny_args(corpus, branch, 4, 16, 2, "--checkpoint.interval", "2", "--checkpoint.initial_load_path",
                              str(step2), "--checkpoint.no-initial_load_model_only", *NO_VAL))
    assert "Training starts at step 3" in out.stdout + out.stderr
    assert losses(branch) == {n: v for n, v in losses(run4).items() if n > 2}
    assert _listing(dump) == before


def test_a_run_replaces_or_appends_to_only_what_it_wrote(corpus, run4, tmp_path):
    """A user's config.toml in a fresh dump folder was replaced, an older metrics.jsonl appended to (steps 1..4,
    1..4); now a fresh run refuses both, naming the file; a run records what it wrote, and a resume refuses a
    config.toml edited since. The same command again in a folder a run wrote without checkpoints starts fresh and
    sets the earlier metrics aside."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.toml").write_text("# my notes\n")
    assert _refused(tiny_args(corpus, mine, 1, 16, 2, *NO_VAL)) == (
        f"train.py: error: job.dump_folder='{mine}' holds files this run would replace or append to but did not "
        f"write: {mine / 'config.toml'} (not written by a run in this folder, or changed since); this run starts fresh "
        "(no checkpoint of its own "
        "in checkpoint.folder to continue). Move them away, or choose another job.dump_folder.")
    assert (mine / "config.toml").read_text() == "# my notes\n"
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(run4 / "metrics.jsonl", old / "metrics.jsonl")
    line = _refused(tiny_args(corpus, old, 1, 16, 2, "--checkpoint.no-enable", *NO_VAL))
    assert f"{old / 'metrics.jsonl'} (an earlier run: steps 1 to 4)" in line
    assert (old / "metrics.jsonl").read_bytes() == (run4 / "metrics.jsonl").read_bytes()
    again = tmp_path / "again"
    for _ in range(2):
        run_train(tiny_args(corpus, again, 2, 16, 2, "--checkpoint.no-enable", *NO_VAL))
    assert [r["step"] for r in read_metrics(again)] == [1, 2]
    assert [json.loads(x)["step"] for x in (again / "metrics.prev-1.jsonl").read_text().splitlines()] == [1, 2]
    record = json.loads((run4 / ".attnlab-run.json").read_text())["files"]
    assert sorted(record) == ["config.toml", "metrics.jsonl", "tokenizer/tokenizer.json",
                              "tokenizer/tokenizer_config.json"] and record["metrics.jsonl"] is None
    dump = tmp_path / "run"
    shutil.copytree(run4, dump)
    edited = (dump / "config.toml").read_text().replace("rope_theta = ", "rope_theta = 5")
    (dump / "config.toml").write_text(edited)
    line = _refused(tiny_args(corpus, dump, 6, 16, 2, *NO_VAL))
    assert f"{dump / 'config.toml'} (changed since this run wrote it); this run resumes from its checkpoints" in line
    assert (dump / "config.toml").read_text() == edited


@pytest.mark.parametrize("case", ["dump folder is a file", "initial_load_path is a run folder",
                                  "initial_load_path is missing", "architecture changed on resume",
                                  "an HF export where the run may save"])
def test_run_folder_mistakes_are_one_line_before_the_trainer_starts(corpus, run4, tmp_path, case):
    """A FileExistsError traceback, 159 lines calling a good run corrupt, an error blaming the new checkpoint
    folder, a traceback after the trainer started: now one line naming the key or file, nothing written."""
    dump = tmp_path / "run"
    newest = run4 / "checkpoint" / "step-4"
    extra, message = {
        "dump folder is a file": ((), f"job.dump_folder='{dump}': must be non-empty and not a file"),
        "initial_load_path is a run folder": (
            ("--checkpoint.initial_load_path", str(run4)),
            f"checkpoint.initial_load_path='{run4}': a run folder, not a checkpoint; pass one of its step folders, "
            f"e.g. its newest: --checkpoint.initial_load_path {newest}"),
        "initial_load_path is missing": (
            ("--checkpoint.initial_load_path", str(tmp_path / "nope")),
            f"checkpoint.initial_load_path='{tmp_path / 'nope'}': no such folder"),
        "architecture changed on resume": (
            ("--model.attn_mask_type", "causal"),
            f"checkpoint '{dump / 'checkpoint' / 'step-4'}' does not match the model built from this config: "
            "architecture fields changed (checkpoint's, this run's): {'attn_mask_type': ('block_causal', 'causal')}"),
        "an HF export where the run may save": (
            (), f"checkpoint.folder: {dump / 'checkpoint' / 'step-5'} holds safetensors weights (a Hugging Face "
                "export?), not a checkpoint of this run, and this run (steps 5 to 6) may save step 5 there"),
    }[case]
    if case == "dump folder is a file":
        dump.write_text("")
    elif case == "architecture changed on resume":
        _copy_run(run4, dump)
    elif case == "an HF export where the run may save":
        _copy_run(run4, dump)
        (dump / "checkpoint" / "step-5").mkdir()
        (dump / "checkpoint" / "step-5" / "model.safetensors").write_bytes(b"weights")
    before = sorted(tmp_path.rglob("*"))
    assert message in _refused(tiny_args(corpus, dump, 6, 16, 2, *extra, *NO_VAL))
    assert sorted(tmp_path.rglob("*")) == before


def _crafted(step_dir, marker):
    class Marker:
        def __reduce__(self):
            return open, (str(marker), "w")

    (step_dir / ".metadata").write_bytes(pickle.dumps(Marker()))


def test_a_crafted_checkpoint_runs_nothing_on_resume_or_initial_load(corpus, run4, tmp_path):
    """A ``.metadata`` whose unpickling creates a file: refused naming it before anything is unpickled, for the
    resume of its run and as another run's ``checkpoint.initial_load_path``."""
    dump = _copy_run(run4, tmp_path / "run")
    marker = tmp_path / "marker"
    step4 = dump / "checkpoint" / "step-4"
    _crafted(step4, marker)
    refusal = f"{step4 / '.metadata'}: refused, it names io.open, which a checkpoint never holds"
    assert refusal in _refused(tiny_args(corpus, dump, 6, 16, 2, *NO_VAL))
    assert refusal in _refused(tiny_args(corpus, tmp_path / "new", 6, 16, 2, "--checkpoint.initial_load_path",
                                         str(step4), *NO_VAL))
    assert not marker.exists()


@pytest.mark.slow
def test_an_hf_export_in_the_checkpoint_folder_survives_rotation_and_resume(corpus, run4, tmp_path):
    """``export_hf RUN RUN/checkpoint/step-9`` then a resume: rotation counted the export as a checkpoint and deleted
    the real step-8. The export is neither resumed from nor rotated, and a run that may save step 9 refuses to
    write into it."""
    dump = _copy_run(run4, tmp_path / "run")
    export = dump / "checkpoint" / "step-9"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"weights")
    rotate = ("--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2", *NO_VAL)
    out = run_train(tiny_args(corpus, dump, 8, 16, 2, *rotate))
    assert "Training starts at step 5" in out.stdout + out.stderr
    assert sorted(p.name for p in export.parent.iterdir()) == ["step-6", "step-8", "step-9"]
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]
    line = _refused(tiny_args(corpus, dump, 10, 16, 2, *rotate))
    assert f"checkpoint.folder: {export} holds safetensors weights" in line and "may save step 9" in line
    assert (export / "model.safetensors").read_bytes() == b"weights"


# ------------------------------------------------------------------------------------------------ preemption

def _start(args, nproc=1):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0",
                                      "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]
    return subprocess.Popen([sys.executable, *launcher, str(REPO / "train.py"), *args], env=env, cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for_steps(proc, dump, n, timeout=120):
    end = time.monotonic() + timeout
    metrics = dump / "metrics.jsonl"
    while time.monotonic() < end and proc.poll() is None:
        lines = metrics.read_text().splitlines(keepends=True) if metrics.is_file() else []
        if sum('"loss"' in line for line in lines if line.endswith("\n")) >= n:  # complete records only
            return
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no {n} training steps logged:\n{proc.communicate()[0][-3000:]}")


def _finish(proc, timeout=60):
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigterm_saves_the_current_step_and_resume_continues(corpus, tmp_path):
    """SIGTERM killed the run at once (status 143, nothing saved); now it finishes the step, saves it, releases the
    lock, exits with 143, and a resume continues from the next step."""
    dump = tmp_path / "run"
    long_run = tiny_args(corpus, dump, 100000, 16, 2, *NO_VAL)
    proc = _start(long_run)
    _wait_for_steps(proc, dump, 2)
    proc.send_signal(signal.SIGTERM)
    log = _finish(proc)
    assert proc.returncode == 143, log[-3000:]
    last = max(losses(dump))
    assert f"received SIGTERM: saved step {last}, exiting" in log
    assert [p.name for p in (dump / "checkpoint").iterdir()] == [f"step-{last}"]
    assert (dump / "checkpoint" / f"step-{last}" / ".metadata").is_file() and not (dump / ".attnlab.lock").exists()
    out = run_train(tiny_args(corpus, dump, last + 2, 16, 2, *NO_VAL))
    assert f"Training starts at step {last + 1}" in out.stdout + out.stderr
    assert max(losses(dump)) == last + 2


def test_sigusr1_on_one_rank_stops_both_at_the_same_step(corpus, tmp_path):
    """2 gloo processes, SIGUSR1 to rank 1 only: the ranks agree on the step, save it together (both shards) and
    exit with 138 (torchrun then reports the failure)."""
    import psutil

    dump = tmp_path / "run"
    proc = _start(tiny_args(corpus, dump, 100000, 16, 2, *NO_VAL), nproc=2)
    _wait_for_steps(proc, dump, 2)
    rank1 = next(p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1")
    rank1.send_signal(signal.SIGUSR1)
    log = _finish(proc)
    assert proc.returncode != 0
    last = max(losses(dump))
    assert log.count(f"received SIGUSR1: saved step {last}, exiting") == 2, log[-3000:]
    assert "exitcode  : 138" in log
    step = dump / "checkpoint" / f"step-{last}"
    assert (step / ".metadata").is_file() and sorted(p.name for p in step.glob("*.distcp")) == ["__0_0.distcp",
                                                                                              "__1_0.distcp"]
