"""softmax → Parallax conversion with W_R = 0 (Parallax paper §5; docs/mechanisms.md): with ρ = RMSNorm(0) = 0
Parallax reduces to softmax attention, so the converted model computes exactly the same function. Used by
attnlab/tools/convert_to_parallax.py and attnlab/tools/import_hf.py (their options: attnlab/tools/common.py), with the
training-config entries that rebuild a converted or imported architecture (:func:`config_overrides`,
:func:`finetune_command`)."""

from __future__ import annotations

import dataclasses
import math
import shlex
from pathlib import Path

import torch

from attnlab import attention
from attnlab.attention.parallax import ParallaxOptions
from attnlab.checkpoint.dcp import build_model, progress_bar, CheckpointError


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """"14-27" / "0,2,5-7" -> sorted layer indices, each in [0, n_layers)."""
    out = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            out.update(range(int(lo), int(hi if hi else lo) + 1))
    except ValueError:
        raise CheckpointError(f"--layers {spec!r}: expected ranges like '14-27' or '0,2,5-7'") from None
    bad = sorted(i for i in out if not 0 <= i < n_layers)
    if bad or not out:
        raise CheckpointError(f"--layers {spec!r}: layers {bad or '(none)'} outside 0-{n_layers - 1}")
    return sorted(out)


DEFAULT_RHO_NORM_INIT = ParallaxOptions().rho_norm_init
"""The conversion's gain of ρ's RMSNorm unless told otherwise: the module default, so a converted model's ρ starts as
strong as that of a Parallax model trained from scratch."""


def convert_state(args, sd, layers, rope_on_rho=True, rho_gate=False, gate_bias=0.0, progress=False,
                  rho_norm_init=DEFAULT_RHO_NORM_INIT):
    """(new ModelArgs, new state dict): ``layers`` become Parallax with W_R = 0 and ρ's RMSNorm gain
    ``rho_norm_init`` (any gain keeps ρ = 0, so the function is unchanged; the gain sets how strong ρ is once
    W_R moves: ‖ρ‖ = √head_dim · gain as soon as W_R x ≠ 0). Every converted layer must be softmax attention;
    other mechanisms stay as they are."""
    mechs = args.layer_mechanisms()
    not_softmax = [(i, mechs[i]) for i in layers if mechs[i] != "softmax"]
    if not_softmax:
        raise CheckpointError(f"layers {[i for i, _ in not_softmax]} are {sorted({m for _, m in not_softmax})}, "
                              "not softmax attention; only softmax layers convert to Parallax")
    if not (math.isfinite(rho_norm_init) and rho_norm_init >= 0):
        raise CheckpointError(f"--rho-norm-init {rho_norm_init!r}: must be a finite number >= 0")
    sm = args.attention_options["softmax"]
    popts = attention.get_mechanism("parallax").options(
        window_size=sm.window_size, qk_norm=sm.qk_norm, rope_on_rho=rope_on_rho, rho_gate=rho_gate,
        rho_gate_bias=gate_bias, wr_init="zero", rho_norm_init=rho_norm_init)
    if "parallax" in args.attention_options:
        old = args.attention_options["parallax"]
        if (old.rope_on_rho, old.rho_gate, old.window_size, old.qk_norm) != (rope_on_rho, rho_gate, sm.window_size, sm.qk_norm):
            raise CheckpointError("the source already has Parallax layers with different options "
                                  f"({old}); convert with matching --rho-gate/--no-rope-on-rho")
    new_mechs = ["parallax" if i in layers else m for i, m in enumerate(mechs)]
    new_args = dataclasses.replace(args, attention=new_mechs[0],
                                   layer_pattern=new_mechs if len(set(new_mechs)) > 1 else [],
                                   attention_options={**{k: v for k, v in args.attention_options.items()
                                                         if k in set(new_mechs)}, "parallax": popts})
    out = dict(sd)
    HD, dim = args.n_heads * args.head_dim, args.dim
    for i in progress_bar(layers, "convert", progress):
        p = f"layers.{i}.attention."
        dtype = sd[f"{p}wq.weight"].dtype
        out[f"{p}wr.weight"] = torch.zeros(HD, dim, dtype=dtype)
        out[f"{p}r_norm.weight"] = torch.full((args.head_dim,), float(rho_norm_init), dtype=dtype)
        if rho_gate:
            out[f"{p}r_gate.weight"] = torch.zeros(args.n_heads, dim, dtype=dtype)
            out[f"{p}r_gate.bias"] = torch.full((args.n_heads,), float(gate_bias), dtype=dtype)
    return new_args, out


