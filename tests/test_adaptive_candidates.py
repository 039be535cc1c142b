"""AutoPipe-RL §4.2's new partitions: each changes only two neighbouring workers' layers, and all
of them are listed (O(L) per neighbour pair); worked by hand."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe.adaptive.candidates import neighbour_candidates


def test_three_workers_by_hand():
    # 8 layers as 3 | 3 | 2: the 0-1 boundary may sit at 1, 2, 4, 5; the 1-2 boundary at 4, 5, 7
    got = neighbour_candidates(((0, 3), (3, 6), (6, 8)), (0, 1, 2))
    want = [((0, y), (y, 6), (6, 8)) for y in (1, 2, 4, 5)] + [((0, 3), (3, y), (y, 8)) for y in (4, 5, 7)]
    assert got == want


def test_a_waves_turn_is_not_a_boundary_between_workers():
    # chunks on ranks 0, 1, 1, 0: the 1-2 boundary is inside rank 1, nothing moves across it;
    # the 0-1 boundary may sit at 1 or 3, the 2-3 boundary at 5 or 7
    got = neighbour_candidates(((0, 2), (2, 4), (4, 6), (6, 8)), (0, 1, 1, 0))
    assert got == [
        ((0, 1), (1, 4), (4, 6), (6, 8)),
        ((0, 3), (3, 4), (4, 6), (6, 8)),
        ((0, 2), (2, 4), (4, 5), (5, 8)),
        ((0, 2), (2, 4), (4, 7), (7, 8)),
    ]


@settings(deadline=None, max_examples=60)
@given(st.lists(st.integers(1, 5), min_size=2, max_size=6))
def test_each_candidate_changes_exactly_two_neighbouring_workers(sizes):
    edges = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    bounds = tuple(zip(edges, edges[1:]))
    got = neighbour_candidates(bounds, tuple(range(len(sizes))))
    # every other place for each inner boundary that leaves both sides a layer: sum over pairs of (a + b - 2)
    assert len(got) == len(set(got)) == sum(a + b - 2 for a, b in zip(sizes, sizes[1:]))
    for c in got:
        changed = [i for i in range(len(bounds)) if c[i] != bounds[i]]
        assert len(changed) == 2 and changed[1] == changed[0] + 1
        assert c[0][0] == 0 and c[-1][1] == edges[-1] and all(a < b for a, b in c)
        assert all(c[i][1] == c[i + 1][0] for i in range(len(c) - 1))
