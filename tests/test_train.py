"""End-to-end runs through torchtitan's trainer on the CPU: resume, FSDP over gloo, config errors, plots."""

import subprocess
import sys

import pytest
import torch

from tests.utils import REPO, losses, read_metrics, run_train, tiny_args


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """6 steps with a checkpoint at step 3."""
    dump = tmp_path_factory.mktemp("straight")
    out = run_train(tiny_args(corpus, dump, 6, 16, 2, "--checkpoint.interval", "3"))
    (dump / "train.log").write_text(out.stdout + out.stderr)
    return dump


def test_loss_falls_and_metrics_logged(straight):
    recs = read_metrics(straight)
    train = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for key in ("ppl", "grad_norm", "tps", "mfu", "memory_gib", "elapsed_s", "eta_s",
                # torchtitan's own timing and memory keys
                "time_metrics/end_to_end(s)", "time_metrics/data_loading(s)", "time_metrics/data_loading(%)",
                "memory/max_active(GiB)", "memory/max_reserved(GiB)", "memory/num_alloc_retries", "memory/num_ooms"):
        assert key in train[0], key
    assert any(k.startswith("wd/") for k in train[0])
    # no MFU on a CPU (torchtitan's fallback peak is an A100's); on a GPU, against its own peak
    assert (train[0]["mfu"] is None) == (not torch.cuda.is_available())
    # the lr logged is the one the step used (torchtitan's "lr" is read before the step; the scheduler moves on
    # before logging): the last step's is not the next step's 0
    for r in train:
        group_lr = [v for k, v in r.items() if k.startswith("lr/")]
        assert group_lr and group_lr[0] == r["lr"], r
    assert train[-1]["lr"] > 0
    log = (straight / "train.log").read_text()
    assert "step     6/6" in log and "elapsed 0:00:" in log and "eta 0:00:00" in log
    assert "does not exist" not in log
    val = [r for r in recs if "val_ppl" in r]
    assert val and val[-1]["step"] == 6  # validation at the last step


def test_resume_is_bit_exact(corpus, straight, tmp_path):
    args = tiny_args(corpus, tmp_path, 6, 16, 2, "--checkpoint.interval", "3", "--training.stop_after_step", "3")
    run_train(args)
    assert sorted(losses(tmp_path)) == [1, 2, 3]
    resumed_args = tiny_args(corpus, tmp_path, 6, 16, 2, "--checkpoint.interval", "3")
    run_train(resumed_args)
    a, b = losses(straight), losses(tmp_path)
    assert [b[s] for s in (4, 5, 6)] == [a[s] for s in (4, 5, 6)]
    assert [b[s] for s in (1, 2, 3)] == [a[s] for s in (1, 2, 3)]


@pytest.mark.slow  # CI time: 20-30 s on 2 cores
def test_fsdp_two_process_gloo_matches_one_process(corpus, tmp_path):
    # Sharded initialisation draws different random numbers than unsharded, so both runs start from one seed
    # checkpoint (torchtitan's recipe); the data loader's interleaved shards give both the same global batch.
    seed = tmp_path / "seed"
    run_train(tiny_args(corpus, seed, 1, 16, 4, "--checkpoint.create_seed_checkpoint"))
    init = ["--validation.no-enable", "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0")]
    one = tmp_path / "one"
    run_train(tiny_args(corpus, one, 3, 16, 4, *init))
    two = tmp_path / "two"
    run_train(tiny_args(corpus, two, 3, 16, 2, *init), nproc=2)
    a, b = losses(one), losses(two)
    assert sorted(b) == [1, 2, 3]
    for s in (1, 2, 3):
        assert abs(a[s] - b[s]) <= 1e-5, (s, a[s], b[s])


@pytest.fixture(scope="module")
def logits_loss(corpus, tmp_path_factory):
    """(the seed checkpoint's flags, the run): 3 steps of 4 rows of 16 tokens on one process with torchtitan's loss
    of the logits, from a seed checkpoint."""
    root = tmp_path_factory.mktemp("logits_loss")
    run_train(tiny_args(corpus, root / "seed", 1, 16, 4, "--checkpoint.create_seed_checkpoint"))
    init = ["--checkpoint.initial_load_path", str(root / "seed" / "checkpoint" / "step-0")]
    run_train(tiny_args(corpus, root / "run", 3, 16, 4, *init))
    return init, root / "run"


