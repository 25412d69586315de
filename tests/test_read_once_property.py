"""Property: a rank's local read-once schedule is exactly its part of the global schedule.

Random grid layouts (mesh shapes, rank orders, shards, replicas, strided shards), random world sizes
and reshards (saved in one grid layout, loaded in another). The global schedule is built the old way,
from every rank's plan (each rank's pieces, as its own load planning computes them); each rank builds
its own part from the layouts alone, and so does each pretend host (ranks sharing shared memory).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperdcp.core.boxes import Box, BoxIndex
from hyperdcp.core.layout import REPLICATE, GridLayout
from hyperdcp.core.shards import LocalShard, ShardedTensor
from hyperdcp.format.metadata import ChunkTable, FileMeta, Metadata, TensorMeta
from hyperdcp.planning.load_plan import pieces_for
from hyperdcp.planning.read_once import _own_plan, build_schedule
from hyperdcp.planning.read_once_local import local_schedule, my_part
from hyperdcp.planning.read_once_wants import grid_wants, own_plan, plan_wants


@st.composite
def layouts(draw, ndim: int, world: int):
    """A grid layout over some of ``world`` ranks, in a random order."""
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    while int(np.prod(shape)) > world:
        shape = shape[:-1] or [1]
    ranks = draw(st.permutations(range(world)))[: int(np.prod(shape))]
    mesh = np.asarray(ranks, np.int64).reshape(shape)
    places = tuple(draw(st.sampled_from([REPLICATE, *range(ndim)])) for _ in shape)
    strided = draw(st.booleans()) and any(p != REPLICATE for p in places)
    sf = tuple(draw(st.integers(1, 2)) if p != REPLICATE and strided else 1 for p in places) if strided else ()
    return GridLayout(mesh, places, GridLayout.digest_mesh(mesh), split_factors=sf)


def _shards(layout: GridLayout, shape: tuple[int, ...], world: int) -> list[list]:
    ranks, offs, lens = layout.boxes(shape)
    out: list[list] = [[] for _ in range(world)]
    for r, o, ln in zip(ranks.tolist(), offs.tolist(), lens.tolist()):
        out[r].append((tuple(o), tuple(ln)))
    return out


@st.composite
def cases(draw):
    world = draw(st.integers(1, 12))
    ntensors = draw(st.integers(1, 3))
    files, tensors, dest = [], {}, []
    for t in range(ntensors):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        dtype = draw(st.sampled_from(["F32", "U8", "BF16"]))
        isz = {"F32": 4, "U8": 1, "BF16": 2}[dtype]
        saved, loaded = draw(layouts(len(shape), world)), draw(layouts(len(shape), world))
        _, offs, lens = saved.boxes(shape)
        rows = np.unique(np.concatenate([offs, lens], axis=1), axis=0)
        rows = rows[(rows[:, len(shape):] > 0).all(axis=1)]  # the distinct non-empty boxes tile the tensor
        sizes = rows[:, len(shape):].prod(axis=1) * isz
        begin = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) + 64
        files.append(FileMeta(f"f{t}", int(64 + sizes.sum())))
        tensors[f"t{t}"] = TensorMeta(dtype, shape, ChunkTable(rows[:, : len(shape)].copy(),
                                                               rows[:, len(shape):].copy(),
                                                               np.full(len(rows), t, np.int64), begin,
                                                               begin + sizes, ["0" * 16] * len(rows)))
        dest.append((f"t{t}", dtype, shape, loaded))
    meta = Metadata(world, files, tensors, {})
    hosts = draw(st.integers(1, 3))
    batch = draw(st.sampled_from([1, 64, 1 << 20]))
    return meta, dest, world, hosts, batch, draw(st.booleans())


def _per_rank(meta, dest, world):
    """Each rank's destination tensors (shards from its layout) and pieces, as its load plans them."""
    out = []
    for r in range(world):
        sts = []
        for fqn, dtype, shape, layout in dest:
            shards = [LocalShard(Box(o, ln), np.zeros(0, np.uint8)) for o, ln in _shards(layout, shape, world)[r]]
            sts.append(ShardedTensor(fqn, dtype, shape, shards, layout=layout))
        pieces = []
        for s in sts:
            stored = meta.tensors[s.fqn]
            pieces.extend(pieces_for(s, BoxIndex(stored.shape, stored.chunks.offsets, stored.chunks.lengths), stored))
        out.append((sts, pieces))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_local_schedules_are_the_ranks_parts_of_the_global_one(case):
    meta, dest, world, nhosts, batch, verify = case
    ranks = _per_rank(meta, dest, world)
    plans = [_own_plan(meta, pieces) for _, pieces in ranks]
    ref = local_schedule(meta, plan_wants(meta, plans), verify, batch)  # the global schedule, old way
    old = build_schedule(meta, plans, verify, batch)  # the old builder cuts the same units, needing ranks alike

    def units(s):
        return sorted((u.tidx, u.chunk, u.lo, u.hi,
                       sorted((n.rank, n.entry, n.box.offsets, n.box.lengths) for n in u.needs))
                      for u in s.units)

    assert units(ref) == units(old)
    # every needed byte has exactly one reader: units of a chunk are disjoint, each read by one needer
    by_chunk: dict = {}
    for u in ref.units:
        assert u.reader in {n.rank for n in u.needs}
        by_chunk.setdefault((u.tidx, u.chunk), []).append(u)
    for us in by_chunk.values():
        for i, a in enumerate(us):
            for b in us[i + 1:]:
                assert all(na.box.intersect(nb.box) is None for na in a.needs for nb in b.needs)
    for r, (_sts, pieces) in enumerate(ranks):
        got = sum(n.box.numel for u in ref.units for n in u.needs if n.rank == r)
        assert got == sum(p.box.numel for p in pieces)  # disjoint, so an exact cover of its pieces
    hosts = [r * nhosts // max(1, world) for r in range(world)]
    host_units = {}
    for r, (sts, _pieces) in enumerate(ranks):
        assert own_plan(meta, sts, r) == plans[r]  # the layout rule reproduces the rank's own plan
        entries = {(ti, ci, b): e for e, (ti, ci, b) in enumerate(plans[r])}
        alone = local_schedule(meta, grid_wants(meta, sts, world, [r], entries, r), verify, batch, r)
        assert my_part(alone, r) == my_part(ref, r)
        host = [x for x in range(world) if hosts[x] == hosts[r]]
        shared = local_schedule(meta, grid_wants(meta, sts, world, host, entries, r), verify, batch, r)
        assert my_part(shared, r) == my_part(ref, r)
        keys = [(u.key, u.reader, u.batch) for u in shared.units]
        assert host_units.setdefault(hosts[r], keys) == keys  # the host's ranks agree on its units
