"""Import a Hugging Face Qwen3 checkpoint into a trainable run, optionally as Parallax with W_R = 0.

    python -m attnlab.tools.import_hf HF_DIR OUT [--base debug_cpu] [--parallax [--layers 14-27 |
                                --top-half] [--rho-gate --gate-bias B] [--no-rope-on-rho]] [--dump-folder DIR]
    python -m attnlab.train --job.config_file OUT/config.toml

HF_DIR is a Qwen3 folder (config.json + safetensors: a hub download such as ``hf download Qwen/Qwen3-0.6B
--local-dir DIR``, or ``transformers``' ``save_pretrained``) or an attnlab export. OUT (new) receives:

- ``step-0/``: the weights as a model-only DCP checkpoint (+ ``attnlab.json``);
- ``tokenizer/``: the tokenizer files of HF_DIR, or of ``--tokenizer DIR`` (required when HF_DIR has no
  tokenizer.json; its vocabulary must fit the checkpoint's embedding rows);
- ``config.toml``: ``--base`` with ``[model]`` (the closest flavor with every size given, vocabulary, RoPE
  base, tying, mechanism), ``[attention.*]`` and ``[checkpoint] initial_load_path = OUT/step-0`` set, so
  ``train.py`` starts from these weights; ``job.dump_folder`` is ``--dump-folder`` (default ``OUT/run``).

With ``--parallax`` the layers become Parallax with W_R = 0 through ``attnlab/checkpoint/convert.py`` (as in
``attnlab.tools.convert_to_parallax``; same function, checked on a fixed batch, ``--tol``). Before anything is written the config is parsed back and
must rebuild exactly the imported architecture. Any failure writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import warnings
from pathlib import Path

from attnlab import configs




def run_config(base: dict, args, step0: Path, tokenizer: Path, dump_folder: str) -> dict:
    """``base`` (a parsed training TOML) with the sections that make a run start from ``step0`` as ``args``: the
    architecture's ``[model]`` and ``[attention.*]`` entries (:func:`attnlab.checkpoint.convert.config_overrides`),
    the tokenizer, ``[checkpoint] initial_load_path`` and the dump folder."""
    from attnlab.checkpoint.convert import config_overrides

    cfg = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    arch = config_overrides(args)
    cfg.setdefault("model", {}).update(arch["model"], hf_assets_path=str(tokenizer))
    cfg.setdefault("attention", {}).update(arch["attention"])
    ckpt = cfg.setdefault("checkpoint", {})
    ckpt.update(enable=True, initial_load_path=str(step0), initial_load_model_only=True, initial_load_in_hf=False)
    cfg.setdefault("job", {})["dump_folder"] = dump_folder
    return cfg


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import (ToolParser, add_conversion_arguments, add_tokenizer_argument, dir_path,
                                      existing_dir, new_path, or_empty, positive_float)

    ap = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=existing_dir, metavar="HF_DIR",
                    help="Hugging Face Qwen3 folder (config.json + *.safetensors)")
    ap.add_argument("out", type=new_path, metavar="OUT", help="output folder; must not exist")
    ap.add_argument("--base", default="debug_cpu",
                    help="training TOML, or a shipped config's name (attnlab configs), whose data, optimizer, "
                         "schedule and parallelism sections the run uses")
    ap.add_argument("--dump-folder", type=or_empty(dir_path), default="",
                    help="job.dump_folder of the run (default: OUT/run)")
    add_tokenizer_argument(ap, "tokenizer folder (tokenizer.json) the weights were trained with; default: HF_DIR's own")
    ap.add_argument("--parallax", action="store_true", help="convert softmax layers to Parallax with W_R = 0")
    add_conversion_arguments(ap, "with --parallax")
    ap.add_argument("--tol", type=positive_float, default=1e-5,
                    help="with --parallax: max |Δlogits| (float32) allowed")
    return ap


def main(argv=None) -> int:
    import tomli_w

    import tomli as tomllib  # a dependency on every Python (tomllib is 3.11+)

    from attnlab.checkpoint.convert import flavor_and_dims, max_logit_diff
    from attnlab.checkpoint.dcp import args_to_dict, save_dcp_state, CheckpointError
    from attnlab.checkpoint.layout import (CONFIG_FILE, HF_SOURCE_CONFIG, TOKENIZER_DIR, check_tokenizer_fits,
                                           is_hf_folder, new_folder, save_tokenizer)
    from attnlab.checkpoint.load import args_from_job_config, load_checkpoint
    from attnlab.tools.common import MAKE_TOKENIZER, conversion_options_given, convert_from_arguments

    ap = build_parser()
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    try:
        given = conversion_options_given(ap, a)
        if given and not a.parallax:
            raise CheckpointError(f"{', '.join(given)}: conversion options need --parallax")
        if out.exists():
            raise CheckpointError(f"{out} already exists; choose a new destination")
        if not is_hf_folder(a.src):
            raise CheckpointError(f"{a.src}: not a Hugging Face folder (config.json + *.safetensors)")
        with open(configs.resolve(a.base), "rb") as f:
            base = tomllib.load(f)
        _, args, sd = load_checkpoint(a.src, progress=True)
        sd = {k: v.float() for k, v in sd.items()}
        if a.parallax:
            _, new_args, new_sd = convert_from_arguments(args, sd, a)
            diff = max_logit_diff(args, sd, new_args, new_sd)
            if not diff <= a.tol:
                raise CheckpointError(f"converted model disagrees with the source: max |Δlogits| = {diff:.3g}")
            args, sd = new_args, new_sd
        tokenizer = Path(a.tokenizer or a.src)
        if not (tokenizer / "tokenizer.json").is_file():
            raise CheckpointError(f"{tokenizer}: no tokenizer.json; " + ("--tokenizer must name a tokenizer folder"
                                  if a.tokenizer else "pass --tokenizer DIR, the tokenizer these weights were trained "
                                  "with") + f" ({MAKE_TOKENIZER})")
        check_tokenizer_fits(tokenizer, args.vocab_size)
        flavor, dims = flavor_and_dims(args)
        with new_folder(out) as tmp:
            save_tokenizer(tokenizer, tmp / TOKENIZER_DIR)
            shutil.copyfile(Path(a.src) / "config.json", tmp / TOKENIZER_DIR / HF_SOURCE_CONFIG)  # for an export
            cfg = run_config(base, args, out / "step-0", out / TOKENIZER_DIR, a.dump_folder or str(out / "run"))
            (tmp / CONFIG_FILE).write_text(tomli_w.dumps(cfg))
            # the written config must rebuild exactly this architecture (max_seq_len follows training.seq_len)
            rebuilt = args_from_job_config(tmp / CONFIG_FILE, ["--checkpoint.initial_load_path", str(tmp / "step-0"),
                                                               "--model.hf_assets_path", str(tmp / TOKENIZER_DIR)])
            want, got = args_to_dict(args), args_to_dict(rebuilt)
            diff_keys = [k for k in want if k not in ("max_seq_len", "attn_mask_type", "attn_impl")
                         and want[k] != got[k]]
            if diff_keys:
                raise CheckpointError(f"--base {a.base}: the written config rebuilds a different model "
                                      f"({', '.join(f'{k}: {got[k]} vs {want[k]}' for k in diff_keys)})")
            # the step's record is the run's model: the mask and context follow how the run packs its data
            save_dcp_state(sd, tmp / "step-0", dataclasses.replace(
                args, max_seq_len=rebuilt.max_seq_len, attn_mask_type=rebuilt.attn_mask_type))
    except (CheckpointError, OSError, ValueError) as e:
        print(f"import_hf: error: {e}", file=sys.stderr)
        return 2
    mechs = sorted(set(args.layer_mechanisms()))
    sizes = f" with {dims}" if dims else ""
    print(f"wrote {out}: flavor {flavor}{sizes}, {mechs}, step-0 + config.toml + tokenizer")
    print(f"train: python -m attnlab.train --job.config_file {out / CONFIG_FILE}")
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sys.exit(main())
