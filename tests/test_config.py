"""config.py: the parser (moved out of the entry point) and the type/range checks of every project key."""

import subprocess
import sys

import pytest

from attnlab.config import DEFAULT_CONFIG, check_types, parse_config
from tests.utils import REPO


def _toml(tmp_path, extra: str, replace: tuple[str, str] | None = None) -> str:
    text = (REPO / "attnlab" / "configs" / "debug_cpu.toml").read_text()
    if replace:
        assert replace[0] in text
        text = text.replace(*replace)
    path = tmp_path / "cfg.toml"
    path.write_text(text + "\n" + extra)
    return str(path)


@pytest.mark.parametrize("extra,replace,message", [
    ('[attention.parallax]\nrope_on_rho = "false"\n', None,
     r"attention.parallax.rope_on_rho='false' \(str\): expected a boolean"),
    ("", ("steps = 400", "steps = 10.7"), r"training.steps=10.7 \(float\): expected an integer"),
    ("", ("steps = 400", 'steps = "10"'), r"training.steps='10' \(str\): expected an integer"),
    ("", ("weight_decay = 0.1", "weight_decay = -1.0"), r"optimizer.weight_decay=-1.0: must be >= 0"),
    ("", ("lr = 3e-3", "lr = -1e-3"), r"optimizer.lr=-0.001: must be >= 0"),
    ("", ("lr = 3e-3", 'lr = "3e-3"'), r"optimizer.lr='3e-3' \(str\): expected a number"),
    ("", ("keep_latest_k = 2", "keep_latest_k = 1"), r"checkpoint.keep_latest_k=1: must be 0 or >= 2"),
    ("", ("enable = true\ninterval = 200", "enable = 1\ninterval = 200"), r"checkpoint.enable=1 \(int\)"),
    ("", ("decay_type = \"linear\"", "decay_type = \"cosin\""), r"lr_scheduler.decay_type='cosin'.*one of"),
    ("", ("min_lr_factor = 0.0", "min_lr_factor = 2.0"), r"lr_scheduler.min_lr_factor=2.0: must be in \[0, 1\]"),
    ('[attention.gdn]\nA_init_range = [1.0]\n', None, r"attention.gdn.A_init_range=\[1.0\].*2 items"),
    ("", ("[attention]\nimpl = \"auto\"", "[attention]\nimpl = \"auto\"\nparallax = 5"),
     r"attention.parallax=5: expected a table \[attention.parallax\] of keys"),
    ("", ('attention = "softmax"', 'attention = "softmax"\nlayer_pattern = "gdn"'),
     r"model.layer_pattern='gdn' \(str\): expected a list of strings"),
])
def test_toml_values_are_type_and_range_checked(tmp_path, extra, replace, message):
    with pytest.raises(ValueError, match=message):
        parse_config(["--job.config_file", _toml(tmp_path, extra, replace)])


@pytest.mark.parametrize("flag,value,message", [
    ("--optimizer.weight_decay", "-1", r"optimizer.weight_decay=-1.0: must be >= 0"),
    ("--optimizer.lr", "-1e-3", r"optimizer.lr=-0.001: must be >= 0"),
    ("--training.nonfinite_skips", "-2", r"training.nonfinite_skips=-2: must be >= 0"),
    ("--data.max_bad_records", "-1", r"data.max_bad_records=-1: must be >= 0"),
    ("--optimizer.beta2", "1.0", r"optimizer.beta2=1.0: must be in \[0, 1\)"),
    ("--training.max_norm", "nan", r"training.max_norm=nan: must be > 0"),
    ("--training.dataloader.num_workers", "2", r"training.dataloader.num_workers=2: must be 0 or 1\. .*read every "
     r"document again"),
    ("--validation.dataloader.num_workers", "3", r"validation.dataloader.num_workers=3: must be 0 or 1"),
    ("--training.loss_chunk_tokens", "-1", r"training.loss_chunk_tokens=-1: must be >= 0"),
])
def test_command_line_ranges(flag, value, message):
    with pytest.raises(ValueError, match=message):
        parse_config(["--job.config_file", DEFAULT_CONFIG, flag, value])


