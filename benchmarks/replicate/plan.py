"""What the replication trains: the runs and each suite's arms with their train.py flags, the base config, and
the steps that fit a time budget (whole runs, or a run's next chunk)."""

from __future__ import annotations

import math

from attnlab import configs

BASE = str(configs.path("replication/repl_base"))
"""The base config of every run (``attnlab/configs/replication/repl_base.toml``)."""

ADAMW_NO_LR = ["--optimizer.name", "adamw", "--optimizer.beta1", "0.9", "--optimizer.beta2", "0.95",
               "--optimizer.eps", "1e-8"]
ADAMW = [*ADAMW_NO_LR, "--optimizer.lr", "1e-3"]
PAPER_GAIN = "1"  # the replication runs' ρ-norm gain: the paper's recipe as written (the framework default is 0.1)
PARALLAX = ["--model.attention", "parallax", "--attention.parallax.rho_norm_init", PAPER_GAIN]
RUNS: dict[str, list[str]] = {  # in run order: converted needs softmax_muon; gdn_muon takes what time is left
    "softmax_muon": ["--model.attention", "softmax"],
    "parallax_muon": PARALLAX,
    "softmax_adamw": ["--model.attention", "softmax", *ADAMW],
    "parallax_adamw": [*PARALLAX, *ADAMW],
    "parallax_muon_wd2": [*PARALLAX, "--lr_scheduler.wd_anneal_gamma", "2.0"],
    "converted": [*PARALLAX, "--optimizer.lr_warmup_patterns", "\\.wr\\.",
                  "--optimizer.lr_warmup_steps", "10"],
    "gdn_muon": ["--model.attention", "gdn"],
}
CONVERTED_FRACTION = 4  # the converted fine-tune trains steps // 4 steps
ANALYZED = ("softmax", "parallax", "converted")
SUITES = {  # suite -> steps, validation.freq and checkpoint.interval (0 = none: validation at the first and last
    # step, checkpoints at chunk stops and the end), seq_len, batch (None = --seq-len/--batch)
    "dose": dict(steps=160, val_freq=0, ckpt_every=0, seq_len=None, batch=None),
    "horizon": dict(steps=1600, val_freq=200, ckpt_every=200, seq_len=None, batch=None),
    "context": dict(steps=160, val_freq=0, ckpt_every=0, seq_len=4096, batch=16),
    "adamw": dict(steps=400, val_freq=100, ckpt_every=0, seq_len=None, batch=None),
    "registry": dict(steps=160, val_freq=40, ckpt_every=0, seq_len=None, batch=None),
    "registry_long": dict(steps=1600, val_freq=200, ckpt_every=200, seq_len=None, batch=None),
}
EVALUATED = ("registry", "registry_long")
"""Suites whose runs also get the columns of :mod:`benchmarks.replicate.evaluate` (out-of-domain perplexity, loss
by position, passkey, MQAR)."""
LONG_MECHANISMS = ("softmax", "parallax", "lla", "hla", "cala", "gdn", "kda")
"""The mechanisms of ``registry_long`` (105M tokens): the baselines and the papers this project exists for."""
PAPER_ARMS: dict[str, dict[str, list[str]]] = {
    # App. F.1: an RMSNorm on ρ at its usual gain 1 (the registered default starts it at 0.1)
    "parallax": {"parallax_paper_g1": ["--attention.parallax.rho_norm_init", PAPER_GAIN]},
    # eq. 27: λ per token from a sigmoid of the input (the registered default learns one λ per head)
    "lla": {"lla_paper_token_lambda": ["--attention.lla.lambda_mode", "token"]},
    # eq. 12: ρ = W_R x unscaled (the registered default scales it by head_dim^-1/2)
    "affine_linear": {"affine_linear_paper_unscaled": ["--attention.affine_linear.rho_scale", "false"]},
    # §5.2 (drop-in use): the baseline's positional encodings, RoPE on q and k (the registered default has none)
    "hla": {"hla_paper_rope": ["--attention.hla.rope", "true"]},
    # step 5: a kernel-approximating global feature map, e.g. FAVOR+ (the registered default is elu+1)
    "cala": {"cala_paper_favor": ["--attention.cala.feature_map", "favor"]},
    # Katharopoulos et al.: the denominator φ(q)·Σφ(k), no output norm (registered default: fla's RMSNorm instead)
    "linear": {"linear_paper_normalized": ["--attention.linear.normalize", "true", "--attention.linear.output_norm",
                                           "none"]},
}
"""Second arms of a mechanism whose paper prescribes another init or lr than its registered default: arm name ->
the flags added to the mechanism's (the first arm is always the registered default)."""
RHO_NORM_LR_1X = ["--optimizer.lr_mult_patterns", "\\.r_norm\\.=1"]  # ρ-norm gain at 1× optimizer.lr


def _gain(g: float) -> list[str]:
    """Flags of a Parallax arm whose ρ-norm gain starts at ``g``."""
    return ["--model.attention", "parallax", "--attention.parallax.rho_norm_init", f"{g:g}"]


