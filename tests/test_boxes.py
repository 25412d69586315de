"""N-d half-open boxes: intersection, exact-cover validation and the lookup index."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hyperdcp.core.boxes import Box, BoxIndex, check_exact_cover, grid_tiles
from hyperdcp.errors import MismatchError


def test_intersection_is_half_open():
    a = Box((0, 0), (4, 4))
    assert a.intersect(Box((4, 0), (2, 4))) is None  # touching is not overlapping
    assert a.intersect(Box((2, 3), (5, 5))) == Box((2, 3), (2, 1))


def test_relative_and_slices():
    inner = Box((3, 4), (2, 2))
    assert inner.relative_to(Box((2, 2), (4, 4))) == Box((1, 2), (2, 2))
    assert inner.slices() == (slice(3, 5), slice(4, 6))


@pytest.mark.parametrize("split", [(1, 1), (2, 3), (3, 1)])
def test_grid_partitions_are_exact_covers(split):
    shape = (7, 5)
    offs, lens = [], []
    cuts = [np.array_split(np.arange(n), k) for n, k in zip(shape, split)]
    for a, b in itertools.product(*cuts):
        offs.append((a[0], b[0]))
        lens.append((len(a), len(b)))
    check_exact_cover("t", shape, np.array(offs), np.array(lens))  # raises if not an exact cover
    assert grid_tiles(np.zeros(len(offs), np.int64), np.array(offs), np.array(lens),
                      np.array([shape])).tolist() == [True]


def test_non_grid_exact_cover_is_accepted():
    # an L-shaped tiling that is not a grid
    offs = np.array([[0, 0], [0, 3], [2, 0]])
    lens = np.array([[2, 3], [4, 1], [2, 3]])
    check_exact_cover("t", (4, 4), offs, lens)  # raises if not an exact cover
    # not a grid: the vectorised test leaves it to the general check above
    assert grid_tiles(np.zeros(3, np.int64), offs, lens, np.array([[4, 4]])).tolist() == [False]


def test_overlap_and_gap_compensating_is_refused():
    # rows 0-1 and 1-2 overlap on row 1 while row 3 is uncovered: the volume alone would match
    offs = np.array([[0, 0], [1, 0]])
    lens = np.array([[2, 2], [2, 2]])
    with pytest.raises(MismatchError, match="overlap"):
        check_exact_cover("t", (4, 2), offs, lens)


def test_index_finds_exactly_the_overlapping_boxes():
    rng = np.random.default_rng(0)
    shape = (10, 6)
    offs, lens = [], []
    for r0, r1 in [(0, 3), (3, 7), (7, 10)]:
        for c0, c1 in [(0, 2), (2, 6)]:
            offs.append((r0, c0))
            lens.append((r1 - r0, c1 - c0))
    offs, lens = np.array(offs), np.array(lens)
    for grid in (True, False):
        o, ln = (offs, lens) if grid else (np.vstack([offs[:1], [[0, 2]], offs[2:]]), lens)
        if not grid:
            # non-grid: split the second box differently so the layout is not a grid
            o = np.array([[0, 0], [0, 2], [3, 0], [3, 3], [7, 0], [7, 2]])
            ln = np.array([[3, 2], [3, 4], [4, 3], [4, 3], [3, 2], [3, 4]])
        check_exact_cover("t", shape, o, ln)
        idx = BoxIndex(shape, o, ln)
        for _ in range(50):
            a = rng.integers(0, 10), rng.integers(0, 6)
            q = Box(a, (int(rng.integers(1, 11 - a[0])), int(rng.integers(1, 7 - a[1]))))
            want = {i for i in range(len(o)) if q.intersect(Box(tuple(o[i]), tuple(ln[i]))) is not None}
            assert set(idx.query(q).tolist()) == want
