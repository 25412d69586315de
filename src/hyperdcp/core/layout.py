"""Grid layouts: how a tensor is spread over a mesh of ranks, enough to compute every rank's box.

A tensor whose layout is known this way (a DTensor's mesh and ``Shard(d)``/``_StridedShard``/
``Replicate()`` placements, or a plain tensor every rank holds whole) lets each rank work out what
every other rank holds without asking it. Read-once loads use this to skip exchanging load plans.

The split follows torch's ``DTensor`` rule: mesh dimensions are applied in order; ``Shard(d)`` over
``n`` ranks cuts the current extent ``L`` of tensor dim ``d`` into pieces of ``ceil(L / n)``, the
last ones short or empty. A strided shard (torch's ``_StridedShard(d, split_factor=f)``, what FSDP2
produces on top of tensor parallelism) first cuts the current extent into ``f`` pieces the same way,
cuts each of those into ``n``, and gives coordinate ``c`` the ``c``-th sub-piece of every piece, in
order. The indices a rank holds along a dimension are then a few runs of consecutive global indices
(one in the FSDP2 + TP layouts); its boxes are the products of its runs over the dimensions.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

REPLICATE = -1


@dataclass(frozen=True, eq=False)
class GridLayout:
    """``mesh``: the group rank at each mesh position (shape = mesh shape); ``placements``: per mesh
    dimension the tensor dimension it shards, or ``REPLICATE``; ``mesh_key``: a digest of ``mesh``
    (computed once per mesh by the adapter, as meshes are shared by many tensors)."""

    mesh: np.ndarray
    placements: tuple[int, ...]
    mesh_key: bytes
    #: this rank's communication group along each mesh dimension (opaque handles from the adapter,
    #: e.g. a DeviceMesh's process groups), or () when unknown; not part of the layout's identity
    groups: tuple = ()
    #: per mesh dimension the split factor of a strided shard (1: a plain ``Shard``), or () for all 1
    split_factors: tuple[int, ...] = ()

    @property
    def strided(self) -> bool:
        return any(f != 1 for f in self.split_factors)

    @staticmethod
    def digest_mesh(mesh: np.ndarray) -> bytes:
        m = np.ascontiguousarray(mesh, dtype=np.int64)
        h = hashlib.blake2b(digest_size=16)
        h.update(np.asarray(m.shape, dtype=np.int64).tobytes())
        h.update(m.tobytes())
        return h.digest()

    @classmethod
    def replicated(cls, world: int, mesh_key: bytes | None = None) -> "GridLayout":
        mesh = np.arange(world, dtype=np.int64)
        return cls(mesh, (REPLICATE,), mesh_key or cls.digest_mesh(mesh))

    def key(self, shape: tuple[int, ...]) -> bytes:
        """What two ranks must agree on for their views of this tensor's layout to be the same."""
        sf = self.split_factors if self.strided else ()
        return self.mesh_key + np.asarray((len(shape), *shape, len(self.placements), *self.placements, len(sf), *sf),
                                          dtype=np.int64).tobytes()

    def boxes(self, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ranks, offsets, lengths): every mesh rank's boxes, offsets/lengths of shape (rows, ndim).

        One row per rank (empty boxes included) unless a strided shard leaves a rank's indices in
        several runs: then that rank has one row per box, in the order of :func:`local_boxes`, and a
        rank holding nothing has no row.
        """
        if self.strided:
            return self._strided_boxes(tuple(int(s) for s in shape))
        grid = np.asarray(self.mesh, dtype=np.int64)
        n = grid.size
        coords = (np.stack(np.unravel_index(np.arange(n), grid.shape), axis=1) if grid.ndim
                  else np.zeros((1, 0), np.int64))
        offs = np.zeros((n, len(shape)), dtype=np.int64)
        lens = np.tile(np.asarray(shape, dtype=np.int64), (n, 1)) if shape else np.zeros((n, 0), np.int64)
        for i, d in enumerate(self.placements):
            if d == REPLICATE:
                continue
            parts = grid.shape[i]
            cur = lens[:, d]
            chunk = -(-cur // parts)
            start = np.minimum(chunk * coords[:, i], cur)
            size = np.minimum(cur, start + chunk) - start
            offs[:, d] += start
            lens[:, d] = size
        return grid.reshape(-1), offs, lens

    def _strided_boxes(self, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        grid = np.asarray(self.mesh, dtype=np.int64)
        n, nd = grid.size, len(shape)
        coords = np.stack(np.unravel_index(np.arange(n), grid.shape), axis=1)
        sf = self.split_factors
        # per tensor dim: for each rank the index of its run list, and the distinct run lists. A rank's
        # runs along dim d depend only on its coordinates on the mesh dims that shard d
        per_dim: list[tuple[np.ndarray, list[list[tuple[int, int]]]]] = []
        for d in range(nd):
            steps = [i for i, p in enumerate(self.placements) if p == d]
            if not steps:
                per_dim.append((np.zeros(n, np.int64), [[(0, shape[d])] if shape[d] else []]))
                continue
            uniq, inv = np.unique(coords[:, steps], axis=0, return_inverse=True)
            runs = [dim_runs(shape[d], [(int(grid.shape[i]), int(sf[i]), c) for i, c in zip(steps, row)])
                    for row in uniq.tolist()]
            per_dim.append((inv.reshape(-1), runs))
        flat = grid.reshape(-1)
        if all(len(r) == 1 for _, runs in per_dim for r in runs):  # one box per rank (FSDP2 + TP)
            offs = np.empty((n, nd), np.int64)
            lens = np.empty((n, nd), np.int64)
            for d, (inv, runs) in enumerate(per_dim):
                offs[:, d] = np.asarray([r[0][0] for r in runs], np.int64)[inv]
                lens[:, d] = np.asarray([r[0][1] for r in runs], np.int64)[inv]
            return flat, offs, lens
        ranks, rows = [], []
        for k in range(n):
            for box in itertools.product(*(runs[int(inv[k])] for inv, runs in per_dim)):
                ranks.append(int(flat[k]))
                rows.append([o for o, _ in box] + [ln for _, ln in box])
        a = np.asarray(rows, np.int64).reshape(len(rows), 2 * nd)
        return np.asarray(ranks, np.int64), a[:, :nd], a[:, nd:]

    def valid_for(self, ndim: int, world: int) -> bool:
        """Placements name existing tensor dims and every mesh entry is a distinct rank of the group."""
        if len(self.placements) != np.asarray(self.mesh).ndim:
            return False
        if self.split_factors and (len(self.split_factors) != len(self.placements) or any(
                f < 1 or (f > 1 and d == REPLICATE) for f, d in zip(self.split_factors, self.placements))):
            return False
        if any(not (d == REPLICATE or 0 <= d < ndim) for d in self.placements):
            return False
        flat = np.asarray(self.mesh).reshape(-1)
        return bool(flat.size and flat.min() >= 0 and flat.max() < world and np.unique(flat).size == flat.size)


def dim_runs(size: int, steps: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The global indices one rank holds along a tensor dim of ``size``, as runs ``(start, length)``.

    ``steps``: the mesh dims sharding this tensor dim, in mesh order, each ``(n, f, c)``: ``n`` ranks
    on that mesh dim, split factor ``f`` (1 for ``Shard``), this rank's coordinate ``c``. Runs are in
    the order the local tensor holds them; adjacent runs are merged; an empty list means no index.
    """
    runs = [(0, size)] if size else []
    for n, f, c in steps:
        cur = sum(ln for _, ln in runs)
        first = -(-cur // f) if f > 1 else cur
        picks = []  # local positions [a, b) this coordinate keeps, in order
        for j in range(f):
            s0, e0 = min(first * j, cur), min(first * (j + 1), cur)
            piece = e0 - s0
            ch = -(-piece // n)
            a, b = min(ch * c, piece), min(ch * (c + 1), piece)
            if b > a:
                picks.append((s0 + a, s0 + b))
        runs = _select(runs, picks)
    return runs


def _select(runs: list[tuple[int, int]], picks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The runs of global indices at local positions ``picks`` (increasing, disjoint) of ``runs``."""
    out: list[tuple[int, int]] = []
    i, pos = 0, 0  # run i starts at local position pos
    for a, b in picks:
        while i < len(runs) and pos + runs[i][1] <= a:
            pos += runs[i][1]
            i += 1
        j, pj = i, pos
        while a < b and j < len(runs):
            g, ln = runs[j]
            lo, hi = max(a, pj), min(b, pj + ln)
            if hi > lo:
                start = g + lo - pj
                if out and out[-1][0] + out[-1][1] == start:
                    out[-1] = (out[-1][0], out[-1][1] + hi - lo)
                else:
                    out.append((start, hi - lo))
            if pj + ln >= b:
                break
            pj += ln
            j += 1
    return out


def local_boxes(
    shape: Sequence[int], runs_per_dim: Sequence[list[tuple[int, int]]]
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(global offsets, lengths, local offsets) of each box of one rank, from its runs along every dim.

    Boxes are the products of the runs, in C order over the dims (the order :meth:`GridLayout.boxes`
    lists them); local offsets locate each box in the rank's local tensor.
    """
    per_dim = []
    for runs in runs_per_dim:
        local, acc = [], 0
        for g, ln in runs:
            local.append((g, ln, acc))
            acc += ln
        per_dim.append(local)
    return [(tuple(g for g, _, _ in combo), tuple(ln for _, ln, _ in combo), tuple(lo for _, _, lo in combo))
            for combo in itertools.product(*per_dim)]


@lru_cache(maxsize=16)
def replicated_layout(world: int) -> GridLayout:
    """Every rank of a ``world``-rank group holds the whole tensor (plain tensors and arrays)."""
    return GridLayout.replicated(world)


def mesh_lines(mesh: np.ndarray) -> list[frozenset[int]]:
    """Every set of ranks that differ in one mesh coordinate only (the members of each dim's groups)."""
    grid = np.asarray(mesh, dtype=np.int64)
    out = []
    for d in range(grid.ndim):
        lines = np.moveaxis(grid, d, -1).reshape(-1, grid.shape[d])
        out.extend(frozenset(line.tolist()) for line in lines)
    return out
