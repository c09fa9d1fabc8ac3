"""The order in which a causal tile kernel's programs run: heaviest tiles first, in groups of (batch, head) pairs.

A causal query tile's work grows with its index (a key tile's shrinks), so the order of a grid's programs decides
how long the last ones run on their own. The GPU starts a grid's programs in launch order (x fastest), each as a
slot frees up. Orders, with a list-scheduling model's makespan over the work's lower bound (Parallax forward,
T=4096: 64 (batch, head) pairs × 32 tiles on 132 slots):

- tiles fastest, one pair's tiles after another's: 1.069; the heaviest tile of the last pair runs alone at the end.
- pairs fastest, every pair's heaviest tile first: 1.005, but the programs running together then read the K/V of
  every pair, so each key tile comes from DRAM once per query tile instead of once per pair (slower in practice).
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
"""Programs per group of ``tile_program`` (groups of 128-512 programs measured alike; far faster than the tiles
fastest at short T, where the last tiles' tail is a larger share)."""

TAIL_PROGRAMS = tl.constexpr(512)
"""Programs of the one group that ``tile_program(TAIL_PROGRAMS, TAIL=True)`` forms at the end of the grid: the LLA row
kernels. The programs of one pair share K in L2 and the CG step is partly DRAM-bound, so grouping throughout made it
slower; tiles fastest with one last group of 512 programs was the fastest order tried."""


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
