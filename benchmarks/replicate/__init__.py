"""Small-scale replication of the Parallax paper's direction: equal-token runs of a ~68M model.

    python -m benchmarks.replicate --corpus DIR --out DIR [--budget-s 520] [--runs all]
        [--steps 300 --batch 64 --seq-len 1024 --flavor repl-68M] [--val-tokens 0] [--no-analyze]
    python -m benchmarks.replicate --corpus DIR --out DIR --suite dose|horizon|adamw|context|registry|registry_long
        [--seeds 0,1] [--runs ARMS] [--ood TEXT]
        [--budget-s 540] [--chunk-steps N] [--best-gain 0.1] [--gains 1,0.3,0.1] [--adamw-lrs 5e-4,1e-3,2e-3] [--gpus N]
        [--arm-gpus ARM=N,...]

Suites (the probe's starting strength, the horizon, the mask) are named arm sets at fixed steps, each
arm run once per seed (``<arm>_s<seed>``, ``--debug.seed``), in ``<out>/<suite>/`` with the tokenizer shared in
``<out>/tokenizer`` (see :func:`benchmarks.replicate.plan.suite_arms`); ``--gpus N`` trains N runs at once, one per GPU
(``--arm-gpus ARM=N``: that arm data-parallel over N of them, for an arm too slow to finish in one call):

- ``dose`` (160 steps, Muon): softmax; Parallax at each ``--gains`` starting ρ-norm gain
  (``attention.parallax.rho_norm_init``); Parallax at ``--best-gain`` with the ρ-norm lr at 1× optimizer.lr
  (``optimizer.lr_mult_patterns``) instead of the norm group's 0.015×;
- ``horizon`` (1,600 steps, validation every 200): softmax and Parallax at gain 1 and at ``--best-gain`` under
  Muon, and at ``--best-gain`` with the ρ-norm lr at 1×; softmax and Parallax (gain 1) under AdamW at each of
  ``--adamw-lrs`` (with ``--adamw-warmup N`` steps of linear warmup);
- ``adamw`` (400 steps, validation every 100): the AdamW lr sweep alone, softmax and Parallax (gain 1) at each
  ``--adamw-lrs``, shorter than the horizon so that the sweep is affordable; the horizon's AdamW pair then runs at
  the lr it picks (``--suite horizon --adamw-lrs LR``);
- ``context`` (160 steps, sequence 4096, batch 16: the same tokens per step as 64 × 1024): softmax, Parallax at
  gain 1 and at ``--best-gain``, each with ``causal`` and ``block_causal`` masks;
- ``registry`` (160 steps = 10.5M tokens, validation every 40): every registered mechanism with its registered defaults, one arm named
  after it, plus a second arm where its paper prescribes another init (``plan.PAPER_ARMS``); a mechanism registered
  as reference-only (no fast path) is listed as not trained, with the registry's reason. A newly registered
  mechanism joins without edits;
- ``registry_long`` (1,600 steps = 105M tokens, validation and checkpoints every 200): the same for
  ``plan.LONG_MECHANISMS`` (softmax, Parallax, LLA, HLA, CALA, GDN, KDA).

The two registry suites also evaluate each finished run on its GPU (:mod:`benchmarks.replicate.evaluate`,
``<run>/eval.json``): perplexity on ``--ood`` (an out-of-domain text kept out of training), the loss by context
position out to 4× the training length, passkey retrieval at 1× and 2×, and for the first of ``--seeds`` of a mechanism's own arm the
quick MQAR cell of ``attnlab.tools.synthetic``. Their table has a row per arm (mean and range over seeds, tokens/s,
peak GiB, those columns) and flags what needs a write-up: more than 25 % worse than softmax, a loss spike, a run
that did not finish.

A suite run fits device calls of limited length: ``--budget-s`` is this call's wall time, a run trains in chunks
of at most ``--chunk-steps`` steps (``training.stop_after_step``; a full checkpoint at each stop) sized to what fits
in the time left, and a run that does not finish is paused with a resumable checkpoint; the same command resumes
it from ``<run>/checkpoint`` (and skips finished runs) until the table has every run. ``<out>/<suite>/table.txt``
and ``summary.json`` keep the rows of earlier calls (other seeds or arms) beside this call's.

Runs (each ``steps`` × batch × seq tokens, equal for all but ``converted``; Parallax with the paper's ρ-norm gain 1):

| run               | mixer    | optimizer / schedule                                     |
|-------------------|----------|----------------------------------------------------------|
| softmax_muon      | softmax  | Muon lr 5e-3 wd 0.1, WSD (decay last 20 %)               |
| parallax_muon     | parallax | same                                                     |
| softmax_adamw     | softmax  | AdamW lr 1e-3 wd 0.1 β (0.9, 0.95), WSD                   |
| parallax_adamw    | parallax | same                                                     |
| parallax_muon_wd2 | parallax | Muon + weight-decay annealing γ = 2 (eq. 42)              |
| converted         | parallax | softmax_muon's checkpoint → Parallax with W_R = 0 (attnlab.tools.convert_to_parallax), fine-tuned steps/4 more |
| gdn_muon          | gdn      | Muon, WSD; runs last (see the budget)                    |

Pipeline: a BPE tokenizer (``--vocab`` tokens) is trained on the first ``--tokenizer-docs`` documents of
``train-00.jsonl.gz`` (cached in ``<out>/tokenizer``; ``--tokenizer DIR`` reuses one); every run trains through
``train.py`` in its own process (base config ``attnlab/configs/replication/repl_base.toml``, bf16 autocast, compiled
on CUDA, one data-loader worker) on all ``train-*.jsonl.gz`` of ``--corpus`` and validates on the first
``--val-tokens`` tokens of ``val.jsonl.gz`` (full batches only) at its last step. Softmax/Parallax runs are
analysed with ``attnlab.tools.analyze`` (on the CPU) in the background while the next run trains; checkpoints are
deleted afterwards (``--keep-checkpoints`` keeps them) so ``<out>`` stays small. A failed run is reported in the table
and does not stop the others. Outputs, all under ``<out>``: ``summary.json``, ``table.txt`` (also printed last),
``ppl.png`` (perplexity curves of all runs), ``diagnostics_by_layer.png`` (COR/CPA/entropy/sink per layer of
every analysed run), ``<run>/{metrics.jsonl,train.log,analysis/}``, ``calibration/``.

Budget (``--budget-s``, total wall seconds from the start of this script): after the tokenizer, a short
calibration run (``--calib-steps`` steps) per mechanism (softmax, parallax, gdn) measures the fixed cost per run
(process start, compile, validation) and the training tokens/s, and warms the shared compile cache
(TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR, default ``/tmp/repl_compile_cache``); with compile on, softmax is
calibrated once more (warm cache) and every fixed cost is scaled by its warm/cold ratio. Then ``steps`` is the largest
value for which 2 softmax runs, 3 Parallax runs, the converted fine-tune (steps/4) and one more Parallax-sized
slot for GDN fit in the time left. GDN runs last and gets ``min(steps, what fits in the remaining time)``: equal
tokens if it is fast enough or the fixed costs were overestimated,
fewer otherwise (the table says so). AdamW lr: the paper's 3e-4 is for 0.6B/20k steps; a short run of a ~68M
model needs a larger one, but 3e-3 without warmup was unstable (softmax val ppl 483 against 91 under Muon at 10.5M
tokens), hence 1e-3.

The package, by job: :mod:`~benchmarks.replicate.plan` (the runs, the suites' arms and their flags, the budget
arithmetic), :mod:`~benchmarks.replicate.run` (the tokenizer, launching and resuming runs, calibration, background
analyses, the end of a call), :mod:`~benchmarks.replicate.metrics` (reading run folders and summary.json),
:mod:`~benchmarks.replicate.report` (the table and the diagnostics plot) and ``__main__`` (the command line).
"""
