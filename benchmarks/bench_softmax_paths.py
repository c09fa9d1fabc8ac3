"""Softmax attention over packed documents: every path that can run the training call, checked and timed.

    python -m benchmarks.bench_softmax_paths                 # B8 x T4096, 16/8 heads, D=128, bf16
    python -m benchmarks.bench_softmax_paths --mean-doc 4096 # one document per row (plain causal)

The call is the 0.6B model's: q [B, T, 16, D], k and v [B, T, 8, D] (GQA), causal within each packed document
(``model.attn_mask_type = "block_causal"``). Documents get lengths drawn from an exponential of mean
``--mean-doc`` tokens (seeded), cut at the row's end. Columns, each forward and forward+backward:

- ``varlen-flash``: torch's ``varlen_attn`` (FlashAttention-2), K and V heads repeated where it has no GQA
  (the softmax module's "auto" path today);
- ``varlen-cudnn``: ``aten._cudnn_attention_forward`` with cumulative sequence offsets (cuDNN's ragged layout),
  GQA native;
- ``ours-triton``: the project's Triton kernel (``attention.impl = "triton"``), GQA native;
- ``flex``: ``flex_attention`` compiled, a document block mask, ``enable_gqa``.

Each column is first compared with a float32 masked-SDPA reference at the same shape (output and the three
gradients, max error over max magnitude), then timed (queued, CUDA events). TFLOP/s count the kept (query, key)
pairs: 4·D FLOPs per pair forward, 2.5× that backward.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from benchmarks.common import queued_ms


def doc_offsets(B: int, T: int, mean: int, gen: torch.Generator) -> torch.Tensor:
    """cu_seqlens [n_docs + 1] int32 of B rows of T tokens, each row cut into documents of exponential lengths."""
    cu = [0]
    for b in range(B):
        start = b * T
        while start < (b + 1) * T:
            n = max(1, int(torch.empty(1).exponential_(1 / mean, generator=gen).item()))
            start = min(start + n, (b + 1) * T)
            cu.append(start)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def kept_pairs(cu: torch.Tensor) -> int:
    n = (cu[1:] - cu[:-1]).long()
    return int((n * (n + 1) // 2).sum())


def varlen_flash(q, k, v, cu, max_len, scale):
    from torch.nn.attention.varlen import varlen_attn
    import inspect

    params = inspect.signature(varlen_attn).parameters
    B, T, HQ, D = q.shape
    q, k, v = (t.reshape(B * T, t.shape[2], D) for t in (q, k, v))
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        k, v = (t.repeat_interleave(HQ // k.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **kw).view(B, T, HQ, D)


def varlen_cudnn(q, k, v, cu, max_len, scale):
    B, T, HQ, D = q.shape
    q, k, v = (t.reshape(B * T, t.shape[2], D) for t in (q, k, v))
    o = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False,
                                                 scale=scale)[0]
    return o.view(B, T, HQ, D)


def ours_triton(q, k, v, cu, max_len, scale):
    from attnlab.attention.ops.parallax import parallax_attention

    B, T, HQ, D = q.shape
    q, k, v = (t.reshape(1, B * T, t.shape[2], D) for t in (q, k, v))
    return parallax_attention(q, k, v, None, scale=scale, cu_seqlens=cu, max_seqlen=max_len,
                              impl="triton").view(B, T, HQ, D)


_flex = {}


def flex(q, k, v, cu, max_len, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, T, HQ, D = q.shape
    key = (B, T, cu.data_ptr())
    if key not in _flex:
        doc = torch.zeros(B * T, dtype=torch.int32, device=q.device)
        doc[cu[1:-1].long()] = 1
        doc = doc.cumsum(0).view(B, T)

        def mask(b, h, i, j):
            return (doc[b, i] == doc[b, j]) & (i >= j)

        _flex.clear()
        _flex[key] = (create_block_mask(mask, B, None, T, T, device="cuda"), torch.compile(flex_attention))
    block_mask, fn = _flex[key]
    o = fn(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


PATHS = {"varlen-flash": varlen_flash, "varlen-cudnn": varlen_cudnn, "ours-triton": ours_triton, "flex": flex}


def reference(q, k, v, cu, scale):
    """Float32 masked SDPA per row: [B, T, HQ, D]."""
    B, T, HQ, D = q.shape
    doc = torch.zeros(B * T, dtype=torch.int32, device=q.device)
    doc[cu[1:-1].long()] = 1
    doc = doc.cumsum(0).view(B, T)
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    o = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)), attn_mask=mask[:, None],
                                       scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


def check(name, fn, B=2, T=1000, HQ=4, HKV=2, D=128, mean=300) -> str:
    gen = torch.Generator().manual_seed(1)
    cu = doc_offsets(B, T, mean, gen)
    max_len = int((cu[1:] - cu[:-1]).max())
    x = [torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HKV, HKV)]
    do = torch.randn(B, T, HQ, D, device="cuda")
    scale = D ** -0.5
    o = fn(*x, cu, max_len, scale)
    got = [o.float()] + list(torch.autograd.grad((o.float() * do).sum(), x))
    xr = [t.detach().float().requires_grad_(True) for t in x]
    o_ref = reference(*xr, cu, scale)
    ref = [o_ref] + list(torch.autograd.grad((o_ref * do).sum(), xr))
    errs = [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref)]
    worst = max(errs)
    return f"{'ok' if worst < 2e-2 else 'WRONG'} (max rel err {worst:.1e})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mean-doc", type=int, default=1024, help="mean document length in tokens")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--paths", default=",".join(PATHS))
    args = ap.parse_args()
    B, T, D, HQ, HKV = args.batch, args.seq, args.head_dim, 16, 8
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; B{B} T{T} HQ{HQ} HKV{HKV} D{D} bf16, "
          f"mean document {args.mean_doc}; ATTNLAB_AUTOTUNE={os.environ.get('ATTNLAB_AUTOTUNE', 'all')}")
    gen = torch.Generator().manual_seed(0)
    cu = doc_offsets(B, T, args.mean_doc, gen)
    max_len, pairs = int((cu[1:] - cu[:-1]).max()), kept_pairs(cu)
    x = [torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HKV, HKV)]
    do = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    scale = D ** -0.5
    fwd_flop = 4 * D * HQ * pairs
    print(f"# {len(cu) - 1} documents, longest {max_len}, kept pairs {pairs / (B * T * (T + 1) / 2):.3f} of causal")
    print("| path | check | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |\n|---|---|---|---|---|---|")
    for name in args.paths.split(","):
        fn = PATHS[name]
        try:
            status = check(name, fn)
            with torch.no_grad():
                f_ms = queued_ms(lambda: fn(*x, cu, max_len, scale))
            fb_ms = queued_ms(lambda: torch.autograd.grad(fn(*x, cu, max_len, scale), x, do))
        except Exception as e:  # a path this torch/GPU cannot run is a row saying why, not the end of the table
            print(f"| {name} | fails: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | | |")
            continue
        print(f"| {name} | {status} | {f_ms:.3f} | {fb_ms:.3f} | {fwd_flop / f_ms / 1e9:.0f} | "
              f"{3.5 * fwd_flop / fb_ms / 1e9:.0f} |")


if __name__ == "__main__":
    main()
