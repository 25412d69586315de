"""JAX arrays: a ``jax.Array`` under any sharding -> this process's boxes (see docs/JAX.md).

A hyperdcp rank is a JAX *process* (``jax.process_index()``); the devices of one process are not ranks.
Each process saves and loads only its addressable shards: the boxes come from the sharding's
``devices_indices_map`` (one box per distinct index among this process's devices: two local devices
holding the same slice give one shard), the replicas from the device assignment (every process with a
device holding that box), so that the save planner writes each box once and loads read it once.

Loading targets are :class:`~hyperdcp.adapters.jax_tree.JaxTarget` wrappers (made by
:func:`hyperdcp.adapters.jax_tree.flatten`) around a ``jax.Array`` or a ``jax.ShapeDtypeStruct`` with a
sharding: the bytes land in one host buffer per distinct box (read straight into it when a stored chunk
is that box) -- or, when this process's devices split only the first dim of a box they tile together,
in one buffer for that box, whose device views are contiguous -- and ``finish`` builds a *new* array
placed on the target's devices (JAX arrays are immutable). Measured on 8 CPU devices: reading a union
whose device views are strided costs two extra copies (into the union, then out of it per device), more
than one buffer per device box.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jax
import numpy as np

from ..core import dtypes
from ..core.boxes import Box
from ..core.layout import REPLICATE, GridLayout, replicated_layout
from ..core.shards import LocalShard, ShardedTensor, flat_bytes
from ..errors import StateDictError
from .jax_tree import JaxTarget


def is_tensor(value: Any) -> bool:
    return isinstance(value, (jax.Array, JaxTarget))


def describe(value: Any) -> str:
    if isinstance(value, JaxTarget):
        value = value.leaf
    sharding = getattr(value, "sharding", None)
    kind = "jax.ShapeDtypeStruct" if isinstance(value, jax.ShapeDtypeStruct) else "jax.Array"
    return f"{kind} {tuple(value.shape)} {value.dtype} with {type(sharding).__name__ if sharding else 'no sharding'}"


def _box(index: tuple, shape: tuple[int, ...]) -> Box:
    """The box of a device's index (a tuple of slices, one per dim) in an array of ``shape``."""
    offs, lens = [], []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        if step != 1:  # no sharding of jax does this; refuse rather than store a wrong box
            raise ValueError(f"strided index {sl}")
        offs.append(start)
        lens.append(max(0, stop - start))
    return Box(tuple(offs), tuple(lens))


def _placement(fqn: str, sharding: Any, shape: tuple[int, ...], world: int) -> tuple[dict, dict, GridLayout | None]:
    try:
        return _placement_of(sharding, shape, world)
    except (ValueError, TypeError) as e:  # jax's IndivisibleError and friends
        raise StateDictError(f"{fqn!r}: its sharding {sharding} does not fit the shape {shape}: "
                             f"{str(e).splitlines()[0]}; give it a sharding that divides the shape") from None


@lru_cache(maxsize=4096)
def _placement_of(sharding: Any, shape: tuple[int, ...], world: int) -> tuple[dict, dict, GridLayout | None]:
    """(device -> box, box -> processes holding it, grid layout or None) of ``sharding`` over ``shape``.

    Cached per (sharding, shape): a model's arrays share a handful of shardings, so the walk over every
    device (which grows with the number of devices, as the index map itself does) runs once per pair.
    """
    dev_box = {d: _box(idx, shape) for d, idx in sharding.devices_indices_map(shape).items()}
    holders: dict[Box, set[int]] = {}
    for d, box in dev_box.items():
        holders.setdefault(box, set()).add(int(d.process_index))
    replicas = {box: tuple(sorted(p)) for box, p in holders.items()}
    return dev_box, replicas, _grid(sharding, shape, world, dev_box, replicas)


def _grid(sharding: Any, shape: tuple[int, ...], world: int, dev_box: dict, replicas: dict) -> GridLayout | None:
    """The sharding as a :class:`GridLayout` over processes, where it is one; else None (explicit boxes).

    It is one when every process holds the whole array (replicated), or when the sharding is a
    ``NamedSharding`` whose mesh has exactly one device per process and whose spec splits each tensor
    dim by at most one mesh axis; the derived boxes are checked against the index map before use.
    """
    full = Box(tuple(0 for _ in shape), tuple(shape))
    if len(replicas) == 1 and full in replicas and len(replicas[full]) == world:
        return replicated_layout(world)
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is None or spec is None or not hasattr(mesh, "devices"):
        return None
    devices = np.asarray(mesh.devices)
    procs = np.vectorize(lambda d: int(d.process_index), otypes=[np.int64])(devices)
    if procs.size != world or np.unique(procs).size != world:
        return None
    axis_dim = {}
    for dim, entry in enumerate(tuple(spec)):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        if len(names) > 1:
            return None
        for name in names:
            axis_dim[name] = dim
    placements = tuple(axis_dim.get(name, REPLICATE) for name in mesh.axis_names)
    layout = GridLayout(procs, placements, GridLayout.digest_mesh(procs))
    ranks, offs, lens = layout.boxes(tuple(shape))
    by_proc = {int(d.process_index): b for d, b in dev_box.items()}
    for r, o, n in zip(ranks.tolist(), offs.tolist(), lens.tolist()):
        if by_proc.get(r) != Box(tuple(o), tuple(n)):
            return None
    return layout