@pytest.mark.parametrize("flags,refused", [
    (["--model.converters", "quantize.linear.float8"], "quantize.linear.float8"),  # float8's filter_fqns: [] by default
    (["--model.converters", "quantize.linear.mx", "--quantize.linear.mx.filter_fqns", "attention.wq"],
     "quantize.linear.mx"),
    (["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.filter_fqns", "attention.wq,output"],
     None),
    (["--model.converters", "quantize.linear.mx"], None),  # MX leaves "output" alone by default
])
def test_the_chunked_loss_refuses_a_low_precision_head(flags, refused):
    """``training.loss_chunk_tokens`` runs the head's matmuls itself: a float8/MX converter must skip the head."""
    argv = ["--job.config_file", DEFAULT_CONFIG, "--training.loss_chunk_tokens", "8", *flags]
    if refused is None:
        assert parse_config(argv).training.loss_chunk_tokens == 8
        return
    with pytest.raises(ValueError, match=rf"training.loss_chunk_tokens=8 with model.converters '{refused}': .*; add "
                                         rf'"output" to {refused}.filter_fqns, or set training.loss_chunk_tokens = 0'):
        parse_config(argv)


def test_valid_values_pass_and_ints_are_numbers(tmp_path):
    cfg = parse_config(["--job.config_file", _toml(tmp_path, '[attention.parallax]\nrope_on_rho = false\n',
                                                    ("lr = 3e-3", "lr = 1"))])
    assert cfg.attention.parallax.rope_on_rho is False and cfg.optimizer.lr == 1
    check_types(cfg)


def test_library_code_does_not_import_the_entry_point():
    code = ("import sys; import attnlab.checkpoint.dcp, attnlab.checkpoint.hf, attnlab.checkpoint.load as load; "
            f"load.args_from_job_config({DEFAULT_CONFIG!r}); "
            "assert 'attnlab.train' not in sys.modules, 'attnlab.train imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(REPO), capture_output=True)


def test_no_false_warning_for_the_embedded_tokenizer(caplog):
    """``model.hf_assets_path = "embedded"`` names the built-in tokenizer, not a missing folder."""
    cfg = parse_config(["--job.config_file", DEFAULT_CONFIG])
    assert cfg.model.hf_assets_path == "embedded"
    assert "does not exist" not in caplog.text
    parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.hf_assets_path", "/no/such/folder"])
    assert "HF assets path /no/such/folder does not exist" in caplog.text  # torchtitan's warning otherwise kept


@pytest.mark.parametrize("args,expect", [
    (["--validation.enable", "false"], {"validation.enable": False}),
    (["--validation.enable", "TRUE", "--checkpoint.partial_load=1"], {"validation.enable": True,
                                                                       "checkpoint.partial_load": True}),
    (["--attention.parallax.rope_on_rho", "0", "--metrics.enable-tensorboard", "false"],
     {"attention.parallax.rope_on_rho": False, "metrics.enable_tensorboard": False}),
    (["--model.tie_embeddings", "false"], {"model.tie_embeddings": False}),  # bool | None
    (["--attention.sac_save", "false"], {"attention.sac_save": False}),  # a key of the generated [attention] class
    (["--validation.no-enable", "--debug.deterministic"], {"validation.enable": False, "debug.deterministic": True}),
])
def test_every_bool_key_takes_a_value(args, expect):
    """The README's "any key as --section.key value" holds for booleans (tyro only knows --key/--no-key)."""
    import functools

    cfg = parse_config(["--job.config_file", DEFAULT_CONFIG, *args])
    for key, value in expect.items():
        assert functools.reduce(getattr, key.split("."), cfg) is value, key


def test_bool_key_with_another_word_is_named():
    with pytest.raises(ValueError, match=r"validation.enable='yes': expected a boolean"):
        parse_config(["--job.config_file", DEFAULT_CONFIG, "--validation.enable", "yes"])


def test_help_documents_the_project_keys():
    """tyro reads field docstrings from the classes of the merged config's MRO: the project's must be there."""
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--help"], capture_output=True, text=True,
                         cwd=str(REPO), timeout=120).stdout
    for flag, words in [("--model.attention STR", "Token mixer"), ("--optimizer.muon-momentum", "Muon momentum"),
                        ("--lr-scheduler.warmup-fraction", "fraction of total steps"),
                        ("--attention.impl STR", "picks per device"), ("--data.hub-split", "Split to read"),
                        ("--metrics.wandb-project", "wandb project")]:
        after = out.split(flag, 1)[1][:400]
        assert words in " ".join(after.replace("│", " ").split()), flag


