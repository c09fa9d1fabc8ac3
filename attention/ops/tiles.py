"""The order in which a causal tile kernel's programs run: heaviest tiles first, in groups of (batch, head) pairs.

A causal query tile's work grows with its index (a key tile's shrinks), so the order of a grid's programs decides
how long the last ones run on their own. The GPU starts a grid's programs in launch order (x fastest), each as a
slot frees up. A list-scheduling model (programs as jobs of length key blocks + 0.5, greedy on free slots; Parallax
forward at T=4096: 64 (batch, head) pairs × 32 tiles on 132 slots) gives the makespan over the work's lower bound:

- tiles fastest, one pair's tiles after another's (the order before session 18): 1.069. The heaviest tile of the
  last pair starts near the end and runs alone.
- pairs fastest, every pair's heaviest tile first: 1.005. But the programs running together then read the K/V of
  every pair, so each key tile comes from DRAM once per query tile instead of once per pair. On an H100 the LLA CG
  step ran 1.048 -> 1.104 ms that way.
- groups of GROUP // tiles pairs, one group after another, inside a group the pairs fastest and the tiles from the
  heaviest down (``tile_program``): 1.001 at 4 or 8 pairs per group, with the K/V of one group in flight. The
  Parallax / softmax kernels and LLA's dk/dv run so (``GROUP_PROGRAMS``).
- tiles fastest, but the last GROUP // tiles pairs as one such group (``tile_program(GROUP, TAIL=True)``): 1.024 at
  4 pairs, 1.010 at 16. The LLA row kernels run so (``TAIL_PROGRAMS``): grouped throughout they were slower.

The grid is ``tile_grid(tiles, pairs)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

GROUP_PROGRAMS = tl.constexpr(256)
"""Programs per group of ``tile_program``. H100, T=4096, B4, 16/8 heads, bf16, each kernel alone at its autotuned
tile (session 18), tiles fastest (the order before) -> groups of 256 programs: Parallax D=128 fwd + dq + dkv
4.215-4.252 -> 4.073-4.081 ms (groups of 128 and 512: 4.066, 4.051); softmax D=128 2.513-2.633 -> 2.399-2.491; LLA's
dk/dv 3.63 -> 3.35-3.44. Parallax D=128 at T = 1k / 4k / 8k / 16k: -18 / -6 / -1.4 / -0.6 % (benchmarks/RESULTS.md)."""

TAIL_PROGRAMS = tl.constexpr(512)
"""Programs of the one group that ``tile_program(TAIL_PROGRAMS, TAIL=True)`` forms at the end of the grid: the LLA row
kernels. Grouped throughout, their CG step ran 2-6 % slower than with the tiles fastest (0.98 -> 1.00-1.03 ms; the
programs of one pair share K in L2, and the step is partly DRAM-bound). With the tiles fastest except for a last group
of 512 programs it ran 0.957 ms against 0.988 (H100, T=4096, B4, 16/8 heads, LLA-8; means of 4 and 5 runs, every
paired run faster; a last group of 2048 programs: 0.982)."""


def tile_grid(n_tiles: int, n_pairs: int) -> tuple[int, int]:
    """Launch grid of ``n_tiles`` tiles of each of ``n_pairs`` (batch or document, head) pairs."""
    return n_pairs, n_tiles


@triton.jit
def tile_program(GROUP: tl.constexpr, TAIL: tl.constexpr = False):
    """(rank, pair, tiles, pairs) of this program in a ``tile_grid``: rank 0 is the heaviest tile of its pair.

    GROUP: programs per group (``GROUP_PROGRAMS``). TAIL: only the last GROUP // tiles pairs form a group; the pairs
    before them run one after another, tiles fastest (``TAIL_PROGRAMS``, the LLA row kernels)."""
    n_p = tl.num_programs(0)
    n_t = tl.num_programs(1)
    lin = tl.program_id(1) * n_p + tl.program_id(0)  # launch order
    if TAIL:
        gt = tl.minimum(tl.maximum(GROUP // n_t, 1), n_p)  # pairs in the last group
        n_head = (n_p - gt) * n_t  # programs before it
        r = lin - n_head
        rank = tl.where(lin < n_head, lin % n_t, r // gt)
        pair = tl.where(lin < n_head, lin // n_t, n_p - gt + r % gt)
    else:
        gp = tl.minimum(tl.maximum(GROUP // n_t, 1), n_p)  # pairs per group
        g = lin // (gp * n_t)
        r = lin - g * gp * n_t
        gs = tl.minimum(gp, n_p - g * gp)  # the last group may be smaller
        rank = r // gs
        pair = g * gp + r % gs
    return rank, pair, n_t, n_p
