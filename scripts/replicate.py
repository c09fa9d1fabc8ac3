"""Small-scale replication of the Parallax paper's direction (issue 7): equal-token runs of a ~45M model.

    python scripts/replicate.py [--corpus ../shared/corpus] [--out runs/replication] [--runs all]
        [--steps 300 --batch 16 --seq-len 512 --flavor repl-45M] [--no-analyze]

Runs (each ``training.steps`` × batch × seq tokens; one H100, about a minute each):

| run               | mixer    | optimizer / schedule                                     |
|-------------------|----------|----------------------------------------------------------|
| softmax_muon      | softmax  | Muon lr 5e-3 wd 0.1, WSD (decay last 20 %)               |
| parallax_muon     | parallax | same                                                     |
| softmax_adamw     | softmax  | AdamW lr 3e-3 wd 0.1 β (0.9, 0.95), WSD                   |
| parallax_adamw    | parallax | same                                                     |
| parallax_muon_wd2 | parallax | Muon + weight-decay annealing γ = 2 (eq. 42)              |
| gdn_muon          | gdn      | Muon, WSD                                                |
| converted         | parallax | softmax_muon's weights + W_R = 0, fine-tuned steps/4 more |

Steps: a BPE tokenizer (8192 tokens) is trained on the first documents of ``train-00.jsonl.gz`` (cached in
``<out>/tokenizer``); every run trains through ``train.py`` (base config ``configs/replication/repl45m_base.toml``)
and validates on the whole ``val.jsonl.gz`` at its last step; Parallax/softmax runs are analysed with
``scripts/analyze.py``. A failed run is reported in the table and does not stop the others. The last output
is a table of validation perplexities (and COR / W_R stable rank for Parallax runs), also written to
``<out>/summary.json``. Lead: copy ``train-00.jsonl.gz`` and ``val.jsonl.gz`` to the GPU machine and pass
``--corpus``. AdamW lr: the paper's 3e-4 is for 0.6B/20k steps; 300 steps of a 45M model need a larger one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
BASE = os.path.join(REPO, "configs", "replication", "repl45m_base.toml")

ADAMW = ["--optimizer.name", "adamw", "--optimizer.lr", "3e-3", "--optimizer.beta1", "0.9", "--optimizer.beta2", "0.95",
         "--optimizer.eps", "1e-8"]
RUNS: dict[str, list[str]] = {
    "softmax_muon": ["--model.attention", "softmax"],
    "parallax_muon": ["--model.attention", "parallax"],
    "softmax_adamw": ["--model.attention", "softmax", *ADAMW],
    "parallax_adamw": ["--model.attention", "parallax", *ADAMW],
    "parallax_muon_wd2": ["--model.attention", "parallax", "--lr_scheduler.wd_anneal_gamma", "2.0"],
    "gdn_muon": ["--model.attention", "gdn"],
    "converted": ["--model.attention", "parallax", "--optimizer.lr_warmup_patterns", "\\.wr\\.",
                  "--optimizer.lr_warmup_steps", "10"],
}


def train_tokenizer(corpus: str, out: str, vocab: int, n_docs: int) -> str:
    """Byte-level BPE with <|bos|>/<|eos|> trained on the first ``n_docs`` training documents (cached)."""
    import gzip

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if os.path.isfile(os.path.join(out, "tokenizer.json")):
        return out
    os.makedirs(out, exist_ok=True)

    def texts():
        with gzip.open(os.path.join(corpus, "train-00.jsonl.gz"), "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= n_docs:
                    return
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}, f)
    return out


def train_one(argv: list[str]) -> None:
    """``train.py`` in this process."""
    import train

    train.main(argv)


def convert_softmax_to_parallax(src_run: str, dst: str, argv: list[str]) -> str:
    """Write softmax_muon's weights plus W_R = 0 (ρ = 0: exactly the softmax model) as a model-only DCP."""
    import torch
    import torch.distributed.checkpoint as dcp

    from models.checkpoint_io import build_model, load_config, load_weights, model_args_from_config, resolve_step_dir

    step_dir = resolve_step_dir(src_run)
    cfg = load_config(argv, step_dir)
    model = build_model(model_args_from_config(cfg), "cpu")
    missing = load_weights(model, step_dir, strict=False)
    if any(not (".wr." in k or ".r_norm." in k) for k in missing):
        raise ValueError(f"softmax checkpoint lacks non-probe keys: {missing}")
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wr.weight.zero_()
            layer.attention.r_norm.reset_parameters()
    os.makedirs(dst, exist_ok=True)
    dcp.save(model.state_dict(), checkpoint_id=dst, no_dist=True)
    return dst


def _run(cmd: list[str], log: str, timeout: int) -> tuple[bool, float]:
    t0 = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    return rc == 0, time.time() - t0


