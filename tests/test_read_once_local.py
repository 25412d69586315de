"""Local read-once schedules (issue 13): each rank plans only its part, at a cost set by its own needs.

Scenario: an HSDP checkpoint (replicas x shards, one row chunk per shard and tensor) loaded in the same
layout, as at 16,384 ranks but smaller; replicated tensors; layouts that are not grids (plans exchanged).
"""

from __future__ import annotations

import numpy as np
import pytest

from hyperdcp.core.boxes import Box
from hyperdcp.core.layout import REPLICATE, GridLayout
from hyperdcp.core.shards import ShardedTensor
from hyperdcp.errors import MismatchError
from hyperdcp.format.metadata import ChunkTable, FileMeta, Metadata, TensorMeta
from hyperdcp.planning.load_plan import Piece
from hyperdcp.planning.read_once import derive_plans, encode_plan
from hyperdcp.planning.read_once_bcast import MeshLines
from hyperdcp.planning.read_once_local import local_schedule, my_part
from hyperdcp.planning.read_once_plans import plans_to_wants
from hyperdcp.planning.read_once_wants import grid_wants, own_plan, plan_wants


def hsdp(R: int, S: int, T: int, rows_per: int = 4, cols: int = 64, placements=(REPLICATE, 0)):
    """T matrices saved as S row chunks (one file per shard), and the (R, S) destination layout."""
    nb = rows_per * cols * 4
    tensors = {}
    for t in range(T):
        offs = np.zeros((S, 2), np.int64)
        offs[:, 0] = np.arange(S) * rows_per
        begin = np.full(S, 64 + t * nb, np.int64)
        tensors[f"layer{t}.weight"] = TensorMeta("F32", (rows_per * S, cols), ChunkTable(
            offs, np.tile(np.array([rows_per, cols], np.int64), (S, 1)), np.arange(S, dtype=np.int64), begin,
            begin + nb, ["0" * 16] * S))
    meta = Metadata(R * S, [FileMeta(f"f{i}", 64 + T * nb) for i in range(S)], tensors, {})
    mesh = np.arange(R * S).reshape(R, S)
    layout = GridLayout(mesh, placements, GridLayout.digest_mesh(mesh))
    return meta, [ShardedTensor(n, "F32", (rows_per * S, cols), [], layout=layout) for n in tensors]


def part(meta, sts, world, rank, host=None):
    entries = {(ti, ci, b): e for e, (ti, ci, b) in enumerate(own_plan(meta, sts, rank))}
    return local_schedule(meta, grid_wants(meta, sts, world, host or [rank], entries, rank), True, 256 << 20, rank)


def test_a_ranks_part_is_the_same_at_any_world_size():
    """Rank 3's chunks are needed by its 8 replicas whatever the number of shards: its part of the
    schedule is as large at 64 as at 4,096 ranks (which replica reads which chunk may differ)."""
    parts = []
    for S in (8, 512):
        meta, sts = hsdp(8, S, 20)
        s = part(meta, sts, 8 * S, 3)
        assert len(s.units) == 20 and all(len(u.group) == 8 for u in s.units)  # one chunk per tensor, 8 replicas
        mine = [u for u in s.units if u.reader == 3]
        assert len(mine) in (2, 3) and all(len(u.needs) == 8 for u in mine)  # 20 chunks over 8 replicas
        assert sum(len(u.needs) for u in s.units) == 20 + 7 * len(mine)  # its own needs, and whom it sends to
        parts.append(sorted((u.key, u.nbytes, len(u.group)) for u in s.units))
    assert parts[0] == parts[1]


def test_readers_are_balanced_within_and_across_groups():
    """Every replica group spreads its tensors' chunks over its members: max/mean bytes read <= 1.05."""
    meta, sts = hsdp(8, 16, 100)
    ref = local_schedule(meta, plan_wants(meta, derive_plans(meta, sts, 128)), True, 256 << 20)
    loads = np.asarray(ref.read_bytes, dtype=np.float64)
    assert loads.min() > 0 and loads.max() / loads.mean() <= 1.05
    assert sum(ref.read_bytes) == sum(t.nbytes for t in meta.tensors.values())  # each byte read once
    # and each rank, alone, computes what it reads in the global schedule
    for r in (0, 77, 127):
        assert part(meta, sts, 128, r).read_bytes[r] == ref.read_bytes[r]


