"""The registry suites' columns beyond validation perplexity, for one finished run, in one process on its GPU:
perplexity on an out-of-domain text, the loss by context position out to 4× the training length, passkey retrieval
at 1× and 2× the training length (10 keys at each of 5 depths; a length shorter than the prompt's fixed text is
left out), the trained weights on the mechanism's float64 reference against its own paths (:func:`reference_gap`),
and (for the run that carries it) the synthetic MQAR quick sweep of its mechanism.

    python -m benchmarks.replicate --evaluate RUN_DIR --val VAL [--ood PATH] [--synthetic MECH --seed S]

Writes ``RUN_DIR/eval.json`` (:func:`columns` reads it back into the table's row). Every part goes through the
tools' own functions (``attnlab.tools.eval_ppl``, ``passkey``, ``synthetic``), so a column means what that tool
prints. The run's model is loaded once, in float32 (the trained weights; training ran under bf16 autocast).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

EVAL_FILE = "eval.json"
CONTEXT_MULTIPLE = 4
"""The by-position loss runs out to this many times the training sequence length."""
PASSKEY_MULTIPLES = (1, 2)
"""Passkey prompt lengths, in training sequence lengths."""
BATCH_ROWS = 8  # rows per forward pass; a 68M model at 4 × 1024 tokens fits many times over
REFERENCE_ROWS = 2
"""Validation rows of the float64 reference check (the references are the slow, readable forms)."""


def evaluate_run(dump: str, val: str, ood: str | None, synthetic: str | None, seed: int, device: str) -> dict:
    """The columns of the run folder ``dump`` (module docstring), also written to ``<dump>/eval.json``."""
    from attnlab.data.loader import build_tokenizer
    from attnlab.tools import eval_ppl, passkey
    from attnlab.tools.common import load_run

    ap = eval_ppl.build_parser()
    args = ap.parse_args([dump, "--data", val, "--device", device])
    t0 = time.time()
    model, cfg, _ = load_run(ap, args, [])
    tok = build_tokenizer(cfg)
    trained = cfg.training.seq_len
    res: dict = {"train_seq_len": trained, "attention": cfg.model.attention}
    if ood:
        r = eval_ppl.evaluate(model, eval_ppl.packed_rows(ood, cfg, tok, trained), BATCH_ROWS, device=device,
                              progress=False)
        res["ood"] = {"data": ood, "ppl": r["ppl"], "loss": r["loss"], "tokens": r["tokens"]}
    long = CONTEXT_MULTIPLE * trained
    r = eval_ppl.evaluate(model, eval_ppl.packed_rows(val, cfg, tok, long), BATCH_ROWS, device=device,
                          progress=False, edges=eval_ppl.position_edges(long))
    res["by_position"] = {"seq_len": long, "data": val, "buckets": r["by_position"]}
    encode = lambda text: tok.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    keys = passkey.draw_keys(10, 0)
    shortest = max(passkey.tokenize(encode, tok.bos_id, k).min_length for k in keys)
    lengths = [m * trained for m in PASSKEY_MULTIPLES if m * trained >= shortest]  # a prompt needs its intro
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    cells = passkey.evaluate(model, encode, tok.bos_id, lengths, depths, keys, 4, device)
    res["passkey"] = {"depths": depths, "samples": 10, "results": cells,
                      "accuracy": {str(n): sum(c["accuracy"] for c in cells if c["length"] == n) / len(depths)
                                   for n in lengths}}
    res["reference"] = reference_gap(dump, model, eval_ppl.packed_rows(val, cfg, tok, trained), device)
    res["eval_s"] = round(time.time() - t0, 1)
    del model
    if synthetic:
        res["synthetic"] = mqar(synthetic, seed, device)
    with open(os.path.join(dump, EVAL_FILE), "w") as f:
        json.dump(res, f, indent=1)
    return res


@torch.no_grad()
def reference_gap(dump: str, model, rows, device: str, n_rows: int = REFERENCE_ROWS) -> dict:
    """The trained model on its own paths (``model``, float32) against the same weights on every mechanism's
    readable PyTorch reference in float64 (``attention.impl = "reference"``), over the first ``n_rows`` validation
    rows: the relative error of the logits and the loss difference. A kernel that is right on the tests' random
    weights but wrong on trained ones (a gate range, a scale) shows here; float32 against float64 alone leaves
    ~1e-5 to 1e-4."""
    import torch.nn.functional as F

    from attnlab.checkpoint.load import load_model

    ref, _, _ = load_model(dump, ["--attention.impl", "reference"], device=device, dtype=torch.float64)
    x, pos, y = (torch.stack(t).to(device) for t in zip(*[r for _, r in zip(range(n_rows), rows)]))
    fast, slow = model(x, pos).double(), ref(x, pos)
    loss = [F.cross_entropy(z.flatten(0, 1), y.flatten()).item() for z in (fast, slow)]
    return {"rows": x.shape[0], "tokens": y.numel(), "rel_err": ((fast - slow).norm() / slow.norm()).item(),
            "loss": loss[0], "loss_reference": loss[1]}


def mqar(mechanism: str, seed: int, device: str) -> dict:
    """The quick sweep's MQAR cell of ``attnlab.tools.synthetic`` (its sizes, steps, batch and lr) for
    ``mechanism``."""
    from attnlab.tools import synthetic

    r, = synthetic.main(["--attention", mechanism, "--tasks", "mqar", "--sweep", "quick", "--seed", str(seed),
                         "--device", device])
    return {"task": r["task"], "mechanism": mechanism, "seed": seed, "acc": r["acc"], "vocab": r["vocab"],
            "seq_len": r["seq_len"], "seconds": round(r["seconds"], 1)}


def columns(dump: str) -> dict:
    """The table's columns from ``<dump>/eval.json`` ({} when it has none): ``ood_ppl``; ``pos_ppl`` (the
    perplexity of the by-position buckets from half the training length on: ``"512"`` for [512, 1024), ...);
    ``passkey_1x`` / ``passkey_2x`` (accuracy) and ``passkey_logp`` (the key's mean log-probability at 1×); ``mqar``;
    ``ref_err`` (:func:`reference_gap`'s relative error of the logits)."""
    path = os.path.join(dump, EVAL_FILE)
    if not os.path.isfile(path):
        return {}
    e = json.load(open(path))
    half = e["train_seq_len"] // 2
    out = {"ood_ppl": e.get("ood", {}).get("ppl"), "passkey_logp": _mean_logp(e["passkey"], e["train_seq_len"]),
           "pos_ppl": {str(b["start"]): b["ppl"] for b in e["by_position"]["buckets"] if b["start"] >= half},
           **{f"passkey_{m}x": e["passkey"]["accuracy"].get(str(m * e["train_seq_len"])) for m in PASSKEY_MULTIPLES}}
    if "synthetic" in e:
        out["mqar"] = e["synthetic"]["acc"]
    if "reference" in e:
        out["ref_err"] = e["reference"]["rel_err"]
    return out


def _mean_logp(passkey: dict, length: int) -> float | None:
    """The mean log-probability of the key at prompt length ``length`` (a graded signal where accuracy is 0)."""
    cells = [c["logprob"] for c in passkey.get("results", []) if c["length"] == length]
    return sum(cells) / len(cells) if cells else None


def main(argv: list[str]) -> dict:
    """``--evaluate RUN_DIR ...``: the child process the suite starts on the run's GPU."""
    from attnlab.tools.common import add_device_argument

    ap = argparse.ArgumentParser(prog="python -m benchmarks.replicate --evaluate")
    ap.add_argument("dump", help="a finished run folder")
    ap.add_argument("--val", required=True, help="the validation text (the by-position loss)")
    ap.add_argument("--ood", default=None, help="the out-of-domain text, a file, folder or glob")
    ap.add_argument("--synthetic", default=None, help="also the MQAR quick sweep of this mechanism")
    ap.add_argument("--seed", type=int, default=0, help="seed of the MQAR run")
    add_device_argument(ap)
    a = ap.parse_args(argv)
    # not timed: one tile per kernel (ours and fla's) instead of autotuning every new shape (fp32, 4x the length)
    os.environ["ATTNLAB_AUTOTUNE"] = "first"
    res = evaluate_run(a.dump, a.val, a.ood, a.synthetic, a.seed, a.device)
    print(json.dumps(columns(a.dump)), flush=True)
    return res
