"""Downstream evaluation with lm-eval-harness: the paper's tasks on a checkpoint, through the remote-code export.

    pip install lm-eval
    python -m attnlab.tools.eval_downstream RUN_OR_STEP_OR_HF_DIR [--step N] [--tasks lambada_openai,wikitext]
        [--batch-size 8] [--device cuda] [--dtype bfloat16] [--limit 100] [--include-path my_tasks/] [-o out.json]

A run or step folder is first exported (attnlab/tools/export_hf.py's code: weights, tokenizer, and the standalone
remote-code model) into a temporary folder; an HF folder is used as it is. lm-eval's own ``hf`` model then runs
it, so every lm-eval task and option applies unchanged; the equivalent direct command is
``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,dtype=float32 --tasks ...``. Remote code
(``auto_map`` in config.json or tokenizer_config.json) is trusted only when it is this project's own
(``attnlab/checkpoint/hf_remote``'s files, byte for byte, under ``model_type = "attnlab"``) or with
``--trust-remote-code``, as in transformers: any other folder's code would run with this process's rights.
The default tasks are the Parallax paper's (LAMBADA and WikiText perplexity; BoolQ, HellaSwag, PIQA, ARC-e/c,
WinoGrande, OpenBookQA, SciQ zero-shot); lm-eval downloads their data from the Hugging Face Hub on first use.
Offline (the Hub does not answer, or ``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1``), tasks run from local copies
only: data in the datasets cache (``$HF_HOME``, default ~/.cache/huggingface, e.g. copied from a machine that
loaded it) or task YAMLs with local ``dataset_path``/``data_files`` under ``--include-path``; a task whose data is
neither is named in one line before anything is exported, instead of lm-eval retrying the connection.
Prints one line per task and metric and writes lm-eval's results JSON to ``-o``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import warnings
from pathlib import Path


PAPER_TASKS = "lambada_openai,wikitext,boolq,hellaswag,piqa,arc_easy,arc_challenge,winogrande,openbookqa,sciq"


def _auto_map_modules(folder: Path) -> set[str]:
    """The modules the ``auto_map`` entries of ``folder``'s config.json and tokenizer_config.json name (what
    transformers imports from the folder under ``trust_remote_code``)."""
    modules = set()
    for name in ("config.json", "tokenizer_config.json"):
        p = folder / name
        auto_map = json.loads(p.read_text()).get("auto_map", {}) if p.is_file() else {}
        for ref in auto_map.values():
            for r in ref if isinstance(ref, list) else [ref]:
                if r:
                    modules.add(r.rsplit(".", 1)[0])
    return modules


def trust_remote_code(folder: Path, allowed: bool) -> bool:
    """Whether lm-eval may run the remote code of the Hugging Face folder ``folder``: yes for this project's own
    (config.json ``model_type = "attnlab"``, every ``auto_map`` module one of ``attnlab/checkpoint/hf_remote``'s files
    and byte-identical to it) or when ``allowed`` (``--trust-remote-code``); a folder with no remote code needs none.
    Any other remote code is a CheckpointError naming the modules and the flag."""
    from attnlab.checkpoint.dcp import CheckpointError
    from attnlab.checkpoint.hf import REMOTE_CODE_DIR, REMOTE_CODE_FILES

    modules = _auto_map_modules(folder)
    if not modules or allowed:
        return bool(modules)

    def ours(module: str) -> bool:
        mine, theirs = REMOTE_CODE_DIR / f"{module}.py", folder / f"{module}.py"
        return f"{module}.py" in REMOTE_CODE_FILES and theirs.is_file() and theirs.read_bytes() == mine.read_bytes()

    if json.loads((folder / "config.json").read_text()).get("model_type") == "attnlab" and all(map(ours, modules)):
        return True
    raise CheckpointError(f"{folder}: its auto_map runs its own code ({', '.join(sorted(modules))}), which is not this "
                          "project's exported model (attnlab/checkpoint/hf_remote); pass --trust-remote-code to run it "
                          "anyway")


@contextlib.contextmanager
def hub_offline(enable: bool = True):
    """With ``enable``, ``datasets`` and ``huggingface_hub`` run in their offline mode inside the block, as if
    ``HF_HUB_OFFLINE=1`` had been set before they were imported: data in the local cache loads, anything else fails
    at once with a ConnectionError instead of retrying the connection for a minute. Both flags are restored after."""
    if not enable:
        yield
        return
    import datasets.config
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def check_tasks_offline(tasks: list[str], task_manager) -> None:
    """Load every task of ``tasks`` that ``task_manager`` knows (a task, group or tag name, or a task YAML), data
    included, under :func:`hub_offline`; the first whose data is neither local nor in the datasets cache is a
    CheckpointError naming the task, what it could not reach, and how to run it from a local copy. Names lm-eval does
    not know are left to lm-eval, which names them itself."""
    from attnlab.checkpoint.dcp import CheckpointError

    known = set(task_manager.all_tasks)
    for name in tasks:
        if name not in known and not Path(name).is_file():
            continue
        try:
            with hub_offline():
                task_manager.load(name)
        except ConnectionError as e:
            raise CheckpointError(
                f"task {name} needs the network ({' '.join(str(e).split())}) and the Hugging Face Hub cannot be "
                "reached; to run it from a local copy, load its dataset once where there is network, copy the "
                "datasets cache ($HF_HOME, default ~/.cache/huggingface) here and set HF_DATASETS_OFFLINE=1, or "
                "point the task at local files (a task YAML with dataset_path: json and dataset_kwargs: data_files, "
                "passed with --include-path)") from None


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import (ToolParser, add_checkpoint_arguments, add_tokenizer_argument, existing_dir,
                                      existing_file, non_negative_int, out_file, positive_float, torch_device)

    ap = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(ap)
    ap.add_argument("--tasks", default=PAPER_TASKS, help="comma-separated lm-eval task names (default: the paper's)")
    ap.add_argument("--num-fewshot", type=non_negative_int, default=None,
                    help="few-shot examples (default: each task's, 0 for these)")
    ap.add_argument("--batch-size", default="8", help="lm-eval batch size (an integer or 'auto')")
    ap.add_argument("--device", type=torch_device, default=None,
                    help="torch device (default: cuda when available, else cpu)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="dtype of the exported weights and of the model lm-eval builds")
    ap.add_argument("--limit", type=positive_float, default=None,
                    help="documents per task (a fraction if < 1), for quick runs")
    ap.add_argument("--include-path", type=existing_dir, default=None,
                    help="folder of extra task YAMLs (lm-eval's --include_path)")
    ap.add_argument("--config", type=existing_file,
                    help="training TOML giving the architecture (default: the run's config.toml)")
    add_tokenizer_argument(ap)
    ap.add_argument("-o", "--out", type=out_file, default=None, help="write lm-eval's results (JSON) here")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run an HF folder's own remote code (auto_map) even when it is not this project's export")
    return ap


def main(argv=None) -> dict | int:
    from attnlab.checkpoint.layout import resolve
    from attnlab.tools.common import checkpoint_tokenizer

    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        print("eval_downstream: error: lm-eval is not installed (pip install lm-eval)", file=sys.stderr)
        return 2
    import datasets.config
    import torch

    from attnlab.checkpoint.dcp import CheckpointError
    from attnlab.checkpoint.hf import has_remote_code, is_plain_qwen3, save_hf
    from attnlab.checkpoint.layout import is_hf_folder
    from attnlab.checkpoint.load import load_tool_checkpoint

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tasks = a.tasks.split(",")
    from attnlab.data.sources import hub_reachable

    offline = datasets.config.HF_HUB_OFFLINE or not hub_reachable()
    with tempfile.TemporaryDirectory(prefix="eval_downstream_") as tmp, hub_offline(offline):
        try:
            ckpt = resolve(a.ckpt, a.step)
            task_manager = TaskManager(include_path=a.include_path)
            if offline:
                check_tasks_offline(tasks, task_manager)
            if is_hf_folder(ckpt.path) and a.config is None and a.tokenizer is None and ckpt.tokenizer is not None:
                folder = ckpt.path
            else:
                fmt, args, sd, cfg = load_tool_checkpoint(ckpt, a.config, progress=True)
                if not (is_plain_qwen3(args) or has_remote_code(args)):
                    raise CheckpointError(f"mechanisms {sorted(set(args.layer_mechanisms()))}: transformers cannot run "
                                          "this model (the remote-code model implements softmax and Parallax)")
                tok = checkpoint_tokenizer(ckpt, cfg, a.tokenizer, args.vocab_size)
                folder = Path(tmp) / "hf"
                save_hf(sd, args, folder, getattr(torch, a.dtype), tokenizer_dir=tok, progress=True)
            trust = trust_remote_code(folder, a.trust_remote_code)
        except (CheckpointError, FileNotFoundError) as e:
            print(f"eval_downstream: error: {e}", file=sys.stderr)
            return 2
        res = lm_eval.simple_evaluate(
            model="hf", model_args={"pretrained": str(folder), "trust_remote_code": trust, "dtype": a.dtype},
            tasks=tasks, num_fewshot=a.num_fewshot, batch_size=a.batch_size, device=device, limit=a.limit,
            task_manager=task_manager)
    for task, metrics in res["results"].items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not key.startswith("alias") and "stderr" not in key:
                print(f"{task:24s} {key:28s} {value:.4f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({k: res[k] for k in ("results", "versions", "n-shot", "config")
                                           if k in res}, indent=1, default=str))
    return res


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    out = main()
    sys.exit(out if isinstance(out, int) else 0)
