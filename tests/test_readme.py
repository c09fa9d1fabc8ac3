"""Every command of the README's ```bash blocks is accounted for here: run as written (``RUN``, in a scratch copy of
the checkout, marked ``slow``: they train for minutes on a CPU), or listed with the reason it is not run (``CHECKED``:
a GPU, the network, a long run, or inputs that stand for the user's own; ``NOT_CHECKED``: not a trainer or tool
command, or its input is written by an earlier command). In the default suite every ``RUN`` and ``CHECKED`` command's
flags are accepted as written: the trainer's (``python train.py``, ``python -m attnlab.train``, ``torchrun … -m
attnlab.train``) by its config parser and its preflight (nothing built or written), a tool's (``attnlab TOOL``,
``python -m benchmarks.X``) by the tool's own argparse parser. A README command in no table, or a table entry no
longer in the README, fails."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.utils import REPO

RUN = {
    "python train.py": "trains the embedded default, minutes on a CPU",
    "python -m attnlab.train --job.config_file paper/qwen3_0.6b_parallax --preflight":
        "checks a shipped config by name, seconds",
    "attnlab train_tokenizer docs/ -o runs/my_tokenizer --vocab-size 2048": "the docs/ block, about a minute",
    "python -m attnlab.train --training.dataset_path docs/ --model.hf_assets_path runs/my_tokenizer "
    "--model.vocab_size 2048 "
    "--data.val_every 2 --validation.local_batch_size 2 --training.steps 60 --job.dump_folder runs/my_text":
        "the docs/ block",
    "attnlab eval_ppl runs/my_text --data README.md --max-rows 8": "the docs/ block",
}
"""Run as written, in README order (each block's commands read what the ones before wrote)."""

NETWORK, GPU = "needs the network", "needs a GPU"
HF_DOWNLOAD = f"{NETWORK} (the Qwen3-0.6B download)"
USER_RUN = "runs/x, runs/my_run and their data stand for the user's run (tests/tools/ runs the tool on tiny ones)"
CHECKED = {
    "attnlab fetch_tokenizer": f"{NETWORK} (downloads Qwen/Qwen3-0.6B's tokenizer)",
    "python -m attnlab.train --training.dataset allenai/c4 --data.hub_subset en "
    "--model.hf_assets_path assets/hf/Qwen3-0.6B "
    "--model.vocab_size 151936 --training.steps 100 --job.dump_folder runs/c4": f"{NETWORK} (streams allenai/c4)",
    "torchrun --nproc_per_node=8 -m attnlab.train --job.config_file paper/qwen3_0.6b_parallax": "needs 8 GPUs",
    "torchrun --nproc_per_node=1 -m attnlab.train --job.config_file paper/qwen3_0.6b_parallax "
    "--training.global_batch_size 8 --training.steps 20": f"{GPU} (the 0.6B model)",
    "python -m attnlab.train --job.config_file paper/qwen3_0.6b_parallax": f"{GPU} (the 0.6B model)",
    "attnlab smoke_configs --data DATA --tokenizer TOKDIR --local-batch 1 --seq 2048":
        f"{GPU}; DATA and TOKDIR stand for the user's corpus and tokenizer",
    "attnlab smoke_configs --data DATA --tokenizer TOKDIR --nproc 4 --only qwen3_0.6b_*": "needs 4 GPUs",
    "attnlab plot_ppl runs/softmax runs/parallax -o ppl.png --smooth 0.9 --x tokens --skip 50":
        "needs two training runs (tests/tools/test_plot_ppl.py plots tiny ones)",
    "attnlab convert_to_parallax runs/qwen3_0.6b/checkpoint/step-20000 runs/converted/step-0":
        "needs a trained 0.6B run (tests/tools/test_convert_to_parallax.py converts a tiny one)",
    "attnlab convert_to_parallax ./Qwen3-0.6B ./Qwen3-0.6B-parallax --top-half": HF_DOWNLOAD,
    "attnlab convert_to_parallax SRC DST --layers 14-27 --rho-gate --gate-bias -2 --no-rope-on-rho":
        "SRC and DST stand for the user's folders",
    "attnlab export_hf runs/my_run hf_out [--step N] [--dtype bfloat16] [--tokenizer assets/hf/Qwen3-0.6B]":
        f"{USER_RUN}; tests/tools/test_hf_round_trip.py exports a trained run",
    "attnlab export_hf runs/my_run/checkpoint/step-N hf_out --config attnlab/configs/my_run.toml": USER_RUN,
    "attnlab import_hf assets/hf/Qwen3-0.6B runs/qwen3_parallax --parallax [--top-half --rho-gate] --base "
    "convert_finetune_parallax": f"{HF_DOWNLOAD}; tests/tools/test_hf_round_trip.py imports one",
    "attnlab train_tokenizer my_text/ -o tokenizers/mine --vocab-size 8192":
        "my_text/ stands for the user's files (the docs/ block runs the same commands)",
    "python -m attnlab.train --model.hf_assets_path tokenizers/mine --model.vocab_size 8192 "
    "--training.dataset_path my_text/":
        "my_text/ stands for the user's files (the docs/ block runs the same commands)",
    "attnlab generate hf_out --prompt The capital of France is --max-new-tokens 64 --temperature 0.8 "
    "--top-k 50 --top-p 0.95": "needs an export (hf_out) of a trained run",
    "attnlab generate runs/my_run [--step N] --prompt ...": USER_RUN,
    "attnlab eval_ppl runs/x --data val.jsonl.gz [--step N]": USER_RUN,
    "attnlab eval_ppl runs/x --data val.jsonl.gz --by-position": USER_RUN,
    "attnlab passkey runs/x [--lengths 1024,4096] [--depths 0,0.5,1]": USER_RUN,
    "attnlab analyze runs/x --data val.jsonl.gz": USER_RUN,
    "attnlab eval_downstream runs/x [--tasks lambada_openai,wikitext] [--limit 200]":
        f"{USER_RUN}; {NETWORK} for the tasks' data",
    "attnlab synthetic --attention softmax,parallax,gdn --sweep quick":
        "trains every mechanism on every synthetic task: long on a CPU",
    "python -m benchmarks.replicate --corpus CORPUS_DIR --steps 160":
        f"{GPU} (~68M-parameter runs); CORPUS_DIR is the user's",
}

NOT_CHECKED = {
    "attnlab configs": "prints the shipped configurations' names (tests/test_package.py checks them in the wheel)",
    "pip install torch==2.13.0 -e .[test]": f"{NETWORK}; installs the environment the tests run in",
    "pip install -e .[eval]": f"{NETWORK}; installs lm-eval",
    "python -m pytest -q": "the test suite itself, this file included",
    "python -m pytest -q -m gpu": "the GPU tests",
    "python -m pytest -q -m gpu_sweep": "the GPU tests over every tile candidate",
    "python -m pytest -q -m slow": "the slow tests, this file's run-as-written test included",
    "scripts/wheelhouse.sh wheels 3.12 manylinux_2_28_x86_64 --cuda cu130":
        f"{NETWORK} (downloads wheels); tests/tools/test_wheelhouse.py checks the script",
    "scripts/wheelhouse.sh wheels-small 3.11 manylinux_2_28_x86_64 --cpu --no-torch":
        f"{NETWORK} (downloads wheels); tests/tools/test_wheelhouse.py checks the script",
    "bash wheels/install.sh": "installs the wheel folder the wheelhouse command writes",
    "hf download Qwen/Qwen3-0.6B --local-dir assets/hf/Qwen3-0.6B": HF_DOWNLOAD,
    "python -m attnlab.train --job.config_file convert_finetune_parallax --job.dump_folder "
    "runs/converted/step-0-finetune --checkpoint.initial_load_path runs/converted/step-0":
        "its checkpoint.initial_load_path is written by the convert_to_parallax command before it, which needs a "
        "trained 0.6B run (tests/tools/test_convert_to_parallax.py runs a tiny conversion's printed command)",
    "python -m attnlab.train --job.config_file runs/qwen3_parallax/config.toml":
        "its config.toml is written by the import_hf command before it (tests/tools/test_hf_round_trip.py trains "
        "from one)",
}


def readme_commands() -> dict[str, list[str]]:
    """{command as text: its argv} of every command in the README's ```bash blocks, in order: continuation lines
    joined, ``#`` comments dropped, ``&&`` / ``;`` separating commands. The text is the argv joined by spaces."""
    text = (REPO / "README.md").read_text()
    out = {}
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lex.whitespace_split = True
            argv = []
            for tok in [*lex, ";"]:
                if tok not in (";", "&&"):
                    argv.append(tok)
                elif argv:
                    out[" ".join(argv)] = argv
                    argv = []
    return out


def test_every_readme_command_is_run_or_listed_with_a_reason():
    commands = set(readme_commands())
    tables = [RUN, CHECKED, NOT_CHECKED]
    listed = set().union(*tables)
    assert sum(map(len, tables)) == len(listed), "a command is in two tables"
    assert not commands - listed, f"README commands neither run nor listed here: {sorted(commands - listed)}"
    assert not listed - commands, f"listed here but no longer in the README: {sorted(listed - commands)}"
    assert all(CHECKED.values()) and all(NOT_CHECKED.values()), "every command not run needs its reason"


def _as_written(argv: list[str]) -> list[str]:
    """A command's arguments with the README's notation resolved: optional ``[...]`` parts given, placeholder N = 1."""
    args = [a.removeprefix("[").removesuffix("]") for a in argv]
    return ["1" if a == "N" else a for a in args]


class _Parsed(Exception):
    """Raised once a tool's argparse parser accepted its arguments: the tool stops before doing any work."""


def _check_train_flags(flags: list[str]) -> None:
    """The trainer's configuration of ``flags``, parsed and preflighted as its main does (nothing built); main's own
    ``--preflight`` switch stops there too."""
    from attnlab.config import DEFAULT_CONFIG, parse_config
    from attnlab.train import preflight

    flags = [f for f in flags if f != "--preflight"]
    if not any(f.split("=")[0] in ("--job.config_file", "--job.config-file") for f in flags):
        flags = ["--job.config_file", DEFAULT_CONFIG, *flags]
    preflight(parse_config(flags))


def _check_tool_flags(module: str, args: list[str], monkeypatch) -> None:
    """``module``'s ``main(args)`` up to its argparse parser accepting ``args``; stopped there."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        real(self, *a, **k)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    from attnlab.tools import common

    def any_path(text: str) -> str:  # the README's paths stand for the user's files, absent here
        return text

    any_path.valid = "any path"
    for name in ("existing_path", "existing_dir", "existing_file", "new_path", "dir_path", "out_file"):
        monkeypatch.setattr(common, name, any_path)
    with pytest.raises(_Parsed):
        importlib.import_module(module).main(args)


def _entry(argv: list[str]) -> tuple[str, list[str]]:
    """(what a README command runs, its arguments): "train" for the trainer (``python train.py``, ``python -m
    attnlab.train``, ``torchrun … -m attnlab.train``, ``attnlab train``), else the module of a tool or script
    (``attnlab TOOL`` through :data:`attnlab.cli.COMMANDS`, ``python -m attnlab.tools.X`` / ``benchmarks.X``)."""
    from attnlab.cli import COMMANDS

    if "train.py" in argv:
        return "train", argv[argv.index("train.py") + 1:]
    if argv[0] == "attnlab":
        module = COMMANDS[argv[1]]
        return ("train" if module == "attnlab.train" else module), argv[2:]
    i = argv.index("-m") + 1
    assert argv[i] == "attnlab.train" or argv[i].startswith(("attnlab.tools.", "benchmarks.")), argv
    return ("train" if argv[i] == "attnlab.train" else argv[i]), argv[i + 1:]


@pytest.mark.parametrize("command", sorted({**RUN, **CHECKED}))
def test_readme_command_flags_are_accepted(command, monkeypatch, capsys):
    argv = _as_written(readme_commands()[command])
    monkeypatch.chdir(REPO)  # the README's commands run from the checkout's root
    entry, args = _entry(argv)
    try:
        if entry == "train":
            _check_train_flags(args)
        else:
            module = importlib.import_module(entry)
            _check_tool_flags(entry + (".__main__" if hasattr(module, "__path__") else ""), args, monkeypatch)
    except SystemExit as e:  # a parser rejected an argument (its message is on stderr)
        raise AssertionError(f"{command}: exit {e.code}: {capsys.readouterr().err.strip()}") from None


def _run_as_written(commands: list[str], root) -> dict[str, tuple[str, float]]:
    """{command: (its stdout, seconds)} of README commands run through a shell in order, in a scratch copy of the
    checkout at ``root`` (links to its files, so what they write, runs/ and .cache/, lands in the copy), each
    exiting 0."""
    import time

    for entry in REPO.iterdir():
        if entry.name not in ("runs", ".cache", ".git"):
            (root / entry.name).symlink_to(entry)
    # this environment's interpreter and its ``attnlab`` command (installed beside it by ``pip install -e``)
    env = {**os.environ, "OMP_NUM_THREADS": "2",
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    argvs, out = readme_commands(), {}
    for command in commands:
        argv = argvs[command]
        argv = [sys.executable, *argv[1:]] if argv[0] == "python" else argv
        start = time.monotonic()
        proc = subprocess.run(shlex.join(argv), shell=True, cwd=root, env=env, capture_output=True,
                              text=True, timeout=1800, executable="/bin/bash")
        assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        out[command] = proc.stdout, time.monotonic() - start
    return out


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    """The ``RUN`` commands, each exiting 0."""
    _run_as_written([c for c in readme_commands() if c in RUN], tmp_path)
    assert (tmp_path / "runs" / "debug_cpu" / "metrics.jsonl").is_file()
    assert (tmp_path / "runs" / "my_text" / "checkpoint").is_dir()


OWN_TEXT = [c for c in RUN if "my_t" in c]
"""The README's "Training on your own text" block."""


@pytest.mark.slow
def test_readme_own_text_block_prints_what_the_readme_says(tmp_path):
    """What the README says of the block: it runs in a minute or two on a CPU (123 s on 2 busy cores), the
    tokenizer has the 2048 tokens asked for, the run validates on its held-out documents, and the closing eval_ppl
    scores held-out text (README.md, which the run never trained on; it scored docs/, half of it training text),
    8 rows, a finite perplexity."""
    import json
    import math

    out = _run_as_written(OWN_TEXT, tmp_path)
    tok, train, ppl = (out[c] for c in OWN_TEXT)
    assert "2048 tokens" in tok[0]
    res = json.loads(ppl[0].strip().splitlines()[-1])
    assert res["data"] == "README.md" and res["rows"] == 8 and math.isfinite(res["ppl"]) and res["ppl"] > 1
    val = [r for r in map(json.loads, (tmp_path / "runs" / "my_text" / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in r]
    assert val, "the run validated on its held-out documents"
    assert sum(seconds for _, seconds in out.values()) < 180, {c: round(s) for c, (_, s) in out.items()}


@pytest.mark.slow
def test_readme_synthetic_quick_cell_takes_what_the_readme_says():
    """The README's `synthetic --sweep quick` line says under a minute to a few minutes per task and mechanism on a
    2-core CPU (it said "CPU minutes" for 21 cells, of which 9 took 590 s); one cell, timed by the tool itself, within
    a few minutes (6)."""
    from attnlab.tools import synthetic

    assert "under a minute to a few minutes per task and mechanism on a 2-core" in (REPO / "README.md").read_text()
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (cell,) = synthetic.main(["--attention", "softmax", "--tasks", "recall", "--sweep", "quick", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    assert cell["steps"] == 300 and cell["seconds"] < 360, cell