@pytest.mark.parametrize("nproc,extra", [
    # 2 micro-batches of 2 rows: gradient accumulation
    pytest.param(1, ["--training.global_batch_size", "4"], id="accumulated"),
    pytest.param(2, ["--parallelism.fsdp_reshard_after_forward", "default"], id="fsdp-default"),
    pytest.param(2, ["--parallelism.fsdp_reshard_after_forward", "always"], id="fsdp-always"),
    # the blocks compiled, the head and loss eager; a cold compile takes half a minute on 2 cores
    pytest.param(1, ["--training.global_batch_size", "4", "--compile.enable"], id="compiled", marks=pytest.mark.slow),
])
def test_the_chunked_loss_trains_as_the_logits_loss(logits_loss, corpus, tmp_path, nproc, extra):
    """``training.loss_chunk_tokens = 5`` (each rank's 32 tokens a micro-batch in chunks of 5, the last of 2) against
    the logits' loss from the same seed: with gradient accumulation on one process (the validation loss, from the
    logits, too), under FSDP on 2 gloo processes with the head's group kept or resharded after the forward, and
    (-m slow) with compile on."""
    init, want = logits_loss
    run_train(tiny_args(corpus, tmp_path, 3, 16, 2, *init, "--training.loss_chunk_tokens", "5", *extra), nproc=nproc)
    a, b = losses(want), losses(tmp_path)
    assert sorted(b) == [1, 2, 3]
    for s in (1, 2, 3):
        assert abs(a[s] - b[s]) <= 1e-5, (s, a[s], b[s])
    if nproc == 1:  # two ranks validate on other rows
        val_a, val_b = ([r["val_loss"] for r in read_metrics(d) if "val_loss" in r] for d in (want, tmp_path))
        assert val_a and len(val_a) == len(val_b) and all(abs(x - y) <= 1e-5 for x, y in zip(val_a, val_b))


@pytest.mark.parametrize("extra,message", [
    (["--model.attention", "nope"], "model.attention='nope' is not registered; choose from"),
    (["--model.layer_pattern", "softmax,nope"], r"model.layer_pattern\[1\]='nope' is not registered"),
    (["--model.flavor", "2B"], "model.flavor='2B' is not defined"),
    (["--model.attn_mask_type", "full"], "model.attn_mask_type='full'"),
    (["--parallelism.tensor_parallel_degree", "2"], "parallelism.tensor_parallel_degree=2"),
    (["--training.dataset_path", "/nonexistent/*.jsonl"], "training.dataset_path='/nonexistent/\\*.jsonl'"),
    (["--model.hf_assets_path", "/tmp"], "model.hf_assets_path='/tmp': no tokenizer.json"),
])
def test_bad_config_fails_before_training(corpus, tmp_path, extra, message):
    with pytest.raises(AssertionError, match=message):
        run_train(tiny_args(corpus, tmp_path, 2, 16, 2, *extra))
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.parametrize("extra,message", [
    (["--training.steps", "-3"], "training.steps=-3: must be > 0"),
    (["--attention.impl", "fla"], "attention.impl='fla' is not valid for softmax"),
    (["--model.attention", "gdn", "--attention.impl", "fla"], "attention.impl='fla': fla-core cannot run here"),
    (["--lr_scheduler.warmup_steps", "5"], "lr_scheduler.warmup_steps=5 is longer than the run"),
    (["--optimizer.name", "sgd"], "optimizer.name='sgd' is not registered; choose from ['adam', 'adamw', 'muon']"),
    (["--model.n_heads", "6", "--model.n_kv_heads", "4"], "model.n_heads=6 is not a multiple of model.n_kv_heads=4"),
    (["--model.vocab_size", "8"], "tokens, more than the model's 8 embedding rows; set model.vocab_size"),
    (["--training.loss_chunk_tokens", "-4"], "training.loss_chunk_tokens=-4: must be >= 0"),
    (["--training.loss_chunk_tokens", "8", "--model.converters", "quantize.linear.float8"],
     "training.loss_chunk_tokens=8 with model.converters 'quantize.linear.float8'"),
])
def test_config_error_is_one_line_before_anything_is_written(corpus, tmp_path, extra, message):
    """No traceback and no trainer start (torchtitan's start writes comm_traces/ into the dump folder)."""
    if "fla-core" in message and torch.cuda.is_available():
        pytest.skip("fla may run on this machine")
    dump = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *tiny_args(corpus, dump, 2, 16, 2, *extra)],
                          capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"train.py: error: {proc.stderr.split('error: ', 1)[1].strip()}"]
    assert message in proc.stderr
    assert not dump.exists()


