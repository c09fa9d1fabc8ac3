"""Every key checked once at start, before anything is built: types from the dataclass annotations, the valid values
declared next to each key (:mod:`attnlab.config.rules`; torchtitan's keys in :data:`TITAN_RULES`), and the rules
across keys (layer pattern against depth, parallel degrees against the processes, float8 against the device,
context parallelism, the chunked loss), each failure one ValueError naming the key, the value and what is valid."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

from attnlab.config import rules
from attnlab.attention.registry import REGISTRY


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


@functools.cache
def _hints(cls) -> dict:
    """``typing.get_type_hints`` of a config class, resolved once (every check of every key reads them)."""
    return typing.get_type_hints(cls)


def check_types(obj, prefix: str = "") -> None:
    """Every field of the dataclass ``obj`` (recursively) against its annotation; raises naming the key, the
    value and the expected type. TOML values reach the config unconverted (``rope_on_rho = "false"`` is a
    string, ``steps = 10.7`` a float), so this is where they are caught."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        tp = hints.get(f.name, f.type)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_types(value, key + ".")
        else:
            check_type(key, value, tp)


def check_type(key: str, value, tp) -> None:
    """``value`` of ``key`` against its annotation ``tp``; raises naming the key, the value and the expected type."""
    if not _fits(value, tp):
        raise ValueError(f"{key}={value!r} ({type(value).__name__}): expected {_describe(tp)}")


