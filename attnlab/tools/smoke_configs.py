"""Smoke-test every paper configuration in attnlab/configs/paper/: does it start and train a few steps at a reduced
batch?

    python -m attnlab.tools.smoke_configs --data DATA --tokenizer TOKDIR                        # one GPU, all configs
    python -m attnlab.tools.smoke_configs --data D --tokenizer T --nproc 4 --local-batch 2      # a 4-GPU node
    python -m attnlab.tools.smoke_configs --only 'parallax*' --steps 5 --seq 1024 ...           # fnmatch filter(s)
    python -m attnlab.tools.smoke_configs --only 'qwen3_0.6b_*' --parallel 4 ...                # 4 runs share a GPU
    python -m attnlab.tools.smoke_configs --device cpu --flavor debug --only qwen3_0.6b_softmax -- --model.vocab_size 64

Each config (attnlab/configs/paper/*.toml) runs in its own torchrun
subprocess with --timeout, --steps steps, --local-batch sequences per process (global batch = local x nproc, so
no accumulation), sequence length --seq, checkpoints and validation off, everything else from the TOML
(float8, compile, activation checkpointing, the optimizer). --flavor overrides the model size (e.g. debug on a
CPU); --device cpu also turns off float8 and compile, which need CUDA. Arguments after "--" go to every run.
Prints a table config x (ok/FAILED, seconds, seconds from launch to the first logged step, final loss, tokens/s
per device) and exits 1 if any failed.
``--data`` is a file/folder/glob of JSONL with a "text" field; ``--tokenizer`` a folder with tokenizer.json
(the same arguments as benchmarks/bench_train.py).
"""

from __future__ import annotations

import argparse
import fnmatch
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attnlab import configs as shipped
from attnlab.tools.launch import child_env, train_command



def configs(only: str) -> list[Path]:
    found = sorted((shipped.ROOT / "paper").glob("*.toml"))
    if only:
        pats = only.split(",")
        found = [p for p in found if any(fnmatch.fnmatch(p.stem, pat) or pat == p.stem for pat in pats)]
    return found


def train_args(args, cfg: Path, dump: Path) -> list[str]:
    out = ["--job.config_file", str(cfg), "--job.dump_folder", str(dump),
           "--training.local_batch_size", str(args.local_batch),
           "--training.global_batch_size", str(args.local_batch * args.nproc), "--training.seq_len", str(args.seq),
           "--training.steps", str(args.steps), "--metrics.log_freq", "1", "--validation.no-enable",
           "--checkpoint.no-enable", "--metrics.no-enable-tensorboard"]
    if args.data:
        out += ["--training.dataset_path", args.data]
    if args.tokenizer:
        out += ["--model.hf_assets_path", args.tokenizer]
    if args.flavor:
        out += ["--model.flavor", args.flavor]
    if args.device == "cpu":
        out += ["--model.converters", "", "--compile.no-enable", "--training.mixed_precision_param", "float32"]
    return out + args.extra