def test_unknown_toml_key_is_named(corpus, tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text((REPO / "attnlab" / "configs" / "debug_cpu.toml").read_text().replace("[attention]\n", "[attention]\nrope_on_ro = true\n"))
    args = tiny_args(corpus, tmp_path, 2)
    args[1] = str(cfg)
    with pytest.raises(AssertionError, match=r"unknown config key 'rope_on_ro' in \[attention\]"):
        run_train(args)


def test_heads_must_divide():
    from attnlab.attention import build_attention
    from attnlab.attention.base import AttentionArgs

    with pytest.raises(ValueError, match="n_heads=6 must be a multiple of model.n_kv_heads=4"):
        build_attention("softmax", AttentionArgs(dim=32, n_heads=6, n_kv_heads=4, head_dim=8))


def test_corrupt_checkpoint_fails_clearly(corpus, straight, tmp_path):
    import shutil

    dump = tmp_path / "run"
    shutil.copytree(straight / "checkpoint", dump / "checkpoint")
    for f in (dump / "checkpoint" / "step-6").iterdir():
        if f.suffix == ".distcp":
            f.write_bytes(b"garbage")
    with pytest.raises(AssertionError, match=r"train.py: error: .*step-6/__0_0\.distcp \(item .*\): corrupt or "
                                             r"truncated"):
        run_train(tiny_args(corpus, dump, 8))


def test_list_attention():
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--list-attention"], capture_output=True,
                         text=True, check=True, cwd=str(REPO)).stdout
    assert "softmax" in out and "parallax" in out


def test_plot_ppl_from_two_runs(straight, corpus, tmp_path):
    other = tmp_path / "parallax"
    run_train(tiny_args(corpus, other, 3, 16, 2, "--model.attention", "parallax"))
    png = tmp_path / "ppl.png"
    subprocess.run([sys.executable, "-m", "attnlab.tools.plot_ppl", str(straight), str(other), "-o", str(png)],
                   check=True, cwd=str(REPO))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.slow  # CI time: 20-30 s on 2 cores
