"""MAD-style synthetic token-manipulation tasks (Poli et al., 2024, "Mechanistic Design and Scaling of Hybrid
Architectures") plus multi-query associative recall (Arora et al., 2023, Zoology), as in the Parallax paper §4.1.

    python -m attnlab.tools.synthetic --attention softmax,parallax [--tasks all] [--sweep quick|paper|hard]
        [--steps N --batch B --vocab V --seq-len T --device cuda]

Every batch is generated on the fly (a fixed held-out batch measures accuracy). The model is the paper's:
two blocks of (mixer + SwiGLU MLP), width 128, the project's ``Transformer`` with ``--attention`` as mixer
(any registered mechanism, default options), untied head; Muon for 2-D hidden matrices plus Adam-style
updates for the rest (``optim.build``), WSD schedule (no warmup, decay over the last 20 %).

Tasks (targets are scored only where the answer is determined by the input; accuracy = exact token match):

- ``recall``: key/value pairs with a per-sequence mapping; after a key seen before, predict its value.
- ``fuzzy_recall``: keys and values are spans of ``span`` tokens; after a repeated key, predict the value span.
- ``noisy_recall``: ``recall`` with noise tokens (their own vocabulary) inserted between pairs.
- ``selective_copy``: ``n_copy`` tokens scattered among blanks; after a marker, emit them in order.
- ``compression``: after a marker, the model's state at the marker alone is decoded (MLP with a position
  embedding, as MAD) into every token of the sequence.
- ``memorization``: a fixed global key→value map (the same in every batch) must be stored in the weights.
- ``mqar``: distinct key/value pairs first, then (key, value) queries; predict the value at each query key.

Sweeps: ``quick`` (CPU-sized: vocab 16, length 64, 300 steps; under a minute to a few minutes per task and
mechanism on a 2-core CPU, so all 7 tasks of 3 mechanisms take about half an hour), ``paper`` (MAD: vocab 16, length 128, more
steps),
``hard`` (recall tasks at vocabulary {128, 512} × length {512, 2048}). Prints an accuracy table.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


IGNORE = -100
BLANK, MARK, FIRST = 0, 1, 2  # special tokens; content tokens start at FIRST
TASKS = ("recall", "fuzzy_recall", "noisy_recall", "selective_copy", "compression", "memorization", "mqar")


@dataclass
class TaskSpec:
    """Sizes of one task instance; ``vocab`` counts content tokens (specials and noise tokens are extra)."""

    vocab: int = 16
    seq_len: int = 64
    span: int = 2
    """Key/value span length of fuzzy_recall."""
    noise_vocab: int = 16
    noise_prob: float = 0.3
    n_copy: int = 16
    """Tokens to copy (selective_copy) and to reconstruct (compression)."""

    def vocab_size(self) -> int:
        return FIRST + self.vocab + max(self.noise_vocab, self.n_copy)


def _split_vocab(spec: TaskSpec) -> tuple[int, int, int]:
    half = spec.vocab // 2
    return FIRST, FIRST + half, FIRST + spec.vocab  # keys [FIRST, mid), values [mid, end)


def _pairs_with_labels(keys: torch.Tensor, values: torch.Tensor, scored: torch.Tensor):
    """Interleave keys/values [B, N] -> inputs [B, 2N]; label at key t = its value where ``scored``."""
    B, N = keys.shape
    x = torch.stack([keys, values], -1).view(B, 2 * N)
    y = torch.full_like(x, IGNORE)
    y[:, 0::2] = torch.where(scored, values, torch.full_like(values, IGNORE))
    return x, y


def _seen_before(keys: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: keys[b, n] occurs in keys[b, :n]."""
    eq = keys[:, :, None] == keys[:, None, :]  # [B, N, N]
    return torch.tril(eq, diagonal=-1).any(-1)


def gen_recall(spec: TaskSpec, B: int, g: torch.Generator):
    k0, mid, end = _split_vocab(spec)
    N = spec.seq_len // 2
    table = torch.randint(mid, end, (B, mid - k0), generator=g)  # per-sequence key -> value
    keys = torch.randint(k0, mid, (B, N), generator=g)
    values = torch.gather(table, 1, keys - k0)
    return _pairs_with_labels(keys, values, _seen_before(keys))


