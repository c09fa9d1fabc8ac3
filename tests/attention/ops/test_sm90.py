"""attnlab/attention/ops/sm90.py: the offline sm_90 compile sees what a launch sees (pointer / multiple-of-16 marks)."""

import os
import subprocess
import sys

import pytest

from tests.utils import REPO

_SCRIPT = """
from attnlab.attention.ops.sm90 import compile_sm90, loop_local_memory, resources
from attnlab.attention.ops.parallax.triton import decode
fn = decode._parallax_decode_kernel
consts = dict(TQ=1, HQ=16, HKV=8, D=128, BR=16, BN=64, HAS_PROBE=True, WINDOW=False, SPLIT=True, FUSED_MERGE=False,
              DOT_PREC="tf32", RR=2, SC=1, LONG_OFF=False, PDL=False)
sig = {a: "constexpr" if a in consts else "fp32" if a == "qk_scale" else "i32" if a in ("W", "CHUNK", "B", "LMAX")
       else "*i32" if a in ("SEQLENS", "CNT") else "*fp32" if a.startswith("P") else "*bf16" for a in fn.arg_names}
k = compile_sm90(fn, sig, consts, 4, 3, ints=dict(CHUNK=1024, B=1, LMAX=32768, W=0))
r = resources(k)
print("RESULT", r["async"], r["regs"], r["spill_st"], *loop_local_memory(k))
"""


@pytest.mark.slow
def test_offline_compile_pipelines_the_decode_loop():
    """With the launcher's marks the decode kernel's K/V loads become async copies (6 at 3 stages) and it fits
    without spills; without them there are none."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(REPO)
    res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    n_async, regs, spill, ldl, stl = (int(x) for x in res.stdout.split("RESULT")[1].split())
    assert n_async >= 4 and spill == 0 and ldl == stl == 0
    assert regs < 255


def test_sass_loop_counts_nested_loops():
    """Local loads / stores are counted inside loops only; ``innermost`` keeps the loops that contain no other loop
    (a spill reloaded once per CG iteration is not one reloaded per key tile)."""
    from attnlab.attention.ops.sm90 import sass_loop_local_memory

    sass = "\n".join(f"        /*{a:04x}*/    {i} ;" for a, i in [
        (0x00, "LDL R1, [R2]"),  # before every loop
        (0x10, "IADD R3, R3, 1"),  # outer loop starts
        (0x20, "LDL R4, [R5]"),  # outer only
        (0x30, "HGMMA.64x64x16 R0, gdesc[UR4], R0"),  # inner loop starts
        (0x40, "LDL R6, [R7]"),
        (0x50, "@P0 BRA 0x30"),  # inner back-edge
        (0x60, "STL [R8], R9"),  # outer only
        (0x70, "@P1 BRA 0x10"),  # outer back-edge
        (0x80, "STL [R8], R9"),  # after every loop
    ])
    assert sass_loop_local_memory(sass) == (2, 1)
    assert sass_loop_local_memory(sass, innermost=True) == (1, 0)


_SPILL_SCRIPT = """
from attnlab.attention.ops.parallax.triton import common
common.FWD_SPECS, common.TUNE_EXTRA_FWD = [(64, 64, 4, 2), (128, 64, 8, 2, 1, 1)], []
common.DQ_SPECS, common.TUNE_EXTRA_DQ = [(64, 32, 4, 2), (64, 32, 4, 2, 1, 0)], []
common.DKV_SPECS, common.TUNE_EXTRA_DKV = [(32, 32, 4, 2), (32, 32, 4, 2, 1, 0)], []
from benchmarks.profile_attention import spill_report
for line in spill_report(64, True, ["fwd", "dq", "dkv"]):
    print("LINE", line)
"""


@pytest.mark.slow
def test_spill_report_compiles_plain_and_tma_tiles():
    """``profile_attention.py --spills`` compiles a plain and a TMA (+ WS) tile of each Parallax kernel: every
    constexpr the kernels take is given (one left out is typed as a pointer and the compile fails)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(REPO)
    res = subprocess.run([sys.executable, "-c", _SPILL_SCRIPT], env=env, capture_output=True, text=True, cwd=root)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("LINE")]
    assert len(lines) == 6 and all("regs" in ln for ln in lines), lines