def _check_world(fqn: str, coord: Any) -> None:
    if coord.world_size != jax.process_count() or coord.rank != jax.process_index():
        raise StateDictError(
            f"{fqn!r} is a jax.Array, and its shards are placed by JAX process ({jax.process_index()} of "
            f"{jax.process_count()}) but this save/load runs as rank {coord.rank} of {coord.world_size}; run it on "
            "the JAX distributed runtime's coordinator (the default once jax.distributed.initialize() ran, when "
            "torch.distributed is not initialized)"
        )


def _code(fqn: str, dtype: Any) -> str:
    try:
        return dtypes.from_numpy(np.dtype(dtype))
    except Exception as e:  # noqa: BLE001
        raise StateDictError(f"cannot store {fqn!r}: {e}") from None


def to_sharded(fqn: str, value: Any, coord: Any, for_load: bool) -> ShardedTensor:
    if for_load:
        if not isinstance(value, JaxTarget):
            raise StateDictError(f"cannot load into {fqn!r} directly: load the pytree with hyperdcp.load(target, "
                                 "path) and take the new arrays from the result's .state")
        return _for_load(fqn, value, coord)
    if isinstance(value, JaxTarget) or not isinstance(value, jax.Array):
        raise StateDictError(f"cannot save {fqn!r}: it is {describe(value)}, which holds no values; save arrays")
    _check_world(fqn, coord)
    shape = tuple(int(s) for s in value.shape)
    code = _code(fqn, value.dtype)
    dev_box, replicas, layout = _placement(fqn, value.sharding, shape, coord.world_size)
    local = value.addressable_shards
    for s in local:  # start every device-to-host copy before waiting on the first (accelerators)
        try:
            s.data.copy_to_host_async()
        except Exception:  # noqa: BLE001 - an optimisation only
            pass
    shards, seen = [], set()
    for s in local:
        box = dev_box[s.device]
        if box in seen:
            continue
        seen.add(box)
        host = _contiguous(np.asarray(s.data))
        shards.append(LocalShard(box, flat_bytes(host), replicas[box]))
    return ShardedTensor(fqn, code, shape, shards, layout=layout)


def _for_load(fqn: str, target: JaxTarget, coord: Any) -> ShardedTensor:
    leaf = target.leaf
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        raise StateDictError(f"cannot load into {fqn!r}: its jax.ShapeDtypeStruct has no sharding; give it one "
                             "(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)))")
    _check_world(fqn, coord)
    shape = tuple(int(s) for s in leaf.shape)
    np_dtype = np.dtype(leaf.dtype)
    code = _code(fqn, np_dtype)
    canon = np.dtype(jax.dtypes.canonicalize_dtype(np_dtype))
    if canon != np_dtype:  # jax would silently narrow the loaded values
        raise StateDictError(
            f"cannot load into {fqn!r}: its target dtype is {np_dtype}, which JAX stores as {canon} while "
            f"jax_enable_x64 is off; enable it (jax.config.update('jax_enable_x64', True)) or give the target "
            f"dtype {canon} and pass allow_cast=True")
    dev_box, replicas, layout = _placement(fqn, sharding, shape, coord.world_size)
    local = [d for d in sharding.addressable_devices if d in dev_box]
    distinct = list(dict.fromkeys(dev_box[d] for d in local))
    union = _union(distinct) if len(distinct) > 1 else None
    if union is not None and any(b.lengths[1:] != union.lengths[1:] for b in distinct):
        union = None  # device views would be strided: a buffer per device box is read directly, copies less
    if union is not None:  # this process's devices tile one box: read it once, whole, then slice per device
        whole = np.empty(union.lengths, dtype=np_dtype)
        shards = [LocalShard(union, flat_bytes(whole), None)]
        view = lambda box: whole[box.relative_to(union).slices()]  # noqa: E731
    else:
        bufs = {box: np.empty(box.lengths, dtype=np_dtype) for box in distinct}
        shards = [LocalShard(box, flat_bytes(buf), replicas[box]) for box, buf in bufs.items()]
        view = bufs.__getitem__

    def finish() -> None:
        arrays = [jax.device_put(_contiguous(view(dev_box[d])), d) for d in local]
        target.result = jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    return ShardedTensor(fqn, code, shape, shards, finish=finish, layout=layout if union is None else None)


def _contiguous(a: np.ndarray) -> np.ndarray:
    """``a`` C-contiguous (a strided device_put is several times slower than a copy and a plain one)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


def _union(boxes: list[Box]) -> Box | None:
    """The box that the distinct, disjoint device boxes ``boxes`` tile exactly, or None if they tile none."""
    lo = tuple(min(b.offsets[d] for b in boxes) for d in range(boxes[0].ndim))
    hi = tuple(max(b.ends[d] for b in boxes) for d in range(boxes[0].ndim))
    outer = Box(lo, tuple(h - a for a, h in zip(lo, hi)))
    return outer if sum(b.numel for b in boxes) == outer.numel else None
