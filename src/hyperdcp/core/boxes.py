"""N-d half-open boxes: the geometry every plan is made of.

A box is ``(offsets, lengths)``: per dimension the half-open interval
``[offsets[d], offsets[d] + lengths[d])`` of a tensor's global index space. Sets of boxes are kept as
int64 arrays of shape ``(n, ndim)`` so that validation and lookup stay vectorised at 100,000 tensors
and 16,384 ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import MismatchError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """One half-open N-d box."""

    offsets: Shape
    lengths: Shape

    def __post_init__(self):
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"box offsets {self.offsets} and lengths {self.lengths} differ in rank")

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def numel(self) -> int:
        return int(math.prod(self.lengths))

    @property
    def ends(self) -> Shape:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def intersect(self, other: "Box") -> "Box | None":
        """The common box, or None when the two do not overlap (touching is not overlapping)."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(h <= lo_d for lo_d, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - lo_d for lo_d, h in zip(lo, hi)))

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets)), self.lengths)

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(
            o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape)
        )

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths)) + ")"


def _as_boxes(a, ndim: int) -> np.ndarray:
    """An (n, ndim) int64 array; a 1-D input of n rows is accepted only for ndim == 0 (n empty rows)."""
    a = np.asarray(a, dtype=np.int64)
    if a.ndim == 2 and a.shape[1] == ndim:
        return a
    if ndim and a.size % ndim == 0:
        return a.reshape(-1, ndim)
    raise ValueError(f"expected boxes of rank {ndim}, got an array of shape {a.shape}")


def full_box(shape: Sequence[int]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))


def _grid_cells(shape: Shape, starts: np.ndarray, ends: np.ndarray):
    """If the boxes form a grid partition of ``shape``, return (per-dim cut points, cell coords).

    A grid partition: per dimension the distinct intervals tile ``[0, shape[d])`` without gaps or
    overlaps, and each grid cell holds exactly one box. Returns None when the boxes are not a grid
    (they may still be an exact cover; the caller then runs the general check).
    """
    n, ndim = starts.shape
    cuts, coords = [], np.empty((n, ndim), dtype=np.int64)
    for d in range(ndim):
        us = np.unique(starts[:, d])
        k = np.searchsorted(us, starts[:, d])
        nxt = np.append(us[1:], shape[d])
        if us[0] != 0 or not np.array_equal(ends[:, d], nxt[k]):
            return None
        cuts.append(np.append(us, shape[d]))
        coords[:, d] = k
    ncells = int(np.prod([len(c) - 1 for c in cuts], dtype=np.int64)) if ndim else 1
    if ncells != n:
        return None
    if ndim:
        flat = np.ravel_multi_index(coords.T, tuple(len(c) - 1 for c in cuts))
        if np.unique(flat).size != n:
            return None
    return cuts, coords