def gen_noisy_recall(spec: TaskSpec, B: int, g: torch.Generator):
    x, y = gen_recall(spec, B, g)
    noise0 = FIRST + spec.vocab
    xs, ys = [], []
    for b in range(B):  # insert noise tokens between pairs, then crop to seq_len
        keep = torch.rand(x.shape[1] // 2, generator=g) >= spec.noise_prob
        xr, yr = [], []
        for n in range(x.shape[1] // 2):
            if not keep[n]:
                xr.append(int(torch.randint(noise0, noise0 + spec.noise_vocab, (1,), generator=g)))
                yr.append(IGNORE)
            xr += [int(x[b, 2 * n]), int(x[b, 2 * n + 1])]
            yr += [int(y[b, 2 * n]), IGNORE]
        xs.append(xr[: spec.seq_len])
        ys.append(yr[: spec.seq_len])
    return torch.tensor(xs), torch.tensor(ys)


def gen_fuzzy_recall(spec: TaskSpec, B: int, g: torch.Generator):
    k0, mid, end = _split_vocab(spec)
    S = spec.span
    n_keys = max(2, min(8, spec.seq_len // (4 * S)))
    N = spec.seq_len // (2 * S)
    key_spans = torch.randint(k0, mid, (B, n_keys, S), generator=g)
    val_spans = torch.randint(mid, end, (B, n_keys, S), generator=g)
    which = torch.randint(0, n_keys, (B, N), generator=g)
    idx = which[:, :, None].expand(B, N, S)
    ks, vs = torch.gather(key_spans, 1, idx), torch.gather(val_spans, 1, idx)  # [B, N, S]
    x = torch.cat([ks, vs], -1).reshape(B, N * 2 * S)
    y = torch.full_like(x, IGNORE)
    scored = _seen_before(which)  # [B, N]
    nxt = x.roll(-1, 1)
    for s in range(S):  # positions whose next token is value token s: last key token, then value tokens
        pos = torch.arange(N) * 2 * S + S - 1 + s
        y[:, pos] = torch.where(scored, nxt[:, pos], torch.full_like(scored, IGNORE, dtype=x.dtype))
    pad = spec.seq_len - x.shape[1]
    return F.pad(x, (0, pad), value=BLANK), F.pad(y, (0, pad), value=IGNORE)


def gen_selective_copy(spec: TaskSpec, B: int, g: torch.Generator):
    n, T = spec.n_copy, spec.seq_len
    L = T - n  # context incl. the marker at L-1
    data = torch.randint(FIRST, FIRST + spec.vocab, (B, n), generator=g)
    slots = torch.sort(torch.rand(B, L - 1, generator=g).argsort(-1)[:, :n], -1).values
    x = torch.full((B, T), BLANK, dtype=torch.long)
    x.scatter_(1, slots, data)
    x[:, L - 1] = MARK
    x[:, L:] = data  # teacher forcing: the tokens already emitted
    y = torch.full_like(x, IGNORE)
    y[:, L - 1: T - 1] = data  # at the marker the first token, then each next one
    return x, y


def gen_compression(spec: TaskSpec, B: int, g: torch.Generator):
    """Inputs: n tokens then the marker; the target is the n tokens (decoded from the marker's state)."""
    n = min(spec.n_copy, spec.seq_len - 1)
    data = torch.randint(FIRST, FIRST + spec.vocab, (B, n), generator=g)
    return torch.cat([data, torch.full((B, 1), MARK)], 1), data


def gen_memorization(spec: TaskSpec, B: int, g: torch.Generator):
    k0, mid, end = _split_vocab(spec)
    table = torch.randint(mid, end, (mid - k0,), generator=torch.Generator().manual_seed(1234))  # global map
    keys = torch.randint(k0, mid, (B, spec.seq_len // 2), generator=g)
    return _pairs_with_labels(keys, table[keys - k0], torch.ones_like(keys, dtype=torch.bool))


def gen_mqar(spec: TaskSpec, B: int, g: torch.Generator):
    k0, mid, end = _split_vocab(spec)
    N = spec.seq_len // 2
    n_pairs = min(mid - k0, max(1, N // 2))
    keys = torch.rand(B, mid - k0, generator=g).argsort(-1)[:, :n_pairs] + k0  # distinct keys
    values = torch.randint(mid, end, (B, n_pairs), generator=g)
    q = torch.randint(0, n_pairs, (B, N - n_pairs), generator=g)
    all_k = torch.cat([keys, torch.gather(keys, 1, q)], 1)
    all_v = torch.cat([values, torch.gather(values, 1, q)], 1)
    scored = torch.zeros_like(all_k, dtype=torch.bool)
    scored[:, n_pairs:] = True
    return _pairs_with_labels(all_k, all_v, scored)


GENERATORS = {"recall": gen_recall, "fuzzy_recall": gen_fuzzy_recall, "noisy_recall": gen_noisy_recall,
              "selective_copy": gen_selective_copy, "compression": gen_compression,
              "memorization": gen_memorization, "mqar": gen_mqar}


# ---------------------------------------------------------------- model and training

def build_model(attention: str, vocab_size: int, seq_len: int, width: int = 128, n_layers: int = 2,
                head_dim: int = 32, device="cpu"):
    """Two (mixer + SwiGLU MLP) blocks of width ``width`` with ``attention`` as mixer, untied head."""
    import attnlab.attention as registry
    from attnlab.models.args import ModelArgs
    from attnlab.checkpoint.dcp import build_model as materialise

    mech = registry.get_mechanism(attention, "--attention")
    n_heads = width // head_dim
    args = ModelArgs(dim=width, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads, head_dim=head_dim,
                     hidden_dim=4 * width, vocab_size=vocab_size, max_seq_len=seq_len, enable_weight_tying=False,
                     attention=attention, attn_mask_type="causal", attention_options={attention: mech.options()})
    return materialise(args, device=device)


class CompressionDecoder(nn.Module):
    """MAD's compression read-out: logits_i = W(gelu(A(h_marker + P_i))) for every position i."""

    def __init__(self, width: int, n: int, vocab_size: int):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(n, width) * 0.02)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, vocab_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: [B, width] -> [B, n, vocab]
        return self.mlp(h[:, None, :] + self.pos[None])


def build_optim(modules: list[nn.Module], steps: int, lr: float, optimizer: str = "muon", wd: float = 0.0):
    from attnlab.optim.build import build_lr_schedulers, build_optimizers
    from attnlab.optim.config import LRScheduler, Optimizer

    ocfg = Optimizer(name=optimizer, lr=lr, weight_decay=wd, implementation="for-loop")
    ocfg.muon_ns_dtype = "float32" if not torch.cuda.is_available() else "bfloat16"
    scfg = LRScheduler(warmup_steps=0, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.0)
    opt = build_optimizers(modules, ocfg)
    return opt, build_lr_schedulers(opt, scfg, steps)


def _logits(model, decoder, x: torch.Tensor, task: str) -> torch.Tensor:
    if task != "compression":
        return model(x)
    captured = {}
    hook = model.norm.register_forward_hook(lambda m, a, out: captured.__setitem__("h", out))
    try:
        model(x)
    finally:
        hook.remove()
    return decoder(captured["h"][:, -1])


def train_task(task: str, attention: str, spec: TaskSpec, steps: int, batch: int, lr: float, device="cpu",
               seed: int = 0, eval_batch: int = 256, optimizer: str = "muon") -> dict:
    """Train a fresh model on ``task``; returns accuracy on a held-out batch and timing."""
    torch.manual_seed(seed)
    gen = GENERATORS[task]
    V = spec.vocab_size()
    model = build_model(attention, V, spec.seq_len + 1, device=device)
    decoder = CompressionDecoder(128, spec.n_copy, V).to(device) if task == "compression" else None
    modules = [model] + ([decoder] if decoder is not None else [])
    opt, sched = build_optim(modules, steps, lr, optimizer)
    g = torch.Generator().manual_seed(seed + 1)
    t0 = time.time()
    model.train()
    for _ in range(steps):
        x, y = gen(spec, batch, g)
        x, y = x.to(device), y.to(device)
        logits = _logits(model, decoder, x, task)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for m in modules for p in m.parameters()], 1.0)
        opt.step()
        sched.step()
    acc = evaluate(model, decoder, task, spec, eval_batch, device, seed)
    return {"task": task, "attention": attention, "acc": acc, "loss": float(loss.detach()), "steps": steps,
            "seconds": time.time() - t0, "vocab": spec.vocab, "seq_len": spec.seq_len}


@torch.no_grad()
def evaluate(model, decoder, task: str, spec: TaskSpec, n: int, device="cpu", seed: int = 0) -> float:
    model.eval()
    x, y = GENERATORS[task](spec, n, torch.Generator().manual_seed(10_000 + seed))
    x, y = x.to(device), y.to(device)
    pred = _logits(model, decoder, x, task).argmax(-1)
    m = y != IGNORE
    model.train()
    return float((pred[m] == y[m]).float().mean())


def sweep_configs(name: str, args) -> list[tuple[str, TaskSpec]]:
    tasks = TASKS if args.tasks == "all" else args.tasks.split(",")
    for t in tasks:
        if t not in GENERATORS:
            raise ValueError(f"--tasks: {t!r} is not a task; choose from {list(TASKS)}")
    if name == "hard":
        recall = [t for t in tasks if t in ("recall", "fuzzy_recall", "noisy_recall", "mqar")]
        return [(t, TaskSpec(vocab=v, seq_len=L, noise_vocab=v // 4, n_copy=16)) for t in recall
                for v in (128, 512) for L in (512, 2048)]
    base = dict(quick=dict(vocab=16, seq_len=64), paper=dict(vocab=16, seq_len=128))[name]
    base = {**base, **{k: v for k, v in (("vocab", args.vocab), ("seq_len", args.seq_len)) if v}}
    return [(t, TaskSpec(**base)) for t in tasks]


def format_table(results: list[dict]) -> str:
    mechs = list(dict.fromkeys(r["attention"] for r in results))
    rows = list(dict.fromkeys((r["task"], r["vocab"], r["seq_len"]) for r in results))
    acc = {(r["task"], r["vocab"], r["seq_len"], r["attention"]): r["acc"] for r in results}
    head = f"{'task':<16}{'vocab':>6}{'len':>6}" + "".join(f"{m:>12}" for m in mechs)
    lines = [head, "-" * len(head)]
    for t, v, L in rows:
        lines.append(f"{t:<16}{v:>6}{L:>6}" + "".join(f"{acc.get((t, v, L, m), float('nan')):>12.3f}" for m in mechs))
    return "\n".join(lines)


def build_parser():
    """The command line of this tool (the option harness, tests/test_option_harness.py, reads it)."""
    from attnlab.tools.common import ToolParser, add_device_argument, non_negative_int, out_file, positive_float

    ap = ToolParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention", default="softmax,parallax", help="comma-separated registered mechanisms")
    ap.add_argument("--tasks", default="all", help=f"comma-separated subset of {list(TASKS)} or 'all'")
    ap.add_argument("--sweep", default="quick", choices=["quick", "paper", "hard"],
                    help="task sizes: quick (under a minute to a few minutes per task and mechanism on a 2-core CPU), paper "
                         "(the paper's), hard")
    ap.add_argument("--steps", type=non_negative_int, default=0,
                    help="0 = the sweep's (quick 300, paper 3000, hard 4000)")
    ap.add_argument("--batch", type=non_negative_int, default=0, help="0 = the sweep's (quick 32, paper/hard 64)")
    ap.add_argument("--vocab", type=non_negative_int, default=0, help="0 = the sweep's")
    ap.add_argument("--seq-len", type=non_negative_int, default=0, help="0 = the sweep's")
    ap.add_argument("--lr", type=positive_float, default=1e-2,
                    help="Muon lr (Adam-style groups use the paper's multipliers)")
    ap.add_argument("--optimizer", default="muon", choices=["muon", "adamw"], help="muon or adamw")
    add_device_argument(ap)
    ap.add_argument("--seed", type=non_negative_int, default=0, help="seed of data and initialisation")
    ap.add_argument("--json", type=out_file, default=None, help="write all results here")
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    ap = build_parser()
    args = ap.parse_args(argv)
    # width-128 models: kernel speed is irrelevant, cold autotuning is not (minutes before the first task);
    # one config per kernel, ours and fla's (ATTNLAB_AUTOTUNE=all to override)
    os.environ.setdefault("ATTNLAB_AUTOTUNE", "first")
    steps = args.steps or dict(quick=300, paper=3000, hard=4000)[args.sweep]
    batch = args.batch or dict(quick=32, paper=64, hard=64)[args.sweep]
    import attnlab.attention as registry

    mechs = [m.strip() for m in args.attention.split(",") if m.strip()]
    for m in mechs:
        registry.get_mechanism(m, "--attention")
    results = []
    for task, spec in sweep_configs(args.sweep, args):
        for m in mechs:
            r = train_task(task, m, spec, steps, batch, args.lr, args.device, args.seed, optimizer=args.optimizer)
            print(json.dumps(r), flush=True)
            results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(format_table(results))
    return results


if __name__ == "__main__":
    main()