@torch.no_grad()
def max_logit_diff(args_a, sd_a, args_b, sd_b, seq_len: int = 32, batch: int = 2, seed: int = 0) -> float:
    """max |logits_a − logits_b| of the two models on one fixed random batch, float32."""
    fp32 = lambda sd: {k: v.float() for k, v in sd.items()}  # noqa: E731
    a = build_model(args_a, fp32(sd_a))
    b = build_model(args_b, fp32(sd_b))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args_a.vocab_size, (batch, min(seq_len, args_a.max_seq_len)), generator=g)
    return (a(tokens) - b(tokens)).abs().max().item()


FINETUNE_CONFIG = "convert_finetune_parallax"
"""The fine-tuning recipe of a converted checkpoint (W_R's own lr warmup): a shipped configuration's name."""


def flavor_and_dims(args) -> tuple[str, dict[str, int]]:
    """(the flavor closest to ``args``'s sizes, ``[model]`` dimension overrides for the sizes it differs in).
    The flavor must share ``args``'s RMSNorm eps, which no config key overrides."""
    from attnlab.models.args import DIMS, FLAVORS

    same_eps = {n: a for n, a in FLAVORS.items() if a.norm_eps == args.norm_eps}
    if not same_eps:
        raise CheckpointError(f"no model.flavor has this checkpoint's RMSNorm eps {args.norm_eps}; flavors: "
                              + ", ".join(f"{n} {a.norm_eps}" for n, a in FLAVORS.items()))

    def differs(flavor):
        return {f: getattr(args, f) for f in DIMS if getattr(flavor, f) != getattr(args, f)}

    name = min(same_eps, key=lambda n: len(differs(same_eps[n])))
    return name, differs(same_eps[name])


def config_overrides(args) -> dict[str, dict]:
    """The training-config entries that rebuild the architecture ``args`` on top of any config, as nested sections:
    ``{"model": {...}, "attention": {mechanism: {option: value}}}``. ``[model]``: the closest flavor
    (:func:`flavor_and_dims`, for the RMSNorm eps no key sets) with every size given explicitly (a config's own size
    overrides never apply), vocabulary, RoPE base, tying, mechanism and layer pattern (empty when every layer is the
    same); ``[attention.<mechanism>]``: every option of each mechanism used (tuples as lists, None, which has no TOML
    form, left out). The mask type and sequence length stay the config's: they follow how the data is packed, not
    the weights."""
    from attnlab.models.args import DIMS

    flavor, _ = flavor_and_dims(args)
    mechs = args.layer_mechanisms()
    model = dict(flavor=flavor, **{f: getattr(args, f) for f in DIMS}, vocab_size=args.vocab_size,
                 rope_theta=args.rope_theta, tie_embeddings=args.enable_weight_tying, attention=mechs[0],
                 layer_pattern=mechs if len(set(mechs)) > 1 else [])
    attn = {name: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(opts).items()
                   if v is not None}
            for name, opts in args.attention_options.items() if name in set(mechs)}
    return {"model": model, "attention": attn}


