"""Compile a Triton kernel for sm_90a without a GPU and report what ptxas gives it (registers, spills, shared memory).

Used by ``profile_attention.py --spills`` and ``bench_lla.py --ptxas``. The compile must see what a launch sees:
Triton's launcher marks every pointer argument (torch allocations are 16-byte aligned) and every integer argument
that is a multiple of 16 with ``tt.divisibility = 16``, and compiles an integer argument equal to 1 as a constant. Without those marks the loads cannot be vectorised or made
asynchronous: K/V loop loads stay synchronous 2-byte loads (no ``cp.async`` pipeline), and the register and stack
counts describe a kernel that never runs (without the marks the decode kernel compiled to more registers than
with them, and to no ``async_copy`` at all).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from types import MappingProxyType
from typing import Mapping


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int, num_stages: int,
                 ints: Mapping[str, int] = MappingProxyType({})):
    """``fn``: a ``@triton.jit`` function (not the autotuner). ``signature``: type per argument name ("constexpr"
    for the names in ``constexprs``). ``ints``: the values integer arguments take at the shape of interest (the
    launcher's specialisation is applied to them: 1 becomes a constant, multiples of 16 are marked); every pointer
    is marked divisible by 16."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    unknown = set(ints) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"ints {sorted(unknown)} are not arguments of {fn.__name__}")
    signature, constexprs = dict(signature), dict(constexprs)
    for a, v in ints.items():
        if v == 1:
            signature[a], constexprs[a] = "constexpr", 1
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if signature[a].startswith("*") or (signature[a] != "constexpr" and ints.get(a, 1) % 16 == 0)}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def resources(kernel) -> dict:
    """ptxas -v on the kernel's PTX: registers, spill store/load bytes, stack bytes; plus shared memory (bytes),
    whether wgmma is used and how many async global->shared copies (cp.async / TMA) the TTGIR holds."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        log = subprocess.run([get_ptxas(90).path, "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    num = lambda pat: int(re.search(pat, log).group(1))  # noqa: E731
    ttgir = kernel.asm["ttgir"]
    return {"regs": num(r"Used (\d+) registers"), "spill_st": num(r"(\d+) bytes spill stores"),
            "spill_ld": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame"),
            "smem": kernel.metadata.shared, "wgmma": "wgmma.mma_async" in kernel.asm["ptx"],
            "async": ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy_global_to_local")}


def sass(kernel) -> str:
    """The kernel's SASS listing (cuobjdump on its cubin)."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def loop_local_memory(kernel, innermost: bool = False) -> tuple[int, int]:
    """(LDL, STL) instructions inside loops of the kernel's SASS (``sass_loop_local_memory``)."""
    return sass_loop_local_memory(sass(kernel), innermost)


def sass_loop_local_memory(listing: str, innermost: bool = False) -> tuple[int, int]:
    """(LDL, STL) instructions inside loops of a SASS listing (a loop: the address range of a backward branch);
    spills there cost every iteration, spills outside cost once. ``innermost``: only inside loops that contain no
    other loop (the key loops of a kernel that nests them in a CG iteration loop)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", listing)]
    loops = [(int(b.group(1), 16), a) for a, i in ins
             if (b := re.search(r"BRA[^0]*0x([0-9a-f]+)", i)) and int(b.group(1), 16) < a]
    if innermost:
        loops = [(lo, hi) for lo, hi in loops if not any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in loops)]
    inside = [i for a, i in ins if any(lo <= a <= hi for lo, hi in loops)]
    return sum(bool(re.search(r"\bLDL", i)) for i in inside), sum(bool(re.search(r"\bSTL", i)) for i in inside)


if __name__ == "__main__":  # a module the tools import, not a tool: running it (--help included) says what it holds
    print(__doc__)
    raise SystemExit(0)