def run_one(args, cfg: Path, out: Path, devices: str = "") -> dict:
    dump = out / cfg.stem
    cmd = train_command(train_args(args, cfg, dump), args.nproc)
    env = child_env()
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    elif devices:
        env["CUDA_VISIBLE_DEVICES"] = devices
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    t0 = time.time()
    log = out / f"{cfg.stem}.log"
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        text, rc = text + f"\nTIMEOUT after {args.timeout}s", -1
    secs = time.time() - t0
    log.write_text(text)
    recs = []
    if (dump / "metrics.jsonl").exists():
        from attnlab.trainer.metrics import read_records

        recs = [r for r in read_records(dump / "metrics.jsonl") if "loss" in r]
    ok = rc == 0 and bool(recs) and recs[-1]["step"] == args.steps
    # launch to the first logged step (step 1 done: compile, autotuning and the step itself), the cold-start cost
    res = {"ok": ok, "s": secs, "first_s": recs[0]["time"] - t0 if recs else float("nan"),
           "loss": recs[-1]["loss"] if recs else float("nan"),
           "tps": statistics.median(r["tps"] for r in recs[len(recs) // 2:]) if recs else 0.0,
           "why": "" if ok else ("timeout" if rc == -1 else _last_error(text))}
    return res


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if "Error" in ln or "error:" in ln]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "no output")[:160]


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import ToolParser, dir_path, existing_dir, non_negative_int, or_empty, positive_int

    ap = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="", help="training data (default: each config's dataset)")
    ap.add_argument("--tokenizer", type=or_empty(existing_dir), default="",
                    help="tokenizer folder (default: each config's hf_assets_path)")
    ap.add_argument("--only", default="", help="comma list of config names or fnmatch patterns")
    ap.add_argument("--nproc", type=positive_int, default=1, help="processes (GPUs) per config")
    ap.add_argument("--local-batch", type=positive_int, default=1, help="training.local_batch_size")
    ap.add_argument("--seq", type=positive_int, default=2048, help="training.seq_len")
    ap.add_argument("--steps", type=positive_int, default=20, help="training.steps")
    ap.add_argument("--flavor", default="", help="override model.flavor (e.g. debug for a CPU run)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda or cpu")
    ap.add_argument("--timeout", type=positive_int, default=300, help="seconds per config")
    ap.add_argument("--parallel", type=positive_int, default=1,
                    help="configs run at once; slot i gets GPUs i*nproc.. (mod --gpus), so with --nproc 1 several "
                         "runs share one GPU when slots exceed GPUs (mind memory: ~15 GB per 0.6B run, ~30 GB 1.7B)")
    ap.add_argument("--gpus", type=non_negative_int, default=0,
                    help="GPUs on this machine (default: torch.cuda.device_count())")
    ap.add_argument("--out", type=or_empty(dir_path), default="", help="work folder (default: a temporary folder)")
    ap.add_argument("--list", action="store_true", help="print the selected configs and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    from attnlab.tools.common import split_train_flags

    own, extra = split_train_flags(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    args.extra = extra
    todo = configs(args.only)
    if args.list or not todo:
        print("\n".join(p.stem for p in todo) or f"no config matches --only {args.only!r}")
        return 0 if todo else 1
    out = Path(args.out or tempfile.mkdtemp(prefix="smoke_configs_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{len(todo)} configs, {args.nproc} x {args.device}, local batch {args.local_batch}, T={args.seq}, "
          f"{args.steps} steps; logs in {out}", flush=True)
    results = {}
    if args.parallel <= 1:
        for cfg in todo:
            r = results[cfg.stem] = run_one(args, cfg, out)
            print(f"  {cfg.stem:44s} {'ok' if r['ok'] else 'FAILED'} {r['s']:6.0f}s {r['why']}", flush=True)
    else:
        import queue
        import threading

        n_gpu = args.gpus
        if not n_gpu and args.device == "cuda":
            import torch

            n_gpu = torch.cuda.device_count()
        slots: queue.Queue = queue.Queue()
        for i in range(args.parallel):
            slots.put(",".join(str((i * args.nproc + j) % n_gpu) for j in range(args.nproc)) if n_gpu else "")
        lock = threading.Lock()

        def work(cfg):
            devices = slots.get()
            try:
                r = run_one(args, cfg, out, devices)
            finally:
                slots.put(devices)
            with lock:
                results[cfg.stem] = r
                print(f"  {cfg.stem:44s} {'ok' if r['ok'] else 'FAILED'} {r['s']:6.0f}s [{devices}] {r['why']}",
                      flush=True)

        threads = [threading.Thread(target=work, args=(cfg,)) for cfg in todo]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = {p.stem: results[p.stem] for p in todo}
    print(f"\n{'config':44s} {'result':>6s} {'s':>6s} {'1st step s':>10s} {'loss':>8s} {'tok/s/dev':>10s}")
    for name, r in results.items():
        print(f"{name:44s} {'ok' if r['ok'] else 'FAILED':>6s} {r['s']:6.0f} {r['first_s']:10.0f} {r['loss']:8.3f} "
              f"{r['tps']:10,.0f}")
    bad = [n for n, r in results.items() if not r["ok"]]
    print(f"{len(results) - len(bad)}/{len(results)} ok" + (f"; failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
