"""Every key checked once at start, before anything is built: types from the dataclass annotations, numeric
ranges, and the rules across keys (mechanisms, optimizer, parallelism, context parallelism, the chunked loss), each
failure one ValueError naming the key, the value and what is valid."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing

from attnlab import attention
from attnlab.attention.registry import REGISTRY
from attnlab.optim.registry import get_optimizer


def _describe(tp) -> str:
    """What a value of annotation ``tp`` looks like, in TOML words."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return f"one of {list(args)}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin in (list, tuple):
        plural = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
        inner = ", ".join(plural.get(a, _describe(a)) for a in dict.fromkeys(args) if a is not Ellipsis) or "values"
        return f"a list of {inner}" + (f" ({len(args)} items)" if origin is tuple and Ellipsis not in args else "")
    if dataclasses.is_dataclass(tp):
        return "a table of keys"
    return {bool: "a boolean (true/false, unquoted)", int: "an integer", float: "a number", str: "a string",
            type(None): "unset (None)"}.get(tp, getattr(tp, "__name__", str(tp)))


def _fits(value, tp) -> bool:
    """Does ``value`` (as TOML/tyro produced it) have annotation ``tp``? Unknown annotations pass."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any or isinstance(tp, (str, typing.TypeVar)):
        return True
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return not args or (len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args)))
    if origin is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(tp):
        return dataclasses.is_dataclass(value) and not isinstance(value, type)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def check_types(obj, prefix: str = "") -> None:
    """Every field of the dataclass ``obj`` (recursively) against its annotation; raises naming the key, the
    value and the expected type. TOML values reach the config unconverted (``rope_on_rho = "false"`` is a
    string, ``steps = 10.7`` a float), so this is where they are caught."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        tp = hints.get(f.name, f.type)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_types(value, key + ".")
        elif not _fits(value, tp):
            raise ValueError(f"{key}={value!r} ({type(value).__name__}): expected {_describe(tp)}")


_POS, _NONNEG, _UNIT = "> 0", ">= 0", "in [0, 1]"
# optimizer.lr may be 0 (a run that must not move the weights, e.g. a save-format round trip), as torch's optimizers
# allow; a negative lr is rejected here, naming the key, instead of inside torch.
RANGES: dict[str, str] = {
    "training.steps": _POS, "training.seq_len": _POS, "training.local_batch_size": _POS,
    "training.max_norm": _POS, "training.stop_after_step": _NONNEG, "training.nonfinite_skips": _NONNEG,
    "training.gc_freq": _POS, "training.loss_chunk_tokens": _NONNEG,
    "optimizer.lr": _NONNEG, "optimizer.weight_decay": _NONNEG, "optimizer.eps": _POS,
    "optimizer.beta1": "in [0, 1)", "optimizer.beta2": "in [0, 1)", "optimizer.adam_beta1": "in [0, 1)",
    "optimizer.adam_beta2": "in [0, 1)", "optimizer.adam_eps": _POS, "optimizer.muon_momentum": "in [0, 1)",
    "optimizer.muon_ns_steps": _POS, "optimizer.muon_eps": _POS, "optimizer.muon_min_dim": _NONNEG,
    "optimizer.adam_embed_lr_mult": _NONNEG, "optimizer.adam_head_lr_mult": _NONNEG,
    "optimizer.adam_norm_lr_mult": _NONNEG, "optimizer.adam_vector_lr_mult": _NONNEG,
    "optimizer.lr_warmup_steps": _NONNEG,
    "lr_scheduler.warmup_steps": _NONNEG, "lr_scheduler.total_steps": _POS, "lr_scheduler.decay_ratio": _UNIT,
    "lr_scheduler.min_lr_factor": _UNIT, "lr_scheduler.warmup_fraction": _UNIT, "lr_scheduler.decay_start": _UNIT,
    "lr_scheduler.wd_anneal_gamma": _NONNEG,
    "data.val_every": _NONNEG, "data.embedded_vocab_size": _POS, "data.max_bad_records": _NONNEG,
    "checkpoint.interval": _POS, "checkpoint.keep_latest_k": "0 or >= 2", "checkpoint.load_step": ">= -1",
    "metrics.log_freq": _POS, "validation.freq": _POS, "validation.steps": "-1 or > 0",
    "validation.seq_len": _POS, "validation.local_batch_size": _POS,
    "model.vocab_size": _NONNEG, "model.rope_theta": _NONNEG, "model.dim": _NONNEG, "model.n_layers": _NONNEG,
    "model.n_heads": _NONNEG, "model.n_kv_heads": _NONNEG, "model.head_dim": _NONNEG, "model.hidden_dim": _NONNEG,
}
"""Range of numeric keys (None = unset passes); anything outside is an error naming the key."""