def _val(run_dir: str) -> dict:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    recs = [json.loads(line) for line in open(path)]
    val = [r for r in recs if "val_loss" in r]
    train = [r for r in recs if "loss" in r]
    return {"val_loss": val[-1]["val_loss"] if val else None, "val_ppl": val[-1]["val_ppl"] if val else None,
            "train_loss": train[-1]["loss"] if train else None, "step": train[-1]["step"] if train else None}


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--train-one"]:
        return train_one(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_corpus = next((p for p in (os.path.join(REPO, "..", "shared", "corpus"), os.path.join(REPO, "shared", "corpus"))
                           if os.path.isdir(p)), "../shared/corpus")
    ap.add_argument("--corpus", default=default_corpus, help="folder with train-00.jsonl.gz and val.jsonl.gz")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "replication"))
    ap.add_argument("--runs", default="all", help=f"comma-separated subset of {list(RUNS)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--flavor", default="repl-45M")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokenizer-docs", type=int, default=20000)
    ap.add_argument("--val-steps", type=int, default=-1, help="validation batches (-1 = the whole val file)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--no-analyze", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="retrain runs that already finished in --out")
    ap.add_argument("extra", nargs="*", help="more train.py flags for every run (after --)")
    args = ap.parse_args(argv)
    names = list(RUNS) if args.runs == "all" else args.runs.split(",")
    if "converted" in names and "softmax_muon" not in names:
        names.insert(0, "softmax_muon")
    os.makedirs(args.out, exist_ok=True)
    tok = train_tokenizer(args.corpus, os.path.join(args.out, "tokenizer"), args.vocab, args.tokenizer_docs)
    common = ["--job.config_file", BASE, "--model.flavor", args.flavor, "--model.vocab_size", str(args.vocab),
              "--model.hf_assets_path", tok, "--training.dataset_path", os.path.join(args.corpus, "train-00.jsonl.gz"),
              "--validation.dataset_path", os.path.join(args.corpus, "val.jsonl.gz"),
              "--training.seq_len", str(args.seq_len), "--validation.seq_len", str(args.seq_len),
              "--training.local_batch_size", str(args.batch), "--validation.local_batch_size", str(args.batch),
              "--validation.steps", str(args.val_steps), *args.extra]
    results = []
    for name in names:
        dump = os.path.join(args.out, name)
        steps = args.steps if name != "converted" else max(1, args.steps // 4)
        flags = [*common, *RUNS[name], "--job.dump_folder", dump, "--training.steps", str(steps)]
        row = {"run": name, "steps": steps, "tokens": steps * args.batch * args.seq_len}
        try:
            if name == "converted":
                src = os.path.join(args.out, "softmax_muon")
                init = convert_softmax_to_parallax(src, os.path.join(args.out, "converted_init"),
                                                   [*common, *RUNS["converted"]])
                flags += ["--checkpoint.initial_load_path", init, "--checkpoint.initial_load_model_only"]
            done = _val(dump)
            stale = name == "converted" and any(r["run"] == "softmax_muon" and not r.get("cached") for r in results)
            if not args.fresh and not stale and done.get("step") == steps and done.get("val_loss") is not None:
                ok, secs = True, 0.0  # finished earlier: reuse (e.g. softmax_muon for `--runs converted`)
                row.update(**done, ok=ok, seconds=secs, cached=True)
                print(json.dumps(row), flush=True)
                results.append(row)
                continue
            shutil.rmtree(dump, ignore_errors=True)  # a model-only final checkpoint cannot be resumed
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, "train_args.json"), "w") as f:
                json.dump(flags, f)
            ok, secs = _run([sys.executable, __file__, "--train-one", *flags], os.path.join(dump, "train.log"), args.timeout)
        except Exception as e:  # conversion failures etc.: report, go on
            ok, secs, row["error"] = False, 0.0, f"{type(e).__name__}: {e}"
        row.update(ok=ok, seconds=round(secs, 1), **_val(dump))
        if ok and not args.no_analyze and any(m in name for m in ("softmax", "parallax", "converted")):
            a_ok, _ = _run([sys.executable, os.path.join(REPO, "scripts", "analyze.py"), dump, "--data",
                            os.path.join(args.corpus, "val.jsonl.gz"), "--rows", "8", "--queries", "16",
                            "--seq-len", str(args.seq_len)], os.path.join(dump, "analyze.log"), args.timeout)
            summary = os.path.join(dump, "analysis", "analysis.json")
            if a_ok and os.path.isfile(summary):
                s = json.load(open(summary))["summary"]
                row.update({k: s.get(k) for k in ("cor", "entropy", "sink_p", "srank_wr", "srank_wq")})
        print(json.dumps(row), flush=True)
        results.append(row)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(format_table(results))
    return results


def format_table(rows: list[dict]) -> str:
    fmt = lambda v, spec: f"{'-':>{int(float(spec[:-1]))}}" if v is None else format(v, spec)  # noqa: E731
    head = f"{'run':<18}{'steps':>6}{'tokens':>11}{'val_ppl':>9}{'val_loss':>9}{'COR':>7}{'srankWr':>8}{'sec':>7}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['run']:<18}{r['steps']:>6}{r['tokens']:>11,}{fmt(r.get('val_ppl'), '9.2f')}"
                     f"{fmt(r.get('val_loss'), '9.4f')}{fmt(r.get('cor'), '7.3f')}{fmt(r.get('srank_wr'), '8.2f')}"
                     f"{r['seconds']:>7.0f}  {'ok' if r['ok'] else 'FAILED ' + r.get('error', 'see train.log')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