def test_hybrid_stack_trains_and_resumes_exactly(corpus, tmp_path):
    """A gdn/parallax hybrid (Qwen3-Next style pattern) trains and resumes bit-exactly like softmax does."""
    hybrid = ["--model.layer_pattern", "gdn,gdn,gdn,parallax", "--checkpoint.interval", "2", "--validation.no-enable"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(tiny_args(corpus, straight, 4, 16, 2, *hybrid))
    run_train(tiny_args(corpus, resumed, 4, 16, 2, *hybrid, "--training.stop_after_step", "2"))
    run_train(tiny_args(corpus, resumed, 4, 16, 2, *hybrid))
    a, b = losses(straight), losses(resumed)
    assert a[4] < a[1] and [b[s] for s in (3, 4)] == [a[s] for s in (3, 4)]


# ----------------------------------------------------------------------------------- safety (docs/failures.md)

def _copy_run(straight, dump):
    import shutil

    shutil.copytree(straight / "checkpoint", dump / "checkpoint")
    shutil.copy(straight / "config.toml", dump / "config.toml")
    return dump


def _steps(dump):
    return sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").glob("step-*"))


def _assert_finite_checkpoint(step_dir):
    import torch

    from attnlab.checkpoint.dcp import load_dcp_state

    sd = load_dcp_state(step_dir)
    assert sd and all(bool(torch.isfinite(v).all()) for v in sd.values() if v.is_floating_point()), step_dir


def _json_strict(dump):
    import json

    def no_nan(c):
        raise AssertionError(f"bare {c} in metrics.jsonl")

    return [json.loads(line, parse_constant=no_nan) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_nonfinite_loss_stops_and_keeps_the_last_finite_checkpoint(corpus, straight, tmp_path):
    """The issue's case: a good run resumed with lr 1e6 goes NaN; the run must fail, write nothing non-finite,
    and rotation (keep_latest_k = 2) must keep finite checkpoints only."""
    dump = _copy_run(straight, tmp_path / "run")
    # the loss guard (at a log step) or the weight check before a save, whichever sees it first
    with pytest.raises(AssertionError, match=r"non-finite .*(training stopped at step \d+ without saving|no checkpoint "
                                             r"written)[.;] The newest checkpoint, .*step-\d+, is finite and kept"):
        run_train(tiny_args(corpus, dump, 30, 16, 2, "--optimizer.lr", "1e6", "--checkpoint.interval", "2",
                            "--metrics.log_freq", "5"))
    steps = _steps(dump)
    assert len(steps) == 2 and steps[-1] >= 6, steps
    for s in steps:
        _assert_finite_checkpoint(dump / "checkpoint" / f"step-{s}")
    _json_strict(dump)


def test_nonfinite_steps_can_be_skipped_up_to_a_limit(corpus, straight, tmp_path):
    dump = _copy_run(straight, tmp_path / "run")
    with pytest.raises(AssertionError, match=r"the 3-th such step \(training.nonfinite_skips = 2\)") as err:
        run_train(tiny_args(corpus, dump, 40, 16, 2, "--optimizer.lr", "1e6", "--training.nonfinite_skips", "2",
                            "--checkpoint.interval", "2"))
    assert "optimizer step skipped (1/2 allowed" in str(err.value)
    for s in _steps(dump):
        _assert_finite_checkpoint(dump / "checkpoint" / f"step-{s}")
    recs = [r for r in _json_strict(dump) if "loss" in r]
    # the skipped steps' non-finite loss or gradient norm is logged as null, not as a bare NaN
    assert any(r["loss"] is None or r["grad_norm"] is None for r in recs)


def test_corrupt_shard_with_nan_bytes_fails_on_resume_naming_the_step(corpus, straight, tmp_path):
    dump = _copy_run(straight, tmp_path / "run")
    shard = next((dump / "checkpoint" / "step-6").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = b"\xff" * 4096  # same size; float32 0xFFFFFFFF is NaN
    shard.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match=r"checkpoint .*step-6.* \(step 6\) is corrupt: non-finite values in"):
        run_train(tiny_args(corpus, dump, 8))
    assert _steps(dump) == [3, 6]  # nothing written, nothing rotated away


@pytest.mark.parametrize("extra,message", [
    (["--model.attention", "parallax"], r"missing from the checkpoint \['layers.0.attention.r_norm.weight'"),
    (["--attention.softmax.no-qk-norm"], r"not in the model \['layers.0.attention.k_norm.weight'"),
    (["--model.attn_mask_type", "causal"],
     r"fields changed \(checkpoint's, this run's\): \{'attn_mask_type': \('block_causal', 'causal'\)\}"),
    (["--attention.softmax.window_size", "4"], r"\{'attention_options.softmax.window_size': \(0, 4\)\}"),
])
def test_resume_into_a_different_architecture_is_an_error(corpus, straight, tmp_path, extra, message):
    """Same keys with another meaning (the mask type) are refused too; the run's config.toml keeps describing
    the checkpoints."""
    dump = _copy_run(straight, tmp_path / "run")
    before = (dump / "config.toml").read_text()
    with pytest.raises(AssertionError, match=message + r".*checkpoint.partial_load"):
        run_train(tiny_args(corpus, dump, 8, 16, 2, *extra))
    assert _steps(dump) == [3, 6]
    assert (dump / "config.toml").read_text() == before


def test_partial_load_on_purpose_and_lr_jump_warning(corpus, straight, tmp_path):
    """``checkpoint.partial_load`` resumes a softmax checkpoint as Parallax (W_R keeps its init); extending the
    finished 6-step run to 8 steps warns that the decayed lr jumps back."""
    dump = _copy_run(straight, tmp_path / "run")
    out = run_train(tiny_args(corpus, dump, 8, 16, 2, "--model.attention", "parallax", "--checkpoint.partial_load"))
    log = out.stdout + out.stderr
    assert "checkpoint.partial_load = true: loading the common keys" in log
    assert "different learning-rate schedule" in log and "(training.steps = 6)" in log
    assert sorted(losses(dump)) == [7, 8]
    # the first resumed step runs at the new schedule's lr, the one logged (the optimizer state's groups held the
    # old schedule's 0 after its last step, and step 7 used to run at it while "lr" said otherwise)
    step7 = next(r for r in read_metrics(dump) if r.get("step") == 7 and "loss" in r)
    group_lrs = {v for k, v in step7.items() if k.startswith("lr/")}
    assert group_lrs == {step7["lr"]} and step7["lr"] > 0


def test_second_run_into_a_live_folder_fails_and_stale_lock_is_taken(corpus, tmp_path):
    import os
    import socket

    from attnlab.trainer.run_guard import RunLock

    dump = tmp_path / "run"
    held = RunLock(str(dump))  # this (live) process holds the folder
    try:
        with pytest.raises(AssertionError, match=rf"job.dump_folder '{dump}' is in use by another run \(process "
                                                 rf"{os.getpid()} on host"):
            run_train(tiny_args(corpus, dump, 1))
    finally:
        held.release()
    assert sorted(p.name for p in dump.iterdir()) == []  # the second run wrote nothing into the held folder
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (dump / RunLock.NAME).write_text(f"{socket.gethostname()} {dead.pid}")
    out = run_train(tiny_args(corpus, dump, 1, 16, 2, "--validation.no-enable"))
    assert f"Taking over the stale lock {dump / RunLock.NAME} of process {dead.pid}" in out.stdout + out.stderr
    assert not (dump / RunLock.NAME).exists()  # released at the end


def test_one_document_dataset_fails_fast(corpus, tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(open(corpus["train"]).readline())
    args = tiny_args(corpus, tmp_path / "run", 2)
    i = args.index("--validation.dataset_path")
    del args[i:i + 2]  # the validation split is held out of the training file
    args[args.index("--training.dataset_path") + 1] = str(one)
    with pytest.raises(AssertionError, match=r"training.dataset_path=.*one.jsonl.*the train split is empty after "
                                             r"holding out every data.val_every=100-th document"):
        run_train(args, timeout=120)


def test_validation_on_two_processes_with_uneven_shards(corpus, tmp_path):
    """5 validation documents (one row each) over 2 ranks: 3 and 2 batches of one row; every rank must run the
    same number of validation batches (gloo aborted on the mismatch, NCCL hung)."""
    val = tmp_path / "val5.jsonl"
    val.write_text("".join(open(corpus["val"]).readlines()[:5]))
    dump = tmp_path / "run"
    run_train(tiny_args(corpus, dump, 2, 16, 2, "--validation.dataset_path", str(val), "--validation.steps", "-1",
                        "--validation.local_batch_size", "1", "--validation.freq", "1", "--checkpoint.no-enable"),
              nproc=2, timeout=240)
    assert [r["step"] for r in read_metrics(dump) if "val_loss" in r] == [1, 2]


def test_unwritable_checkpoint_folder_fails_at_start(corpus, tmp_path):
    with pytest.raises(AssertionError, match=r"checkpoint.folder: cannot write checkpoints to '/proc/attnlab-ckpt'"):
        run_train(tiny_args(corpus, tmp_path / "run", 2, 16, 2, "--checkpoint.folder", "/proc/attnlab-ckpt"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


def test_full_disk_during_a_save_says_so_and_keeps_earlier_checkpoints(corpus, straight, tmp_path):
    """A file-size limit below one checkpoint shard makes the save's writes fail as on a full disk."""
    import resource

    dump = _copy_run(straight, tmp_path / "run")
    size = max(f.stat().st_size for f in (dump / "checkpoint" / "step-6").iterdir())
    limit = size // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    with pytest.raises(AssertionError, match=r"the disk is full \(or a quota / file-size limit was hit\) while saving "
                                             r".*step-7.*earlier checkpoints are intact"):
        run_train(tiny_args(corpus, dump, 8, 16, 2, "--checkpoint.interval", "1"), preexec_fn=small_files)
    assert _steps(dump) == [3, 6]
    _assert_finite_checkpoint(dump / "checkpoint" / "step-6")


def test_keep_latest_k_keeps_exactly_k_and_converter_keeps_the_mask_type(corpus, tmp_path):
    import json

    dump = tmp_path / "run"
    run_train(tiny_args(corpus, dump, 5, 16, 2, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2",
                        "--validation.no-enable"))
    assert _steps(dump) == [4, 5]
    src = dump / "checkpoint" / "step-5"
    assert json.loads((src / "attnlab.json").read_text())["attn_mask_type"] == "block_causal"
    dst = tmp_path / "converted"
    subprocess.run([sys.executable, "-m", "attnlab.tools.convert_to_parallax", str(src), str(dst),
                    "--no-progress"], check=True, cwd=str(REPO), capture_output=True)
    assert json.loads((dst / "attnlab.json").read_text())["attn_mask_type"] == "block_causal"


def test_free_space_is_checked_at_start(tmp_path, monkeypatch, caplog):
    import shutil
    from types import SimpleNamespace

    from attnlab.trainer.run_guard import check_free_space

    mib = 2**20
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(free=10 * mib, total=100 * mib, used=0))
    with pytest.raises(ValueError, match=r"checkpoint.folder '.*ck': 0.01 GiB free, one checkpoint needs about 0.02"):
        check_free_space(str(tmp_path / "ck"), 20 * mib, 2)
    check_free_space(str(tmp_path / "ck"), 4 * mib, 2)
    assert "may not hold checkpoint.keep_latest_k=2 checkpoints" in caplog.text


def test_architecture_changes_ignore_init_only_options():
    """The resume guard's comparison of two architecture records (``attnlab.json``): options that only set initial
    weights (W_R, ρ's RMSNorm gain, the gate's bias) and runtime fields may differ; the mask type and mechanism
    options that change the function may not; a key the checkpoint's record lacks is ignored."""
    import dataclasses
    import json

    from attnlab.attention.parallax import ParallaxOptions
    from attnlab.models.args import ModelArgs
    from attnlab.checkpoint.dcp import args_to_dict
    from attnlab.checkpoint.dcp import INIT_ONLY_FIELDS, architecture_changes

    def record(mask="block_causal", **opts):
        args = ModelArgs(attention="parallax", attn_mask_type=mask,
                         attention_options={"parallax": dataclasses.replace(ParallaxOptions(rho_gate=True), **opts)})
        return json.loads(json.dumps(args_to_dict(args)))  # as the trainer writes and reads it

    old = record(rho_norm_init=1.0, wr_init="zero", rho_gate_bias=2.0)
    assert set(INIT_ONLY_FIELDS) == {"depth_init", "attention_options.fox.forget_bias_init",
                                     *(f"attention_options.parallax.{o}" for o in ParallaxOptions.INIT_ONLY)}
    assert architecture_changes({**old, "depth_init": True}, {**record(), "depth_init": False}) == {}
    assert architecture_changes(old, record()) == {}
    assert architecture_changes(old, {**record(), "max_seq_len": 8192, "attn_impl": "reference"}) == {}
    assert architecture_changes(record(), record(window_size=4)) == {"attention_options.parallax.window_size": (0, 4)}
    assert architecture_changes(record(), record(mask="causal")) == {"attn_mask_type": ("block_causal", "causal")}
    # an init-only field changed together with a real one: only the real one is reported
    assert architecture_changes(old, record(rope_on_rho=False)) == {
        "attention_options.parallax.rope_on_rho": (True, False)}
    # a record written before an option existed resumes with the option's current value
    older = record()
    del older["attention_options"]["parallax"]["window_size"], older["attn_mask_type"]
    assert architecture_changes(older, record(window_size=4, mask="causal")) == {}