def suite_arms(suite: str, gains: list[float], best_gain: float, adamw_lrs: list[float],
               adamw_warmup: int = 0) -> dict[str, list[str]]:
    """Arm name -> train.py flags of ``suite`` (see the module docstring), in run order; ``adamw_warmup``: linear
    warmup steps of the AdamW arms (named ``..._wu<N>``; 0 = none, as the Muon arms)."""
    softmax = ["--model.attention", "softmax"]
    if suite == "dose":
        return {"softmax_muon": softmax, **{f"parallax_g{g:g}_muon": _gain(g) for g in gains},
                f"parallax_g{best_gain:g}_rnormlr1_muon": [*_gain(best_gain), *RHO_NORM_LR_1X]}
    if suite in ("horizon", "adamw"):
        arms = {} if suite == "adamw" else {"softmax_muon": softmax, "parallax_g1_muon": _gain(1.0),
                                            f"parallax_g{best_gain:g}_muon": _gain(best_gain),
                                            f"parallax_g{best_gain:g}_rnormlr1_muon": [*_gain(best_gain), *RHO_NORM_LR_1X]}
        for lr in adamw_lrs:
            adamw = [*ADAMW_NO_LR, "--optimizer.lr", f"{lr:g}"]
            wu = [] if not adamw_warmup else ["--lr_scheduler.warmup_steps", str(adamw_warmup)]
            tag = f"_wu{adamw_warmup}" if adamw_warmup else ""
            arms[f"softmax_adamw_lr{lr:g}{tag}"] = [*softmax, *adamw, *wu]
            arms[f"parallax_g1_adamw_lr{lr:g}{tag}"] = [*_gain(1.0), *adamw, *wu]
        return arms
    if suite in EVALUATED:
        return registry_arms(LONG_MECHANISMS if suite == "registry_long" else None)
    if suite == "context":
        arms = {}
        for mask in ("causal", "block_causal"):
            m = ["--model.attn_mask_type", mask]
            arms.update({f"softmax_muon_{mask}": [*softmax, *m], f"parallax_g1_muon_{mask}": [*_gain(1.0), *m],
                         f"parallax_g{best_gain:g}_muon_{mask}": [*_gain(best_gain), *m]})
        return arms
    raise ValueError(f"--suite {suite!r}; choose from {list(SUITES)}")


def registry_arms(names: tuple[str, ...] | None = None) -> dict[str, list[str]]:
    """Arm name -> flags of every registered mechanism (``names``: only these), in registry order: the mechanism
    with its registered defaults, named after it, then its :data:`PAPER_ARMS`. A mechanism registered as
    reference-only (no fast path) has no arm: :func:`excluded` says why."""
    from attnlab.attention import REGISTRY

    arms: dict[str, list[str]] = {}
    for mech, entry in REGISTRY.items():
        if (names is None or mech in names) and not entry.reference_only:
            arms[mech] = ["--model.attention", mech]
            arms.update({arm: ["--model.attention", mech, *flags] for arm, flags in PAPER_ARMS.get(mech, {}).items()})
    return arms


def excluded(suite: str) -> dict[str, str]:
    """Registered mechanisms a registry suite does not train -> the reason the registry gives."""
    from attnlab.attention import REGISTRY

    if suite not in EVALUATED:
        return {}
    return {m: e.reference_only for m, e in REGISTRY.items()
            if e.reference_only and (suite == "registry" or m in LONG_MECHANISMS)}


OBSERVATION_FLAGS = ("--validation.freq", "--metrics.log_freq", "--checkpoint.interval")
"""train.py flags that change what a run records, not what it trains: a run whose flags differ from a suite's
only in these is the same run (it is not retrained, and resumes where it stopped)."""


def training_flags(flags: list[str]) -> list[str]:
    """``flags`` without the :data:`OBSERVATION_FLAGS` and their values: what identifies a run's training."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in OBSERVATION_FLAGS:
            skip = True
        else:
            out.append(f)
    return out


def mechanism(flags: list[str]) -> str:
    """The attention a run's train.py ``flags`` select (the last ``--model.attention``; softmax, the base config's,
    without one)."""
    where = [i for i, f in enumerate(flags) if f == "--model.attention"]
    return flags[where[-1] + 1] if where else "softmax"


def plan_steps(seconds: float, fixed: dict[str, float], tps: dict[str, float], tokens_per_step: int,
               names: list[str] | None = None) -> int:
    """Largest ``steps`` for which the runs ``names`` (default: all) fit in ``seconds``: each softmax/Parallax
    run trains ``steps``, the converted fine-tune (Parallax) ``steps // 4``, and gdn_muon is budgeted as one more
    Parallax-sized run (GDN itself gets what is left at the end, see :func:`fit_steps`). ``fixed[m]`` = seconds
    per run outside the training steps, ``tps[m]`` = training tokens/s, for m in {"softmax", "parallax"} (a
    missing one borrows the other's). Returns 0 when nothing fits."""
    names = list(RUNS) if names is None else names
    total_fixed, per_step = 0.0, 0.0
    for name in names:
        mech = {"gdn": "parallax"}.get(mechanism(RUNS[name]), mechanism(RUNS[name]))
        mech = mech if mech in tps else next(iter(tps))
        total_fixed += fixed[mech]
        per_step += tokens_per_step / tps[mech] / (CONVERTED_FRACTION if name == "converted" else 1)
    return max(0, math.floor((seconds - total_fixed) / per_step))


def fit_steps(seconds: float, fixed: float, tps: float, tokens_per_step: int, cap: int) -> int:
    """Steps of one run that fit in ``seconds`` (at most ``cap``)."""
    return max(0, min(cap, math.floor((seconds - fixed) * tps / tokens_per_step)))


def chunk_stop(current: int, steps: int, chunk: int, seconds: float | None, fixed: float, tps: float,
               tokens_per_step: int) -> int:
    """Step at which the next chunk of a run at ``current`` stops: at most ``chunk`` steps (0 = no limit), at most
    ``steps``, and (with ``seconds``, the time left) only what fits at ``fixed`` s per launch and ``tps`` tokens/s.
    Returns ``current`` when nothing fits."""
    cap = steps - current if chunk <= 0 else min(chunk, steps - current)
    if seconds is not None:
        cap = fit_steps(seconds, fixed, tps, tokens_per_step, cap)
    return current + cap