def test_replicated_tensors_go_round_the_ranks_and_receivers_keep_only_their_needs():
    """Tensors every rank holds whole: readers rotate over all ranks; a rank lists every needer only for
    the units it reads (it sends them), for the others only itself."""
    meta, sts = hsdp(1, 1, 12, placements=(REPLICATE,))
    world = 6
    lay = GridLayout.replicated(world)
    sts = [ShardedTensor(s.fqn, s.dtype, s.shape, [], layout=lay) for s in sts]
    reads = []
    for r in range(world):
        s = part(meta, sts, world, r)
        assert len(s.units) == 12
        mine = [u for u in s.units if u.reader == r]
        reads.append(len(mine))
        assert all(sorted(n.rank for n in u.needs) == list(range(world)) for u in mine)
        assert all([n.rank for n in u.needs] == [r] for u in s.units if u.reader != r)
    assert reads == [2] * world


def test_a_host_plans_its_ranks_together():
    """The ranks of one host compute the same units (readers, batches), so they agree on shared memory."""
    meta, sts = hsdp(2, 8, 10)
    host = list(range(4, 8))
    views = [[(u.key, u.reader, u.batch, u.lo, u.hi) for u in part(meta, sts, 16, r, host).units] for r in host]
    assert all(v == views[0] for v in views) and len(views[0]) == 40
    ref = local_schedule(meta, plan_wants(meta, derive_plans(meta, sts, 16)), True, 256 << 20)
    for r in host:
        assert my_part(part(meta, sts, 16, r, host), r) == my_part(ref, r)


def test_exchanged_plans_give_the_same_part_as_the_layouts():
    """Layouts that are not grids: from the exchanged plans a rank keeps only the chunks its host needs."""
    meta, sts = hsdp(2, 4, 5)
    plans = derive_plans(meta, sts, 8)
    names = list(meta.tensors)
    raws = [encode_plan(meta, [Piece(names[ti], ci, box, None) for ti, ci, box in plan]) for plan in plans]
    for r in range(8):
        wants = plans_to_wants(meta, raws, [r])
        assert {k[1] for k in wants.chunks} == {r % 4}  # its shard's chunk of every tensor, nothing more
        from_plans = local_schedule(meta, wants, True, 256 << 20, r)
        assert my_part(from_plans, r) == my_part(part(meta, sts, 8, r), r)
        assert my_part(from_plans, r) == my_part(
            local_schedule(meta, plan_wants(meta, plans, [r]), True, 256 << 20, r), r)


def test_a_malformed_exchanged_plan_names_its_rank():
    meta, sts = hsdp(1, 2, 1)
    good = encode_plan(meta, [Piece("layer0.weight", 0, Box((0, 0), (4, 64)), None)])
    outside = encode_plan(meta, [Piece("layer0.weight", 0, Box((0, 0), (5, 64)), None)])  # chunk 0 has 4 rows
    with pytest.raises(MismatchError, match="rank 1 .*not inside chunk"):
        plans_to_wants(meta, [good, outside], [0])
    with pytest.raises(MismatchError, match="rank 0 is malformed"):
        plans_to_wants(meta, [b"junk", good], [1])


def test_mesh_groups_are_recognised_without_listing_them():
    mesh = np.arange(12).reshape(3, 4)
    lines = MeshLines(12)
    lines.add(mesh)
    assert frozenset({1, 5, 9}) in lines and frozenset({4, 5, 6, 7}) in lines and frozenset(range(12)) in lines
    assert (frozenset({1, 5}) not in lines and frozenset({0, 5, 10}) not in lines
            and frozenset({0, 1, 4, 5}) not in lines)


def test_strided_layouts_give_several_boxes_per_rank():
    """FSDP2-style strided shards: a rank holding two runs needs two boxes; the index finds both."""
    meta, _ = hsdp(1, 4, 1, rows_per=2, cols=3)  # an 8 x 3 tensor in 4 row chunks
    mesh = np.arange(2)
    lay = GridLayout(mesh, (0,), GridLayout.digest_mesh(mesh), split_factors=(2,))
    st = ShardedTensor("layer0.weight", "F32", (8, 3), [], layout=lay)
    assert [p[2] for p in own_plan(meta, [st], 0)] == [Box((0, 0), (2, 3)), Box((4, 0), (2, 3))]
    assert own_plan(meta, [st], 0) == derive_plans(meta, [st], 2, only=0)[0]
