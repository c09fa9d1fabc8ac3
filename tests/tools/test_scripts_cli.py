"""One CLI style for every tool script: `--help` exits 0, documents every argument and writes nothing;
unknown flags are rejected; run folders and step folders are both accepted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import REPO

SCRIPTS = sorted(p for p in (REPO / "attnlab" / "tools").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())

# Runs every script's --help in ONE fresh interpreter (imports are shared, so the whole check takes seconds):
# each script runs as __main__ with argv [script, --help]; parse_args is wrapped to record options that have
# no help text. Prints one JSON line {script: [exit code, undocumented options]}.
HARNESS = r"""
import argparse, json, runpy, sys
results, undocumented = {}, []
real = argparse.ArgumentParser.parse_known_args
def parse_known_args(self, *a, **kw):
    undocumented.extend(a.dest for a in self._actions if not a.help and not isinstance(a, argparse._HelpAction))
    return real(self, *a, **kw)
argparse.ArgumentParser.parse_known_args = parse_known_args
for path in sys.argv[1:]:
    undocumented.clear()
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
        code = "returned without exiting"
    except SystemExit as e:
        code = e.code or 0
    results[path] = [code, sorted(set(undocumented))]
print("\nRESULTS " + json.dumps(results))
"""


def _snapshot(root: Path) -> dict[str, float]:
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".git", "__pycache__", ".cache", "runs", ".pytest_cache")]
        for f in files:
            p = os.path.join(d, f)
            out[p] = os.stat(p).st_mtime_ns
    return out


def test_every_script_help_is_clean_and_writes_nothing(tmp_path):
    assert len(SCRIPTS) > 10
    before = _snapshot(REPO)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", HARNESS, *map(str, SCRIPTS)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.rsplit("RESULTS ", 1)[1])
    bad = {Path(k).name: v for k, v in results.items() if v != [0, []]}
    assert not bad, f"--help exit code or undocumented options: {bad}"
    assert list(tmp_path.iterdir()) == [], "a script's --help wrote into the working folder"
    after = _snapshot(REPO)
    changed = sorted(p for p in after if before.get(p) != after[p])
    assert not changed, f"--help wrote files: {changed[:5]}"


def _tool(name):
    import importlib

    return importlib.import_module(f"attnlab.tools.{name}")


def _run_folder(tmp_path):
    """A run folder as the trainer leaves it (two DCP steps with different weights, the run's tokenizer), and
    the two models. The step folders carry attnlab.json, so no config is needed to rebuild them."""
    import torch

    from attnlab.checkpoint.dcp import save_dcp_state
    from attnlab.checkpoint.layout import save_tokenizer
    from tests.models.test_decode import _tiny
    from tests.utils import make_corpus

    corpus = make_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    models = {}
    for step in (1, 2):
        torch.manual_seed(step)
        m = _tiny("parallax", vocab_size=64)  # the test tokenizer's 63 tokens fit
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.2 * torch.randn_like(p))
        save_dcp_state(m.state_dict(), run / "checkpoint" / f"step-{step}", m.model_args)
        models[step] = m
    save_tokenizer(corpus["tokenizer"], run / "tokenizer")
    return run, models


def test_generate_and_export_reject_unknown_flags(tmp_path, capsys):
    generate, export_hf = _tool("generate"), _tool("export_hf")
    for main, argv in ((generate.main, [str(tmp_path), "--prompt", "1 2", "--max-tokens", "5"]),
                       (export_hf.main, [str(tmp_path), str(tmp_path / "o"), "--dtpye", "bfloat16"])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_generate_takes_a_run_folder_and_step(tmp_path, capsys):
    import torch

    from tests.models.test_decode import _full_greedy

    generate = _tool("generate")
    run, models = _run_folder(tmp_path)
    prompt = torch.tensor([[5, 17, 3, 40]])
    for argv, step in (([str(run)], 2), ([str(run), "--step", "1"], 1), ([str(run / "checkpoint" / "step-1")], 1)):
        assert generate.main([*argv, "--prompt", "5 17 3 40", "--tokenizer", "ids", "--greedy",
                              "--max-new-tokens", "4", "--device", "cpu"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert [int(t) for t in out[0].split()] == _full_greedy(models[step], prompt, 4)[0][0].tolist()
    assert generate.main([str(run), "--step", "9", "--prompt", "w1", "--device", "cpu"]) == 2
    assert "no step-9; available steps: [1, 2]" in capsys.readouterr().err
    # the run's own tokenizer is found without --tokenizer (word-level test tokenizer: w<i> is token i + 3)
    assert generate.main([str(run), "--prompt", "w1 w2", "--greedy", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[-4:-2] == ["w1", "w2"]  # prompt, then 2 new words


def test_export_copies_the_run_tokenizer_with_ordinary_permissions(tmp_path, capsys):
    import torch

    from attnlab.checkpoint.load import load_checkpoint

    export_hf = _tool("export_hf")
    run, models = _run_folder(tmp_path)
    assert export_hf.main([str(run), str(tmp_path / "hf"), "--step", "1"]) == 0
    from tokenizers import Tokenizer  # the run's tokenizer, saved by transformers (with training's BOS handling)

    vocab = [Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab() for d in (tmp_path / "hf", run / "tokenizer")]
    assert vocab[0] == vocab[1]
    _, _, sd = load_checkpoint(tmp_path / "hf")
    assert all(torch.equal(sd[k], v) for k, v in models[1].state_dict().items())
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o777 & ~umask
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()} == \
        {p.name: 0o666 & ~umask for p in (tmp_path / "hf").iterdir()}
    # --config: the architecture and tokenizer of a training TOML (a run folder without tokenizer/)
    from attnlab.checkpoint.dcp import build_model, save_dcp_state
    from attnlab.checkpoint.load import args_from_job_config

    cfg = tmp_path / "x.toml"
    cfg.write_text(f'[model]\nflavor = "debug"\nattention = "parallax"\nvocab_size = 64\n'
                   f'hf_assets_path = "{tmp_path / "corpus"}"\n')
    args = args_from_job_config(cfg)
    (tmp_path / "run2" / "checkpoint").mkdir(parents=True)
    save_dcp_state(build_model(args).state_dict(), tmp_path / "run2" / "checkpoint" / "step-3", args)
    (tmp_path / "run2" / "checkpoint" / "step-3" / "attnlab.json").unlink()  # only --config describes it
    assert export_hf.main([str(tmp_path / "run2"), str(tmp_path / "hf2"), "--config", str(cfg)]) == 0
    assert (tmp_path / "hf2" / "tokenizer.json").is_file() and "tokenizer from" in capsys.readouterr().out


def test_write_run_files_round_trips_the_configuration(tmp_path):
    """config.toml written from a parsed JobConfig parses back to the same configuration (every section)."""
    import dataclasses

    from attnlab.checkpoint.dcp import model_args_from_config
    from attnlab.checkpoint.dcp import args_to_dict
    from attnlab.checkpoint.load import job_config
    from attnlab.checkpoint.layout import CONFIG_FILE, resolve, write_run_files
    from tests.utils import make_corpus, tiny_args

    corpus = make_corpus(tmp_path / "corpus")
    argv = tiny_args(corpus, tmp_path / "run", 5, 16, 2, "--model.layer_pattern", "gdn,parallax",
                     "--attention.parallax.rho_gate", "--optimizer.name", "muon")
    cfg = job_config(argv[1], argv[2:])
    write_run_files(tmp_path / "run", cfg, corpus["tokenizer"])
    back = job_config(tmp_path / "run" / CONFIG_FILE)
    same = lambda d: json.loads(json.dumps(d, default=str))  # noqa: E731  (TOML has lists, no tuples)
    a, b = dataclasses.asdict(cfg), dataclasses.asdict(back)
    a["job"].pop("config_file"), b["job"].pop("config_file")
    assert same(a) == same(b)
    arch = lambda c: same(args_to_dict(model_args_from_config(c)))  # noqa: E731
    assert arch(back) == arch(cfg)
    (tmp_path / "run" / "checkpoint" / "step-5").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "step-5" / ".metadata").touch()
    ckpt = resolve(tmp_path / "run")
    assert ckpt.step == 5 and ckpt.config == tmp_path / "run" / CONFIG_FILE
    assert ckpt.tokenizer == tmp_path / "run" / "tokenizer"


def test_slurm_script_help_and_outside_slurm_are_clean(tmp_path):
    """`bash scripts/slurm_train.sh --help` failed with `SLURM_JOB_NODELIST: unbound variable`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    script = str(REPO / "scripts" / "slurm_train.sh")
    proc = subprocess.run(["bash", script, "--help"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "sbatch --nodes=2" in proc.stdout and not proc.stderr, proc.stderr
    assert "#SBATCH" not in proc.stdout
    proc = subprocess.run(["bash", script, "--job.config_file", "x"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "SLURM_JOB_NODELIST is not set: run it with sbatch" in proc.stderr and not list(tmp_path.iterdir())