_AC = "unused: pipeline parallelism must stay off (parallelism.pipeline_parallel_degree = 1)"
_FT = "unused: this framework does not run torchft fault tolerance"
_ONLY_FSDP = "1; this framework supports FSDP/HSDP and context parallelism"
TITAN_RULES: dict[str, str] = {
    "job.config_file": "existing file",
    "job.dump_folder": "non-empty and not a file",
    "job.description": "any: free text for the log",
    "job.save_config_file": "any: a file name torchtitan writes inside job.dump_folder (None = none)",
    "job.custom_config_module": "empty; this framework merges its own sections (attnlab/config/sections.py)",
    "profiling.save_traces_folder": "non-empty",
    "profiling.profile_freq": "> 0",
    "profiling.profiler_active": "> 0",
    "profiling.profiler_warmup": ">= 0",
    "profiling.save_memory_snapshot_folder": "non-empty",
    "metrics.log_freq": "> 0",
    "metrics.save_tb_folder": "non-empty",
    "model.name": "empty or one of qwen3_attn; empty = qwen3_attn, the train spec this project registers",
    "model.hf_assets_path": "any: 'embedded' or a folder with tokenizer.json; preflight checks one there fits "
                            "the vocabulary, the data loader names a folder without one",
    "model.tokenizer_path": "empty or existing path",
    "model.converters": "one of quantize.linear.float8, quantize.linear.mx",
    "optimizer.name": "a registered optimizer",
    # optimizer.lr may be 0 (a run that must not move the weights, e.g. a save-format round trip), as torch's
    # optimizers allow
    "optimizer.lr": ">= 0", "optimizer.weight_decay": ">= 0", "optimizer.eps": "> 0",
    "optimizer.beta1": "in [0, 1)", "optimizer.beta2": "in [0, 1)",
    "lr_scheduler.warmup_steps": ">= 0", "lr_scheduler.total_steps": "> 0", "lr_scheduler.decay_ratio": "in [0, 1]",
    "lr_scheduler.min_lr_factor": "in [0, 1]",
    "training.dataset": "any: a name for the log; training.dataset_path says what is read",
    "training.dataset_path": "any: a local file, folder or glob, or a hub dataset id; the data loader checks it "
                             "before step 1, naming it",
    "training.local_batch_size": "> 0", "training.seq_len": "> 0", "training.steps": "> 0", "training.max_norm": "> 0",
    "training.global_batch_size": "< 0 or > 0 and multiple of training.local_batch_size",
    "training.gc_freq": "> 0",
    "training.dataloader.num_workers": ">= 0", "training.dataloader.prefetch_factor": "> 0",
    "validation.dataloader.num_workers": ">= 0", "validation.dataloader.prefetch_factor": "> 0",
    "parallelism.data_parallel_replicate_degree": ">= 1",
    "parallelism.data_parallel_shard_degree": "-1 or >= 1",
    "parallelism.tensor_parallel_degree": _ONLY_FSDP, "parallelism.pipeline_parallel_degree": _ONLY_FSDP,
    "parallelism.expert_parallel_degree": _ONLY_FSDP, "parallelism.expert_tensor_parallel_degree": _ONLY_FSDP,
    "parallelism.context_parallel_degree": ">= 1",
    "parallelism.context_parallel_load_balancer": "any: unused, attnlab/attention/cp.py balances the causal "
                                                  "load itself (2N chunks a sequence)",
    "parallelism.module_fqns_per_model_part": "any: " + _AC,
    "parallelism.pipeline_parallel_first_stage_less_layers": "any: " + _AC,
    "parallelism.pipeline_parallel_last_stage_less_layers": "any: " + _AC,
    "parallelism.pipeline_parallel_layers_per_stage": "any: " + _AC,
    "parallelism.pipeline_parallel_schedule": "any: " + _AC,
    "parallelism.pipeline_parallel_schedule_csv": "any: " + _AC,
    "parallelism.pipeline_parallel_microbatch_size": "any: " + _AC,
    "checkpoint.folder": "non-empty",
    "checkpoint.interval": "> 0", "checkpoint.keep_latest_k": "0 or >= 2", "checkpoint.load_step": ">= -1",
    "checkpoint.initial_load_path": "any: a checkpoint folder, read only while the run has no checkpoint yet (a "
                                    "shipped TOML names one a first run creates); the run guard checks it then",
    "checkpoint.exclude_from_loading": "one of model, optimizer, lr_scheduler, dataloader, train_state",
    "activation_checkpoint.selective_ac_option": "a positive integer as text or one of op",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": "any: module names; a name no module "
                                                                         "has matches nothing",
    "activation_checkpoint.memory_budget": "in [0, 1]",
    "activation_checkpoint.determinism_check": "one of default, none",
    "compile.components": "one of model, loss",
    "compile.backend": "any: a torch.compile backend (inductor, aot_eager, ...), which torch names when unknown",
    "quantize.linear.float8.filter_fqns": "any: module names kept out of float8; a name no module has matches nothing",
    "quantize.linear.mx.recipe_name": "non-empty",
    "quantize.linear.mx.filter_fqns": "any: module names kept out of MX; a name no module has matches nothing",
    "quantize.grouped_mm.float8.fqns": "any: unused, the model has no grouped (MoE) matmuls",
    "quantize.grouped_mm.mx.fqns": "any: unused, the model has no grouped (MoE) matmuls",
    "comm.init_timeout_seconds": "> 0", "comm.train_timeout_seconds": "> 0", "comm.trace_buf_size": ">= 0",
    "comm.save_traces_folder": "non-empty",
    "comm.save_traces_file_prefix": "any: a file name prefix",
    "fault_tolerance.process_group": "any: " + _FT, "fault_tolerance.process_group_timeout_ms": "any: " + _FT,
    "fault_tolerance.replica_id": "any: " + _FT, "fault_tolerance.group_size": "any: " + _FT,
    "fault_tolerance.min_replica_size": "any: " + _FT, "fault_tolerance.semi_sync_method": "any: " + _FT,
    "experimental.custom_import": "any: a dotted module name, imported before the configuration is read "
                                  "(an import that fails is an error naming it)",
    "experimental.custom_args_module": "empty; model arguments come from [model] (attnlab/models/args.py)",
    "validation.dataset": "any: a name for the log; validation.dataset_path says what is read",
    "validation.dataset_path": "any: as training.dataset_path",
    "validation.local_batch_size": "> 0", "validation.seq_len": "> 0", "validation.freq": "> 0",
    "validation.steps": "-1 or > 0",
    "debug.seed": "in [0, 4294967296)",
}
"""The valid values of torchtitan's keys (its dataclasses are not ours to annotate), in the words of
:mod:`attnlab.config.rules`; our own keys declare theirs next to the field. Booleans and ``Literal`` keys need none:
their type is the whole rule."""


def iter_keys(cls, prefix: str = ""):
    """(dotted key, annotation, dataclass field) of every leaf key of the config class ``cls``, nested tables
    walked."""
    return _leaf_keys(cls, prefix)


