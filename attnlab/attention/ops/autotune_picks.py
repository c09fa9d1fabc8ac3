"""Shipped autotune picks: the config Triton's autotuner chose per kernel and autotune key on a GPU, used at the
first launch of that key so that the autotuner does not search.

Why: fla-core's kernels autotune their whole list at every new key, each candidate compiled and timed, so a cold
Gated DeltaNet / KDA run spends minutes before its first step. With a pick, only the picked config compiles; it is
one of the kernel's own candidates, so the run computes what an autotuned run that chose it computes.

- ``autotune_picks.json`` (next to this module): ``{"about": str, "entries": [entry, ...]}``, an entry being
  ``{"gpu": "sm90", "triton": "3.6.0", "fla": "0.6.0" | null, "kernel": name, "key": [...], "config": {"kwargs":
  {...}, "num_warps": int, "num_stages": int, "num_ctas": int, "maxnreg": int | null}}``. ``kernel`` is
  :attr:`attention.ops.fla_launch.FastLaunch.name` (module and qualified name of the ``@triton.jit`` function),
  ``key`` Triton's autotune cache key (:func:`autotune_key`). An entry applies where the GPU's compute capability,
  Triton's version and, for fla-core's kernels (``fla.*``), fla-core's version are the entry's, and its config is
  in the kernel's list (and kept by the kernel's ``early_config_prune``); otherwise the autotuner searches as before.
- ``ATTNLAB_PICKS=0``: the shipped picks are not used (a benchmark that autotunes afresh).
- ``ATTNLAB_RECORD_PICKS=PATH``: every key the autotuner searches (kernel, key, chosen config) is merged into PATH
  as soon as it is chosen; an entry of the same gpu, triton, fla, kernel and key is replaced.
- ``python -m attention.ops.autotune_picks merge RECORDED [INTO]``: merges a recorded file into INTO (default: the
  shipped file) the same way.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

PATH = Path(__file__).with_suffix(".json")
ABOUT = ("Triton autotune picks: per kernel and autotune key, the config the autotuner chose on that GPU; used at the "
         "first launch of the key instead of autotuning (attnlab/attention/ops/autotune_picks.py, docs/kernels.md).")
_FIELDS = ("gpu", "triton", "fla", "kernel")
_SCALARS = (bool, int, float, str, type(None))
_picks: dict | None = None  # (kernel, key) -> [entry, ...], read from PATH at the first lookup


def autotune_key(autotuner, kw: dict) -> tuple:
    """Triton's ``Autotuner.run`` cache key (the same code in Triton 3.6 and 3.9): the values of the autotuner's key
    arguments, then ``str(dtype)`` of every argument that has a dtype, in call order. ``kw``: positional arguments by
    name, then the keyword arguments, then the values of heuristics outside the autotuner (as the autotuner sees
    them)."""
    args = {k: v for k, v in kw.items() if k in autotuner.arg_names}
    return tuple([args[k] for k in autotuner.keys if k in args]
                 + [str(v.dtype) for v in args.values() if hasattr(v, "dtype")])


@functools.cache
def gpu() -> str | None:
    """``sm<major><minor>`` of the current CUDA device; None without one (or on ROCm), where no pick applies."""
    import torch

    if not torch.cuda.is_available() or torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def _context(kernel: str) -> dict:
    import triton

    fla = sys.modules.get("fla") if kernel.startswith("fla.") else None
    return {"gpu": gpu(), "triton": triton.__version__, "fla": getattr(fla, "__version__", None), "kernel": kernel}


def _config_dict(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": config.num_ctas, "maxnreg": config.maxnreg}


def read(path) -> list[dict]:
    """The entries of the picks file ``path``; none if it is missing."""
    try:
        with open(path) as f:
            return json.load(f)["entries"]
    except FileNotFoundError:
        return []


def pick(kernel: str, key: tuple, configs: list, prune=None):
    """The config of ``configs`` (Triton ``Config`` objects) picked for ``kernel`` at ``key`` on this GPU, Triton
    and fla-core, or None (no such entry, picks disabled, or the picked config is not among ``configs`` or not kept
    by ``prune``: configs -> kept configs, the kernel's ``early_config_prune`` at these arguments)."""
    global _picks
    if os.environ.get("ATTNLAB_PICKS", "1") == "0":
        return None
    if _picks is None:
        _picks = {}
        for e in read(PATH):
            _picks.setdefault((e["kernel"], tuple(e["key"])), []).append(e)
    entries = _picks.get((kernel, key))
    if not entries:
        return None
    here = _context(kernel)
    for e in entries:
        if all(e.get(f) == here[f] for f in _FIELDS):
            chosen = [c for c in configs if _config_dict(c) == e["config"]]
            if chosen and (prune is None or chosen[0] in prune(configs)):
                return chosen[0]
    return None


def record(kernel: str, key: tuple, config) -> None:
    """Merge the autotuner's choice ``config`` for ``kernel`` at ``key`` into ``$ATTNLAB_RECORD_PICKS`` at once, so
    that a run killed later (a timeout during a cold autotune) keeps every key it searched (a no-op without the
    variable, without a GPU, or where the key or the config's values are not JSON scalars)."""
    path = os.environ.get("ATTNLAB_RECORD_PICKS")
    if not path or not all(isinstance(v, _SCALARS) for v in (*key, *config.kwargs.values())):
        return
    entry = {**_context(kernel), "key": list(key), "config": _config_dict(config)}
    if entry["gpu"] is not None:
        merge(path, [entry])


def merge(path, entries: list[dict]) -> None:
    """Write ``entries`` into the picks file ``path``, replacing entries of the same gpu, triton, fla, kernel and key;
    sorted, so that a refreshed file differs from the old one only where picks changed. The file is replaced whole
    (a temporary file, then ``os.replace``), so that no reader sees half a file; of ranks merging at the same moment,
    the last one's write stands (data-parallel ranks record the same keys)."""
    path = Path(path)
    data = {"about": ABOUT, "entries": []}
    if path.exists():
        data = json.loads(path.read_text())
    ident = lambda e: json.dumps([e["kernel"], e["key"], e.get("gpu"), e.get("triton"), e.get("fla")])  # noqa: E731
    merged = {ident(e): e for e in [*data["entries"], *entries]}
    data["entries"] = [merged[k] for k in sorted(merged)]
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    lines = "".join(f"\n{json.dumps(e)}," for e in data["entries"]).rstrip(",")  # one entry a line, for diffs
    tmp.write_text(f'{{"about": {json.dumps(data["about"])},\n"entries": [{lines}\n]}}\n')
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m attention.ops.autotune_picks", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge a file recorded with ATTNLAB_RECORD_PICKS into the picks file")
    m.add_argument("recorded")
    m.add_argument("into", nargs="?", default=str(PATH), help="the picks file to update (default: %(default)s)")
    args = ap.parse_args(argv)
    if not Path(args.recorded).exists():
        ap.error(f"{args.recorded}: no such file")
    entries = read(args.recorded)
    merge(args.into, entries)
    print(f"{len(entries)} entries of {args.recorded} merged into {args.into}")


if __name__ == "__main__":
    main()