def _first_overlap(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    """Indices of two overlapping boxes, or None. Sweeps along the most discriminating dimension."""
    n, ndim = starts.shape
    if n < 2 or ndim == 0:
        return (0, 1) if n >= 2 else None
    d = int(np.argmax([np.unique(starts[:, k]).size for k in range(ndim)]))
    order = np.argsort(starts[:, d], kind="stable")
    s, e = starts[order], ends[order]
    limit = np.searchsorted(s[:, d], e[:, d], side="left")  # candidates j in (i, limit[i])
    for i in range(n):
        j = slice(i + 1, int(limit[i]))
        if j.start >= j.stop:
            continue
        hit = np.all((s[j] < e[i]) & (e[j] > s[i]), axis=1)
        if hit.any():
            return int(order[i]), int(order[i + 1 + int(np.argmax(hit))])
    return None


def check_exact_cover(name: str, shape: Sequence[int], offsets: np.ndarray, lengths: np.ndarray) -> None:
    """Raise MismatchError unless the (non-empty) boxes tile ``shape`` exactly: no gap, no overlap.

    Duplicate boxes must have been removed by the caller.
    """
    shape = tuple(int(s) for s in shape)
    offsets = _as_boxes(offsets, len(shape))
    lengths = _as_boxes(lengths, len(shape))
    if not shape:
        if len(offsets) != 1:
            raise MismatchError(f"scalar {name!r} must be stored as exactly one chunk, found {len(offsets)}")
        return
    ends = offsets + lengths
    total = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if len(offsets) and ((offsets < 0).any() or (ends > np.asarray(shape, dtype=np.int64)).any()):
        i = int(np.argmax(np.any((offsets < 0) | (ends > np.asarray(shape)), axis=1)))
        raise MismatchError(
            f"tensor {name!r}: box {Box(tuple(offsets[i]), tuple(lengths[i]))} lies outside its global "
            f"shape {list(shape)}; every rank must report boxes inside the global shape"
        )
    if total == 0:
        return
    volume = int(lengths.prod(axis=1).sum()) if shape else len(offsets)
    if volume == total and (not shape or _grid_cells(shape, offsets, ends) is not None):
        return
    pair = _first_overlap(offsets, ends)
    if pair is not None:
        a, b = pair
        raise MismatchError(
            f"tensor {name!r}: boxes {Box(tuple(offsets[a]), tuple(lengths[a]))} and "
            f"{Box(tuple(offsets[b]), tuple(lengths[b]))} partially overlap; shards of one tensor "
            "must be either identical (replicas) or disjoint"
        )
    if volume != total:
        raise MismatchError(
            f"tensor {name!r}: the shards cover {volume} of {total} elements of global shape "
            f"{list(shape)}; some region is held by no rank. Check the placements of this tensor"
        )


class BoxIndex:
    """Finds the stored boxes that intersect a query box without scanning every box.

    Boxes are sorted by their start on dimension 0 with a running maximum of their ends, so the
    candidates for a query are one contiguous range found by two binary searches; the other
    dimensions are then filtered on that range only. Building it is one sort.
    """

    def __init__(self, shape: Sequence[int], offsets: np.ndarray, lengths: np.ndarray):
        self.shape = tuple(int(s) for s in shape)
        self.offsets = _as_boxes(offsets, len(self.shape))
        self.lengths = _as_boxes(lengths, len(self.shape))
        self.ends = self.offsets + self.lengths
        n = len(self.offsets)
        if self.shape and n > 1:
            self._order = np.argsort(self.offsets[:, 0], kind="stable")
            self._start0 = self.offsets[self._order, 0]
            self._maxend0 = np.maximum.accumulate(self.ends[self._order, 0])
        else:
            self._order = None

    def query(self, box: Box) -> np.ndarray:
        """Indices of stored boxes that overlap ``box`` (non-empty intersection)."""
        n = len(self.offsets)
        if not self.shape:
            return np.arange(n)
        q0 = np.asarray(box.offsets, dtype=np.int64)
        q1 = q0 + np.asarray(box.lengths, dtype=np.int64)
        if (q1 <= q0).any():
            return np.empty(0, dtype=np.int64)
        if self._order is None:
            cand = np.arange(n)
        else:
            lo = int(np.searchsorted(self._maxend0, q0[0], side="right"))
            hi = int(np.searchsorted(self._start0, q1[0], side="left"))
            cand = self._order[lo:hi]
        hit = np.all((self.offsets[cand] < q1) & (self.ends[cand] > q0), axis=1)
        return cand[hit]


def grid_tiles(tidx: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, shapes: np.ndarray,
               presorted: bool = False) -> np.ndarray:
    """Per tensor: True where its boxes certainly tile it exactly as a grid (vectorised over tensors).

    ``tidx`` (n,) names each box's tensor in ``range(len(shapes))``; ``offsets``/``lengths`` are
    (n, D) and ``shapes`` (T, D), padded with offset 0, length 1 and size 1 for unused dimensions.
    Boxes must be distinct. A grid tiling: per dimension the distinct intervals of a tensor tile
    [0, size) end to end, each start has one end, and there are as many boxes as grid cells. False
    means "not proven here" (the tensor may still be tiled in a non-grid way, or not at all): callers
    fall back to :func:`check_exact_cover` for those tensors. ``presorted``: the boxes are already in
    (tensor, first offset) order, so the first dimension needs no sort.
    """
    T, D = shapes.shape
    n = len(tidx)
    ok = np.ones(T, dtype=bool)
    cells = np.ones(T, dtype=np.int64)
    if n == 0:
        return ok & (np.prod(shapes, axis=1) == 0) if D else ok & False
    for d in range(D):
        o = offsets[:, d]
        e = o + lengths[:, d]
        if d == 0 and presorted:
            t_s, o_s, e_s = tidx, o, e
        else:
            idx = np.lexsort((o, tidx))
            t_s, o_s, e_s = tidx[idx], o[idx], e[idx]
        new = np.ones(n, dtype=bool)
        new[1:] = (t_s[1:] != t_s[:-1]) | (o_s[1:] != o_s[:-1])
        dup_bad = ~new[1:] & (e_s[1:] != e_s[:-1])
        if dup_bad.any():
            ok[t_s[1:][dup_bad]] = False
        t_i, o_i, e_i = t_s[new], o_s[new], e_s[new]
        first_of_t = np.ones(len(t_i), dtype=bool)
        first_of_t[1:] = t_i[1:] != t_i[:-1]
        last_of_t = np.ones(len(t_i), dtype=bool)
        last_of_t[:-1] = t_i[1:] != t_i[:-1]
        bad = (first_of_t & (o_i != 0)) | (last_of_t & (e_i != shapes[t_i, d]))
        chain = ~first_of_t[1:] & (o_i[1:] != e_i[:-1])
        ok[t_i[bad]] = False
        ok[t_i[1:][chain]] = False
        cells *= np.bincount(t_i, minlength=T)
    count = np.bincount(tidx, minlength=T)
    return ok & (count == cells) & (count > 0)