@functools.cache
def _leaf_keys(cls, prefix: str) -> tuple:
    out = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls).get(f.name, f.type)
        if dataclasses.is_dataclass(tp):
            out += _leaf_keys(tp, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", tp, f))
    return tuple(out)


def rule_for(key: str, f) -> str | None:
    """The declared rule of ``key``: its field's metadata, else :data:`TITAN_RULES`."""
    return rules.rule_of(f) or TITAN_RULES.get(key)


def check_rules(job_config) -> None:
    """Every key against its declared rule (:mod:`attnlab.config.rules`)."""
    for key, _, f in iter_keys(type(job_config)):
        rule = rule_for(key, f)
        if rule is not None:
            value = functools.reduce(getattr, key.split("."), job_config)
            rules.check_value(key, value, rule, job_config)


def check_layer_pattern(pattern: list[str], n_layers: int) -> None:
    """``model.layer_pattern`` repeats over depth (models/args.py ``layer_mechanisms``): one longer than the
    ``n_layers`` layers would drop its tail, so its mechanisms would never be built."""
    if n_layers and len(pattern) > n_layers:
        raise ValueError(f"model.layer_pattern has {len(pattern)} entries {pattern} but the model has n_layers="
                         f"{n_layers}: the entries past layer {n_layers} would never be built; give at most "
                         "n_layers entries")


def check_context_parallel(job_config) -> None:
    """``parallelism.context_parallel_degree = N`` (attnlab/attention/cp.py): every layer's mechanism runs under it, the
    sequences split into 2N equal chunks, no kernel or compile path that cannot take a shard of a row."""
    cp, m = job_config.parallelism.context_parallel_degree, job_config.model
    key = "parallelism.context_parallel_degree"
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


def check_world_size(job_config, world_size: int) -> None:
    """The parallel degrees against the number of processes, as torchtitan's ``ParallelDims`` asserts them (there a
    bare AssertionError after the process group is up): data_parallel_replicate x data_parallel_shard (-1 = the
    rest) x context_parallel = world size; and the global batch a multiple of local batch x data-parallel degree."""
    p = job_config.parallelism
    rep, shard, cp = p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.context_parallel_degree
    others = rep * cp * p.tensor_parallel_degree * p.pipeline_parallel_degree
    names = f"parallelism.data_parallel_replicate_degree={rep} x parallelism.context_parallel_degree={cp}"
    if shard < 0:
        if world_size % others:
            raise ValueError(f"{names} = {others} does not divide the {world_size} processes of this run (WORLD_SIZE;"
                             " launch with torchrun --nproc_per_node)")
        shard = world_size // others
    elif shard * others != world_size:
        raise ValueError(f"parallelism.data_parallel_shard_degree={shard} x {names} = {shard * others}, but this run "
                         f"has {world_size} process(es) (WORLD_SIZE): launch as many with torchrun --nproc_per_node, "
                         "or set the degrees to multiply to the number of processes")
    g, local = job_config.training.global_batch_size, job_config.training.local_batch_size
    if g > 0 and g % (local * rep * shard):
        raise ValueError(f"training.global_batch_size={g}: must be a multiple of training.local_batch_size={local} x "
                         f"the data-parallel degree {rep * shard} = {local * rep * shard}")


def check_float8_device(job_config, capability: tuple[int, int] | None) -> None:
    """``model.converters`` with ``quantize.linear.float8`` needs float8 matmuls: a CUDA GPU of compute capability
    >= 8.9 (``capability``: the device's, None without CUDA), unless ``quantize.linear.float8.emulate``."""
    if "quantize.linear.float8" not in job_config.model.converters or job_config.quantize.linear.float8.emulate:
        return
    if capability is None or tuple(capability) < (8, 9):
        found = "no CUDA GPU" if capability is None else f"a GPU of compute capability {capability[0]}.{capability[1]}"
        raise ValueError(f"model.converters=['quantize.linear.float8']: float8 training needs a CUDA GPU with compute "
                         f"capability >= 8.9 (found {found}); remove it from model.converters (--model.converters "
                         '""), or set quantize.linear.float8.emulate = true to test the code path slowly')


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
    check_rules(job_config)
    check_layer_pattern(job_config.model.layer_pattern, job_config.model.n_layers)
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
    if p.context_parallel_degree != 1:
        check_context_parallel(job_config)
    if job_config.training.loss_chunk_tokens:
        check_loss_chunks(job_config)
