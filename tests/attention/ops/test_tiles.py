"""Program order of the causal tile kernels (``attnlab/attention/ops/tiles.py``): every (tile, pair) exactly once,
heaviest tiles first inside each group of pairs, groups one after another; or one pair after another with only the last
pairs grouped (TAIL). Runs the order itself through a Triton kernel (the interpreter on CPU)."""

import pytest
import torch
import triton
import triton.language as tl

from attnlab.attention.ops.tiles import tile_grid, tile_program


@triton.jit
def _order_kernel(OUT, GROUP: tl.constexpr, TAIL: tl.constexpr):
    rank, pair, n_t, n_p = tile_program(GROUP, TAIL)
    lin = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(OUT + lin * 4, rank)
    tl.store(OUT + lin * 4 + 1, pair)
    tl.store(OUT + lin * 4 + 2, n_t)
    tl.store(OUT + lin * 4 + 3, n_p)


def _launch_order(n_tiles: int, n_pairs: int, group: int, tail: bool = False) -> list[tuple[int, int]]:
    """(rank, pair) of each program, in launch order."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.full((n_tiles * n_pairs, 4), -1, dtype=torch.int32, device=dev)
    _order_kernel[tile_grid(n_tiles, n_pairs)](out, GROUP=group, TAIL=tail)
    assert (out[:, 2] == n_tiles).all() and (out[:, 3] == n_pairs).all()
    return [tuple(r) for r in out[:, :2].tolist()]


@pytest.mark.parametrize("n_tiles, n_pairs, group", [(4, 6, 8), (3, 7, 8), (5, 3, 64), (8, 5, 1), (2, 9, 4),
                                                     (1, 5, 8), (6, 1, 8)])
def test_grouped_order_is_a_permutation_heaviest_first(n_tiles, n_pairs, group):
    order = _launch_order(n_tiles, n_pairs, group)
    assert sorted(order) == [(t, p) for t in range(n_tiles) for p in range(n_pairs)]
    per_group = min(max(group // n_tiles, 1), n_pairs)
    groups = [order[i:i + per_group * n_tiles] for i in range(0, len(order), per_group * n_tiles)]
    for g, progs in enumerate(groups):
        pairs = {p for _, p in progs}
        assert pairs == set(range(g * per_group, min((g + 1) * per_group, n_pairs)))  # groups in order
        ranks = [t for t, _ in progs]
        assert ranks == sorted(ranks)  # inside a group: every pair's heaviest tile, then the next
        assert progs[:len(pairs)] == [(0, p) for p in sorted(pairs)]


@pytest.mark.parametrize("n_tiles, n_pairs, group", [(3, 5, 6), (4, 6, 8), (2, 3, 64), (5, 4, 1)])
def test_tail_order_groups_only_the_last_pairs(n_tiles, n_pairs, group):
    order = _launch_order(n_tiles, n_pairs, group, tail=True)
    in_tail = min(max(group // n_tiles, 1), n_pairs)
    head = n_pairs - in_tail
    # the pairs before the last group: one after another, heaviest tile first
    assert order[:head * n_tiles] == [(t, p) for p in range(head) for t in range(n_tiles)]
    # the last group: every pair's heaviest tile, then the next
    assert order[head * n_tiles:] == [(t, p) for t in range(n_tiles) for p in range(head, n_pairs)]