_RULES = {
    _POS: lambda v: v > 0, _NONNEG: lambda v: v >= 0, _UNIT: lambda v: 0 <= v <= 1,
    "in [0, 1)": lambda v: 0 <= v < 1, "0 or >= 2": lambda v: v == 0 or v >= 2, ">= -1": lambda v: v >= -1,
    "-1 or > 0": lambda v: v == -1 or v > 0,
}


def check_ranges(job_config) -> None:
    for key, rule in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(job_config, section, None), name, None)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value) or not _RULES[rule](value):
            raise ValueError(f"{key}={value!r}: must be {rule}")


def check_context_parallel(job_config) -> None:
    """``parallelism.context_parallel_degree = N`` (attnlab/attention/cp.py): every layer's mechanism runs under it, the
    sequences split into 2N equal chunks, no kernel or compile path that cannot take a shard of a row."""
    cp, m = job_config.parallelism.context_parallel_degree, job_config.model
    key = "parallelism.context_parallel_degree"
    if cp < 1:
        raise ValueError(f"{key}={cp}: must be >= 1")
    supported = sorted(n for n, e in REGISTRY.items() if getattr(e.cls, "context_parallel", False))
    for name in sorted({m.attention, *m.layer_pattern}):
        if name not in supported:
            raise ValueError(f"{key}={cp}: mechanism {name!r} does not run under context parallelism (its class "
                             "does not set context_parallel = True; docs/context_parallel.md says what a mechanism "
                             f"needs); supported: {supported}")
    for section in ("training", "validation"):
        seq_len = getattr(job_config, section).seq_len
        if seq_len % (2 * cp):
            raise ValueError(f"{section}.seq_len={seq_len}: must be a multiple of 2 x {key} = {2 * cp} (each rank "
                             "holds two equal chunks of every sequence)")
    if job_config.compile.enable and "model" in job_config.compile.components:
        compiles = sorted(n for n in supported if getattr(REGISTRY[n].cls, "context_parallel_compiles", False))
        for name in sorted({m.attention, *m.layer_pattern}):
            if name not in compiles:
                raise ValueError(f"compile.enable with {key}={cp}: mechanism {name!r} is not known to compile under "
                                 f"context parallelism (docs/context_parallel.md, \"Compiling\"); compiles: "
                                 f"{compiles}; set compile.enable = false")


def check_loss_chunks(job_config) -> None:
    """``training.loss_chunk_tokens`` runs the head's matmuls itself (attnlab/models/loss.py), in the compute dtype: a
    float8 or MX converter must leave the head alone, i.e. have it in its ``filter_fqns`` (matched as torchtitan does:
    an entry contained in the name "output")."""
    n, converters = job_config.training.loss_chunk_tokens, job_config.model.converters
    for name in ("quantize.linear.float8", "quantize.linear.mx"):
        filters = functools.reduce(getattr, name.split("."), job_config).filter_fqns
        if name in converters and not any(f in "output" for f in filters):
            raise ValueError(f"training.loss_chunk_tokens={n} with model.converters {name!r}: the chunked loss runs "
                             f"the head's matmuls itself and cannot run it in low precision; add \"output\" to "
                             f"{name}.filter_fqns, or set training.loss_chunk_tokens = 0")


def validate_config(job_config) -> None:
    """Fail before training starts, naming the key, the value and what is valid."""
    check_types(job_config)
    check_ranges(job_config)
    m = job_config.model
    for key, name in [("model.attention", m.attention)] + [
        (f"model.layer_pattern[{i}]", n) for i, n in enumerate(m.layer_pattern)
    ]:
        attention.get_mechanism(name, key)
    get_optimizer(job_config.optimizer.name)
    if m.attn_mask_type not in ("causal", "block_causal"):
        raise ValueError(f"model.attn_mask_type={m.attn_mask_type!r}; choose from ['causal', 'block_causal']")
    f8 = job_config.quantize.linear.float8
    if "quantize.linear.float8" in job_config.model.converters and f8.recipe_name and f8.enable_fsdp_float8_all_gather:
        raise ValueError(f"quantize.linear.float8.recipe_name={f8.recipe_name!r} cannot be combined with "
                         "enable_fsdp_float8_all_gather=true in torchtitan 0.2.2; unset recipe_name for tensorwise "
                         "scaling with float8 all-gather")
    for section in ("training", "validation"):
        workers = getattr(job_config, section).dataloader.num_workers
        if workers > 1:
            raise ValueError(
                f"{section}.dataloader.num_workers={workers}: must be 0 or 1. The packed dataset is one stateful "
                "stream per data-parallel rank, so each further worker would read every document again (repeated "
                "batches); 1 tokenizes in a worker process, off the training loop")
    p = job_config.parallelism
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree"):
        if getattr(p, key) != 1:
            raise ValueError(f"parallelism.{key}={getattr(p, key)}: this framework supports FSDP/HSDP and context "
                             "parallelism; set it to 1")
    if p.context_parallel_degree != 1:
        check_context_parallel(job_config)
    if job_config.training.loss_chunk_tokens:
        check_loss_chunks(job_config)
