"""Read-once broadcasts: units whose needers form one mesh-dim group go by one broadcast in it.

Whether a set of ranks is a group (a line of a DeviceMesh: ranks that differ in one mesh coordinate
only) is answered per set from the rank's mesh coordinates, so no rank lists every group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from ..core.shards import ShardedTensor

if TYPE_CHECKING:
    from .read_once import Schedule


class MeshLines:
    """The member sets of every mesh-dim group of some meshes, and all ``world`` ranks (``in`` only)."""

    def __init__(self, world: int):
        self.world = world
        self._meshes: list[tuple[np.ndarray, np.ndarray]] = []  # (where: rank -> flat position, shape)

    def add(self, grid: np.ndarray) -> None:
        flat = grid.reshape(-1)
        where = np.full(max(self.world, int(flat.max()) + 1 if flat.size else 0), -1, np.int64)
        where[flat] = np.arange(flat.size)
        self._meshes.append((where, np.asarray(grid.shape)))

    def __contains__(self, ranks: Iterable[int]) -> bool:
        rs = np.asarray(sorted(ranks), np.int64)
        if len(rs) == self.world and (len(rs) == 0 or (rs[0] == 0 and rs[-1] == self.world - 1)):
            return True
        if len(rs) < 2 or rs[0] < 0:
            return False
        for where, shape in self._meshes:
            if rs[-1] >= len(where):
                continue
            pos = where[rs]
            if (pos < 0).any():
                continue
            coords = np.stack(np.unravel_index(pos, tuple(shape)), axis=1)
            varies = np.nonzero((coords != coords[0]).any(axis=0))[0]
            if len(varies) == 1 and len(rs) == shape[varies[0]]:
                return True
        return False


def broadcast_groups(
    tensors: Sequence[ShardedTensor], me: int, world: int, whole: Any
) -> tuple[MeshLines, dict[frozenset[int], Any]]:
    """(every mesh-dim group's member set, known identically on every rank; this rank's handle for each
    set it belongs to). Groups come with the layouts (a DeviceMesh's own groups), plus ``whole`` for all
    ranks: none is created here. Tensors are walked in order, so members pick the same handle."""
    lines = MeshLines(world)
    mine: dict[frozenset[int], Any] = {frozenset(range(world)): whole}
    seen: set[bytes] = set()
    for st in tensors:
        lay = st.layout
        if lay is None or lay.mesh_key in seen:
            continue
        seen.add(lay.mesh_key)
        grid = np.asarray(lay.mesh)
        lines.add(grid)
        where = np.argwhere(grid == me)
        if not len(where) or len(lay.groups) != grid.ndim:
            continue
        coord = tuple(int(c) for c in where[0])
        for d, handle in enumerate(lay.groups):
            line = frozenset(grid[coord[:d] + (slice(None),) + coord[d + 1:]].reshape(-1).tolist())
            mine.setdefault(line, handle)
    return lines, mine


def mark_broadcasts(sched: "Schedule", lines: Any, hosts: Sequence[str]) -> None:
    """Units whose needers all want the same contiguous bytes, form one group's member set and sit on
    other hosts than the reader (else shared memory serves them) go by one broadcast in that group.
    Units of a local schedule are judged by all their needing ranks (``group``), not only those kept."""
    for u in sched.units:
        u.bcast = False
        if u.group is not None:
            ranks = u.group.tolist()
            if len(ranks) < 2 or not u.same:
                continue
        else:
            if len(u.needs) < 2:
                continue
            box = u.needs[0].box
            ranks = [n.rank for n in u.needs]
            if len(set(ranks)) != len(ranks) or not all(n.contiguous and n.box == box for n in u.needs):
                continue
        if all(hosts[r] != hosts[u.reader] for r in ranks if r != u.reader) and frozenset(ranks) in lines:
            u.bcast = True