def config_flags(sections: dict, prefix: str = "--") -> list[str]:
    """train.py's ``--section.key value`` flags of nested config entries (``{"model": {"flavor": "debug"}}`` →
    ``["--model.flavor", "debug"]``): booleans as true/false, lists comma-joined; empty lists are left out (the
    config's default, no pattern)."""
    out = []
    for key, value in sections.items():
        if isinstance(value, dict):
            out += config_flags(value, f"{prefix}{key}.")
        elif value != []:
            text = (str(value).lower() if isinstance(value, bool) else
                    ",".join(map(str, value)) if isinstance(value, list) else str(value))
            out += [f"{prefix}{key}", text]
    return out


SOURCE_RUN_KEYS = ("training.dataset", "training.dataset_path", "training.seq_len", "training.local_batch_size",
                   "training.global_batch_size", "training.mixed_precision_param", "training.mixed_precision_reduce",
                   "validation.enable", "validation.dataset", "validation.dataset_path", "validation.seq_len",
                   "validation.local_batch_size", "validation.steps", "data", "model.attn_mask_type", "compile.enable",
                   "activation_checkpoint.mode")
"""Config keys (``section.key``, or a whole section) a fine-tune takes from the run it converts: its data, sizes,
precision, compilation and activation checkpointing, where the recipe's GPU-cluster values (c4, seq 4096, batch
480, bf16, compile, selective AC) would not run on the machine that trained the source (a CPU debug run)."""


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def source_run_overrides(source_cfg) -> dict[str, dict]:
    """The entries of :data:`SOURCE_RUN_KEYS` where the source run's JobConfig ``source_cfg`` differs from
    :data:`FINETUNE_CONFIG`, as nested sections for :func:`config_flags` (None values, which have no flag form,
    left out)."""
    from attnlab.config import parse_config

    recipe = parse_config(["--job.config_file", FINETUNE_CONFIG, "--model.hf_assets_path", "embedded"])
    out: dict[str, dict] = {}
    for key in SOURCE_RUN_KEYS:
        value = _get(source_cfg, key)
        entries = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else {key.split(".")[1]: value}
        base = _get(recipe, key)
        base = dataclasses.asdict(base) if dataclasses.is_dataclass(base) else {key.split(".")[1]: base}
        section = out.setdefault(key.split(".")[0], {})
        section.update({k: v for k, v in entries.items() if v is not None and v != base.get(k)})
    return {k: v for k, v in out.items() if v}


def finetune_folder(checkpoint) -> str:
    """The ``job.dump_folder`` of the fine-tune of converted ``checkpoint``: ``<checkpoint>-finetune`` (``-2``,
    ``-3``, … when taken), a folder of this conversion's own, so a fine-tune never resumes another conversion's
    run (the trainer loads ``checkpoint.initial_load_path`` only while the dump folder has no checkpoint)."""
    base = f"{str(checkpoint).rstrip('/')}-finetune"
    folder, n = base, 1
    while Path(folder).exists():
        n += 1
        folder = f"{base}-{n}"
    return folder


def finetune_command(args, checkpoint, tokenizer=None, source_cfg=None) -> str:
    """The train.py command line that fine-tunes the converted DCP ``checkpoint`` of architecture ``args`` with
    :data:`FINETUNE_CONFIG`: its model loaded through ``checkpoint.initial_load_path``, the architecture set by
    :func:`config_overrides` (sizes, vocabulary, layer pattern, ``rope_on_rho``, ``rho_gate``, …), when given the
    tokenizer folder the weights were trained with as ``model.hf_assets_path`` and the data, sizes and precision
    of the source run's JobConfig ``source_cfg`` (:func:`source_run_overrides`), and ``job.dump_folder``
    :func:`finetune_folder`. Flags the user adds after it override any of these."""
    flags = ["--job.dump_folder", finetune_folder(checkpoint), "--checkpoint.initial_load_path", str(checkpoint),
             *config_flags(config_overrides(args))]
    if tokenizer is not None:
        flags += ["--model.hf_assets_path", str(tokenizer)]
    if source_cfg is not None:
        flags += config_flags(source_run_overrides(source_cfg))
    return shlex.join(["python", "-m", "attnlab.train", "--job.config_file", FINETUNE_CONFIG, *flags])