def test_model_dimensions_override_the_flavor():
    """``[model] dim/n_layers/n_heads/n_kv_heads/head_dim/hidden_dim`` on top of a flavor (0 = the flavor's),
    reaching the model arguments torchtitan builds from."""
    from attnlab.models.args import get_flavor

    cfg = parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.dim", "96", "--model.n_layers", "3",
                        "--model.n_heads", "6", "--model.n_kv_heads", "3", "--model.head_dim", "16",
                        "--model.hidden_dim", "200"])
    args = get_flavor(cfg.model.flavor)
    args.update_from_config(cfg)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim, args.hidden_dim) == (
        96, 3, 6, 3, 16, 200)
    args = get_flavor("debug")
    args.update_from_config(parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.n_layers", "2"]))
    assert (args.dim, args.n_layers, args.n_heads) == (128, 2, 4)  # the rest stays the flavor's
    with pytest.raises(ValueError, match=r"model.n_heads=6 is not a multiple of model.n_kv_heads=4"):
        get_flavor("debug").update_from_config(
            parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.n_heads", "6", "--model.n_kv_heads", "4"]))
    with pytest.raises(ValueError, match=r"model.dim=-8: must be >= 0"):
        parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.dim", "-8"])


@pytest.mark.parametrize("flags, message", [
    # longer than the debug flavor's 4 layers: Parallax (the fifth entry) would never be built
    (["--model.layer_pattern", "softmax,softmax,softmax,softmax,parallax"],
     r"model.layer_pattern has 5 entries .* n_layers=4: the entries past layer 4 would never be built"),
    (["--model.layer_pattern", "softmax,parallax,softmax", "--model.n_layers", "2"], r"model.layer_pattern has 3"),
    (["--training.global_batch_size", "12"], r"training.global_batch_size=12: must be .* multiple of "
                                             r"training.local_batch_size"),
])
def test_preflight_refuses_shapes_that_torchtitan_cut_or_assert(flags, message):
    from attnlab.train import preflight

    with pytest.raises(ValueError, match=message):
        preflight(parse_config(["--job.config_file", DEFAULT_CONFIG, *flags]))


@pytest.mark.parametrize("flags, message", [
    # one process (python -m attnlab.train): torchtitan's ParallelDims asserted after the process group was up
    (["--parallelism.context_parallel_degree", "2"],
     r"parallelism.context_parallel_degree=2 = 2 does not divide the 1 processes"),
    (["--parallelism.data_parallel_shard_degree", "2"],
     r"parallelism.data_parallel_shard_degree=2 .* but this run has 1 process"),
])
def test_degrees_are_checked_against_the_processes_launched(flags, message, monkeypatch):
    from attnlab.train import check_launch

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=message):
        check_launch(parse_config(["--job.config_file", DEFAULT_CONFIG, *flags]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_launch(parse_config(["--job.config_file", DEFAULT_CONFIG, *flags]))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the check is about a machine without CUDA")
def test_a_run_refuses_float8_without_a_gpu_that_runs_it():
    """float8 on a CPU was a 60-line torchao traceback once training started; emulation stays allowed."""
    from attnlab.train import check_launch

    with pytest.raises(ValueError, match=r"model.converters=\['quantize.linear.float8'\]: float8 training needs a "
                                         r"CUDA GPU with compute capability >= 8.9 \(found no CUDA GPU\)"):
        check_launch(parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.converters",
                                   "quantize.linear.float8"]))
    check_launch(parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.converters", "quantize.linear.float8",
                               "--quantize.linear.float8.emulate", "true"]))


@pytest.mark.parametrize("flags, message", [
    (["--training.steps", "abc"], r"^Error parsing --training.steps: invalid literal for int\(\) with base 10: 'abc'$"),
    (["--training.dtype", "float16"], r"^invalid choice 'float16' for argument '--training.dtype'. Expected one of "),
    (["--training.nosuch", "3"], r"^Unrecognized options: --training.nosuch, 3$"),
])
def test_flags_tyro_cannot_parse_are_one_line(flags, message):
    """tyro's boxed message (title, wrapped text, help hint) becomes the one line train.py prints."""
    with pytest.raises(ValueError, match=message):
        parse_config(["--job.config_file", DEFAULT_CONFIG, *flags])


def test_preflight_notes_what_this_launch_cannot_run(capsys, monkeypatch):
    """``--preflight`` checks a configuration, perhaps away from its machines: what only this launch cannot run
    (here two context-parallel ranks on one process) is a note, and the check passes."""
    from attnlab.train import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")  # single_process_env leaves the environment alone
    main(["--preflight", "--parallelism.context_parallel_degree", "2"])
    out = capsys.readouterr().out
    assert "preflight passed" in out and "note: launched like this, on this machine, the run would stop: " \
                                         "parallelism.data_parallel_replicate_degree=1 x " in out
