"""Grid layouts: how a tensor is spread over a mesh of ranks, enough to compute every rank's box.

A tensor whose layout is known this way (a DTensor's mesh and ``Shard(d)``/``Replicate()``
placements, or a plain tensor every rank holds whole) lets each rank work out what every other rank
holds without asking it. Read-once loads use this to skip exchanging load plans.

The split follows torch's ``DTensor`` rule: mesh dimensions are applied in order; ``Shard(d)`` over
``n`` ranks cuts the current extent ``L`` of tensor dim ``d`` into pieces of ``ceil(L / n)``, the
last ones short or empty.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

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
        return self.mesh_key + np.asarray((len(shape), *shape, len(self.placements), *self.placements),
                                          dtype=np.int64).tobytes()

    def boxes(self, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ranks, offsets, lengths): every mesh rank's box, offsets/lengths of shape (ranks, ndim)."""
        grid = np.asarray(self.mesh, dtype=np.int64)
        n = grid.size
        coords = np.stack(np.unravel_index(np.arange(n), grid.shape), axis=1) if grid.ndim else np.zeros((1, 0), np.int64)
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

    def valid_for(self, ndim: int, world: int) -> bool:
        """Placements name existing tensor dims and every mesh entry is a distinct rank of the group."""
        if len(self.placements) != np.asarray(self.mesh).ndim:
            return False
        if any(not (d == REPLICATE or 0 <= d < ndim) for d in self.placements):
            return False
        flat = np.asarray(self.mesh).reshape(-1)
        return bool(flat.size and flat.min() >= 0 and flat.max() < world and np.unique(flat).size == flat.size)


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
