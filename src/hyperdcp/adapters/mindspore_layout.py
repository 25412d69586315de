"""MindSpore tensor layouts (device matrix + tensor map) as the core's :class:`GridLayout`; no mindspore import.

MindSpore describes how a parameter is split over the devices of a parallel network by a *device
matrix* ``dev_mat`` (a tuple of sizes, e.g. ``(2, 4)``) and a *tensor map* with one entry per tensor
dimension. The convention, as in ``mindspore.parallel.Layout`` and ``mindspore/parallel/_tensor.py``:

* device rank ``r`` (its position in ``rank_list``, by default ``range(prod(dev_mat))``) sits at the
  C-order (row-major) coordinate of ``r`` in ``dev_mat``;
* a tensor-map entry ``k >= 0`` names a device-matrix dimension counted **from the right**:
  ``k`` is ``dev_mat[len(dev_mat) - 1 - k]``; ``-1`` means that tensor dimension is not split;
* an entry may be a tuple ``(k1, k2, ...)``: the tensor dimension is split by several device dims,
  ``k1`` the outermost (``_expand_layout``: reshaped into ``(dev[k1], ..., rest)``);
* splits are even (MindSpore requires every split tensor dim to be divisible by its device count);
  device dims that split no tensor dim hold replicas.

So ``Layout((2, 4), ("dp", "mp"))("mp", "None")`` is ``dev_mat (2, 4)``, ``tensor_map (0, -1)``:
tensor dim 0 is cut in 4 along "mp" (the matrix's last dim), replicated along "dp". In the core's
terms: a mesh of ranks shaped ``dev_mat`` whose axes are reordered so that, for every tensor dim,
its device dims come in outer-to-inner order, and placements naming the tensor dim each mesh axis
splits. :func:`grid_layout` builds that; :func:`local_box` is one rank's box without building it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..core.boxes import Box
from ..core.layout import REPLICATE, GridLayout
from ..errors import StateDictError


@dataclass(frozen=True)
class MsLayout:
    """A MindSpore tensor layout in normal form: ``tensor_map`` entries are tuples of device-dim indices
    counted from the right (``()``: not split), ``rank_list`` the global rank at each device position
    (None: the default ``range(world)``, kept as None so that layouts compare and hash in O(1))."""

    device_matrix: tuple[int, ...]
    tensor_map: tuple[tuple[int, ...], ...]
    rank_list: tuple[int, ...] | None = None

    @property
    def world(self) -> int:
        return int(np.prod(self.device_matrix, dtype=np.int64))

    def ranks(self) -> np.ndarray:
        """The global rank at each device position (C order over the device matrix)."""
        return np.arange(self.world, dtype=np.int64) if self.rank_list is None else np.asarray(self.rank_list, np.int64)

    def split_dims(self) -> tuple[int, ...]:
        """The device-matrix axes (from the left) that split some tensor dim, increasing."""
        return tuple(sorted(self.mesh_dim(k) for ks in self.tensor_map for k in ks))

    def mesh_dim(self, k: int) -> int:
        """The device-matrix axis (counted from the left) that tensor-map index ``k`` names."""
        return len(self.device_matrix) - 1 - k

    def strategy(self) -> tuple[int, ...]:
        """Pieces per tensor dim (MindSpore's ``_get_tensor_strategy``)."""
        return tuple(int(np.prod([self.device_matrix[self.mesh_dim(k)] for k in ks], dtype=np.int64)) for ks in
                     self.tensor_map)


def _entry(fqn: str, e: Any, ndev: int) -> tuple[int, ...]:
    ks = tuple(int(k) for k in e) if isinstance(e, (tuple, list)) else (int(e),)
    ks = tuple(k for k in ks if k != -1)
    if any(not 0 <= k < ndev for k in ks):
        raise StateDictError(f"{fqn!r}: tensor map entry {e!r} names no dimension of a {ndev}-d device matrix; "
                             "entries are -1 or 0..len(device_matrix)-1 counted from the right")
    return ks


def parse_layout(fqn: str, layout: Any) -> MsLayout:
    """Normalize MindSpore's layout descriptions into an :class:`MsLayout`.

    Accepted: a ``mindspore.parallel.Layout`` after it was called with the tensor's axes (its
    ``to_dict()``), that dict itself (``device_matrix``, ``tensor_map``, optional ``rank_list``), or
    a layout list as a parallel network reports it (``cell.parameter_layout_dict[name]``, a strategy
    file's ``[dev_mat, tensor_map, ...]``). Optimizer sharding (a non-empty ``opt_shard_group`` /
    ``opt_weight_shard_size``) and ``interleaved_parallel`` are refused with an explanation.
    """
    if callable(getattr(layout, "to_dict", None)):
        layout = layout.to_dict()
    if isinstance(layout, dict):
        if layout.get("interleaved_parallel"):
            raise StateDictError(f"{fqn!r}: an 'interleaved_parallel' layout keeps several virtual slices on one "
                                 "device; hyperdcp cannot store it yet: save the parameter without it")
        try:
            dev, tmap = layout["device_matrix"], layout["tensor_map"]
        except KeyError as e:
            raise StateDictError(
                f"{fqn!r}: a layout dict needs 'device_matrix' and 'tensor_map' (missing {e})"
            ) from None
        ranks = layout.get("rank_list")
    elif isinstance(layout, (tuple, list)) and len(layout) >= 2:
        dev, tmap, ranks = layout[0], layout[1], None
        opt = layout[5] if len(layout) > 5 else None
        if (isinstance(opt, str) and opt) or (isinstance(opt, (int, np.integer)) and not isinstance(opt, bool)
                                               and int(opt) not in (0, 1)):
            raise StateDictError(f"{fqn!r}: its layout shards it over an optimizer-parallel group ({opt!r}); "
                                 "hyperdcp does not store optimizer-sharded parameters yet: save the parameters "
                                 "gathered over that group (parallel_optimizer off) or describe the slice with a "
                                 "Layout whose tensor map includes the optimizer axis")
    else:
        raise StateDictError(f"{fqn!r}: {type(layout).__name__} is not a MindSpore layout; pass a "
                             "mindspore.parallel.Layout (called with the axes), its to_dict(), or a "
                             "[device_matrix, tensor_map, ...] list from parameter_layout_dict")
    dev = tuple(int(d) for d in dev)
    if not dev or any(d < 1 for d in dev):
        raise StateDictError(f"{fqn!r}: device matrix {dev} must be non-empty with positive sizes")
    entries = tuple(_entry(fqn, e, len(dev)) for e in tmap)
    used = [k for ks in entries for k in ks]
    if len(used) != len(set(used)):
        raise StateDictError(f"{fqn!r}: tensor map {tuple(tmap)} uses a device dimension twice")
    n = int(np.prod(dev, dtype=np.int64))
    if ranks is not None:
        arr = np.asarray(ranks, np.int64).reshape(-1)
        if arr.size != n or np.unique(arr).size != n:
            raise StateDictError(f"{fqn!r}: rank_list has {arr.size} entries ({np.unique(arr).size} distinct) for a "
                                 f"device matrix of {n} devices; give each device position one distinct rank")
        ranks = None if bool((arr == np.arange(n)).all()) else tuple(arr.tolist())
    return MsLayout(dev, entries, ranks)


def check_shape(fqn: str, ms: MsLayout, shape: Sequence[int]) -> None:
    """Raise unless ``shape`` (the full tensor's) fits the layout: one map entry per dim, even splits."""
    if len(shape) != len(ms.tensor_map):
        raise StateDictError(f"{fqn!r}: the tensor has {len(shape)} dims but its tensor map has "
                             f"{len(ms.tensor_map)} entries")
    for d, (s, p) in enumerate(zip(shape, ms.strategy())):
        if s % p:
            raise StateDictError(f"{fqn!r}: dim {d} of shape {tuple(shape)} is split in {p} pieces "
                                 "but is not divisible "
                                 f"by {p}; MindSpore layouts split evenly")


def full_shape(fqn: str, ms: MsLayout, local_shape: Sequence[int]) -> tuple[int, ...]:
    """The full tensor's shape from one slice's shape (every slice of a MindSpore layout has the same)."""
    if len(local_shape) != len(ms.tensor_map):
        raise StateDictError(f"{fqn!r}: the local slice has {len(local_shape)} dims but its tensor map has "
                             f"{len(ms.tensor_map)} entries")
    return tuple(int(s) * p for s, p in zip(local_shape, ms.strategy()))


def coordinate(ms: MsLayout, rank: int) -> tuple[int, ...] | None:
    """The device-matrix coordinate of global ``rank`` (None: the layout does not place it)."""
    if ms.rank_list is None:
        if not 0 <= rank < ms.world:
            return None
        pos = rank
    else:
        try:
            pos = ms.rank_list.index(rank)
        except ValueError:
            return None
    return tuple(int(c) for c in np.unravel_index(pos, ms.device_matrix))


def local_box(ms: MsLayout, shape: Sequence[int], coord: Sequence[int]) -> Box:
    """The box of the full tensor held at device coordinate ``coord``."""
    offs, lens = [], []
    for s, ks in zip(shape, ms.tensor_map):
        piece, idx = int(s), 0
        for k in ks:  # outer to inner: mixed radix over the device dims that split this tensor dim
            n = ms.device_matrix[ms.mesh_dim(k)]
            piece //= n
            idx = idx * n + int(coord[ms.mesh_dim(k)])
        offs.append(idx * piece)
        lens.append(piece)
    return Box(tuple(offs), tuple(lens))


def replica_positions(ms: MsLayout, coord: Sequence[int]) -> np.ndarray:
    """Positions in ``rank_list`` holding the same box as ``coord``: equal coordinates on every splitting
    device dim, any on the others."""
    split = set(ms.split_dims())
    idx = tuple(int(c) if i in split else slice(None) for i, c in enumerate(coord))
    return np.arange(ms.world, dtype=np.int64).reshape(ms.device_matrix)[idx].reshape(-1)


def grid_layout(ms: MsLayout, rank_grid: np.ndarray, mesh_key: bytes | None = None) -> GridLayout:
    """The core's GridLayout of ``ms``; ``rank_grid`` is ``rank_list`` shaped like the device matrix and
    already translated to the coordinator's group ranks.

    Mesh axes are reordered: first, per tensor dim in order, the device dims splitting it (outer first),
    then the replicated ones, so that the core's rule (mesh dims applied in order, each cutting the
    current extent) gives MindSpore's nested even split.
    """
    order, placements = [], []
    for d, ks in enumerate(ms.tensor_map):
        for k in ks:
            order.append(ms.mesh_dim(k))
            placements.append(d)
    for i in range(len(ms.device_matrix)):
        if i not in order:
            order.append(i)
            placements.append(REPLICATE)
    mesh = np.ascontiguousarray(np.transpose(np.asarray(rank_grid, np.int64).reshape(ms.device_matrix), order))
    return GridLayout(mesh, tuple(placements), mesh_key or GridLayout.digest_mesh(mesh))
