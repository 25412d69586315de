"""torch layouts beyond Shard/Replicate on a full mesh (issue 10, parts 2-3).

- a ``_StridedShard`` whose local shard is several runs of the global tensor (several boxes per rank);
- a DTensor on a sub-mesh that leaves some ranks out (they hold nothing of it);
- meta-device destinations (loaded into real CPU tensors put in their place, as torch DCP does);
- stateful objects whose ``load_state_dict`` runs collectives, held in a different dict order per rank.

The multi-rank scenarios run in one 2-rank job (spawning ranks is the slow part); each test checks
its own scenario's outcome.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from hyperdcp.core.layout import REPLICATE, GridLayout, dim_runs  # noqa: E402
from tests.dist import outcome, run_ranks, run_scenarios  # noqa: E402

G = torch.arange(14 * 3, dtype=torch.float32).reshape(14, 3) * 1.5  # the global tensor of the scenarios


def _strided(mesh, g=G, sf=2):
    """``g`` as a DTensor on a 1-D mesh with ``_StridedShard(0, split_factor=sf)``: each rank holds the
    c-th part of each of ``sf`` pieces (two runs of rows; 14 rows over 2 x 2: rows 0-3 and 7-10 on rank 0)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    c, n = mesh.get_coordinate()[0], mesh.size(0)
    rows = [s + i for s, ln in dim_runs(g.shape[0], [(n, sf, c)]) for i in range(ln)]
    dt = DTensor.from_local(g[rows].clone(), mesh, [_StridedShard(0, split_factor=sf)], run_check=False,
                            shape=g.shape, stride=g.stride())
    assert torch.equal(dt.full_tensor(), g)  # torch agrees on what each rank holds
    return dt


# -- scenarios (run on every rank of one 2-rank job) -------------------------------------------


def scenario_strided_several_boxes(rank, world, tmp):
    """Save a strided shard held as two runs per rank; load it into the same layout (read-once on:
    plans derived; off), into Shard(1), and into a plain tensor; async_save it too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import hyperdcp.loading.read_once as X  # where read_once looks build_schedule up

    mesh = init_device_mesh("cpu", (world,))
    path = os.path.join(tmp, "strided")
    hyperdcp.save({"w": _strided(mesh)}, path)
    meta = hyperdcp.read_metadata(path)
    chunks = len(meta.tensors["w"].chunks.offsets)
    seen = []
    real = X.build_schedule
    X.build_schedule = lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
    try:
        derived = []
        for read_once in (True, False):
            dst = _strided(mesh, torch.zeros_like(G))
            seen.clear()
            hyperdcp.load({"w": dst}, path, read_once=read_once)
            assert torch.equal(dst.full_tensor(), G), read_once
            derived.append(bool(seen and seen[-1].derived))
    finally:
        X.build_schedule = real
    cols = distribute_tensor(torch.zeros_like(G), mesh, [Shard(1)])
    hyperdcp.load({"w": cols}, path)
    assert torch.equal(cols.full_tensor(), G)
    plain = {"w": torch.zeros_like(G)}
    hyperdcp.load(plain, path)
    assert torch.equal(plain["w"], G)
    # the other direction: a Shard(0) checkpoint into the strided layout
    path2 = os.path.join(tmp, "rows")
    hyperdcp.save({"w": distribute_tensor(G, mesh, [Shard(0)])}, path2)
    dst = _strided(mesh, torch.zeros_like(G))
    hyperdcp.load({"w": dst}, path2)
    assert torch.equal(dst.full_tensor(), G)
    path3 = os.path.join(tmp, "strided-async")
    hyperdcp.async_save({"w": _strided(mesh)}, path3).result(timeout=60)
    plain = {"w": torch.zeros_like(G)}
    hyperdcp.load(plain, path3)
    assert torch.equal(plain["w"], G)
    return {"chunks": chunks, "derived": derived}


def scenario_sub_mesh(rank, world, tmp):
    """``distribute_tensor(torch.arange(4.), DeviceMesh("cpu", [0]), [Shard(0)])`` on 2 ranks: rank 1 is
    outside the mesh and holds nothing; the tensor is stored from rank 0 and loads back on the same
    sub-mesh (rank 1 receives nothing) and into plain tensors on both ranks."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sub = DeviceMesh("cpu", [0])
    full = init_device_mesh("cpu", (world,))
    path = os.path.join(tmp, "sub")
    b = torch.arange(6.0) - 2
    hyperdcp.save({"w": distribute_tensor(torch.arange(4.0), sub, [Shard(0)]),
                   "b": distribute_tensor(b, full, [Shard(0)])}, path)
    meta = hyperdcp.read_metadata(path)
    assert list(meta.tensors["w"].shape) == [4]
    out = {}
    for read_once in (True, False):
        st = {"w": distribute_tensor(torch.zeros(4), sub, [Shard(0)]),
              "b": distribute_tensor(torch.zeros(6), full, [Shard(0)])}
        res = hyperdcp.load(st, path, read_once=read_once)
        assert st["w"].to_local().tolist() == ([0.0, 1.0, 2.0, 3.0] if rank == 0 else [])
        assert torch.equal(st["b"].full_tensor(), b)
        out[read_once] = res.bytes_read
        plain = {"w": torch.zeros(4), "b": torch.zeros(6)}
        hyperdcp.load(plain, path, read_once=read_once)
        assert plain["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and torch.equal(plain["b"], b)
    return out


def scenario_meta_dtensor(rank, world, tmp):
    """A meta-device DTensor destination becomes a real CPU DTensor with the same mesh and placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    path = os.path.join(tmp, "meta")
    hyperdcp.save({"w": distribute_tensor(G, mesh, [Shard(0)]), "p": G[0].clone()}, path)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, _ = compute_local_shape_and_global_offset(G.shape, mesh, [Shard(1)])
    w = DTensor.from_local(torch.empty(local_shape, device="meta"), mesh, [Shard(1)], run_check=False,
                           shape=G.shape, stride=G.stride())
    st = {"w": w, "p": torch.empty(3, device="meta")}
    assert st["w"].device.type == "meta"
    hyperdcp.load(st, path)
    assert isinstance(st["w"], DTensor) and st["w"].device.type == "cpu" and list(st["w"].placements) == [Shard(1)]
    assert torch.equal(st["w"].full_tensor(), G)
    assert st["p"].device.type == "cpu" and torch.equal(st["p"], G[0])
    return True


class _Collective:
    """A stateful object whose state_dict and load_state_dict run a collective (as a dataloader's or
    an app state's built on get_state_dict may)."""

    def __init__(self, name: str):
        self.name, self.value, self.seen = name, 0, []

    def _gather(self, what: str) -> None:
        import torch.distributed as dist

        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, self.name)  # every rank must be at the same object now
        self.seen.append((what, names))

    def state_dict(self):
        self._gather("state_dict")
        return {"value": self.value}

    def load_state_dict(self, sd):
        self._gather("load_state_dict")
        self.value = sd["value"]


def scenario_stateful_order(rank, world, tmp):
    """Rank 0 holds {A, B}, rank 1 {B, A}: state_dict and load_state_dict run on every rank in one order."""
    path = os.path.join(tmp, "stateful")
    a, b = _Collective("A"), _Collective("B")
    a.value, b.value = 1, 2
    hyperdcp.save({"A": a, "B": b} if rank == 0 else {"B": b, "A": a}, path)
    saved = {"A": a.seen, "B": b.seen}
    a, b = _Collective("A"), _Collective("B")
    hyperdcp.load({"A": a, "B": b} if rank == 0 else {"B": b, "A": a}, path)
    assert (a.value, b.value) == (1, 2)
    return {"save": saved, "load": {"A": a.seen, "B": b.seen}}


def scenario_async_custom_shards(rank, world, tmp):
    """async_save of a legacy ShardedTensor (two shards per rank) and of custom uneven shards in a
    LocalShardsWrapper, loaded back as plain tensors."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:1/cpu", "rank:0/cpu"])
    legacy = sharded_tensor.zeros(spec, 14, 3)
    for sh in legacy.local_shards():
        o, n = sh.metadata.shard_offsets[0], sh.metadata.shard_sizes[0]
        sh.tensor.copy_(G[o:o + n])
    off, ln = [(0, 9), (9, 5)][rank]
    wrapper = LocalShardsWrapper([G[off:off + ln].clone()], [(off, 0)])
    dt = DTensor.from_local(wrapper, init_device_mesh("cpu", (world,)), [Shard(0)], shape=G.shape, stride=G.stride())
    path = os.path.join(tmp, "async-custom")
    hyperdcp.async_save({"legacy": legacy, "wrapped": dt}, path).result(timeout=60)
    plain = {"legacy": torch.zeros_like(G), "wrapped": torch.zeros_like(G)}
    hyperdcp.load(plain, path)
    assert torch.equal(plain["legacy"], G) and torch.equal(plain["wrapped"], G)
    return len(legacy.local_shards())


def scenario_partial_refused(rank, world, tmp):
    """A Partial DTensor is refused on every rank with an error naming it and saying what to do."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    dt = DTensor.from_local(torch.ones(3), init_device_mesh("cpu", (world,)), [Partial()])
    try:
        hyperdcp.save({"grad": dt}, os.path.join(tmp, "partial"))
    except hyperdcp.CheckpointError as e:
        return str(e)
    return None


SCENARIOS = [scenario_strided_several_boxes, scenario_sub_mesh, scenario_meta_dtensor, scenario_stateful_order,
             scenario_async_custom_shards, scenario_partial_refused]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(2, run_scenarios, str(tmp_path_factory.mktemp("layouts")), SCENARIOS, timeout=180)


_outcome = outcome


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2), (2, 3)])
def test_strided_grid_boxes_follow_torch_rule(mesh_shape):
    """Every rank's boxes from GridLayout equal the indices torch's own _StridedShard rule gives."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    options = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3)]
    mesh = np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape)
    for shape in [(7, 5), (12, 6), (1, 2)]:
        for placements in itertools.product(options, repeat=len(mesh_shape)):
            if not any(isinstance(p, _StridedShard) for p in placements):
                continue
            layout = GridLayout(mesh, tuple(REPLICATE if isinstance(p, Replicate) else p.dim for p in placements),
                                GridLayout.digest_mesh(mesh), (),
                                tuple(getattr(p, "split_factor", 1) if not isinstance(p, Replicate) else 1
                                      for p in placements))
            ranks, offs, lens = layout.boxes(shape)
            for r in range(mesh.size):
                coord = np.unravel_index(r, mesh_shape)
                want = []  # torch: per tensor dim the global indices of the local tensor, in order
                for d in range(len(shape)):
                    idx, cur = torch.arange(shape[d]), shape[d]
                    for i, p in enumerate(placements):
                        if isinstance(p, Replicate) or p.dim != d:
                            continue
                        if isinstance(p, _StridedShard):
                            cur, off = p.local_shard_size_and_offset(cur, mesh_shape[i], int(coord[i]),
                                                                     _StridedShardOffsetMode.ALL)
                            idx = idx[torch.tensor(off, dtype=torch.long)] if cur else idx[:0]
                        else:
                            cur, off = Shard.local_shard_size_and_offset(cur, mesh_shape[i], int(coord[i]))
                            idx = idx[off:off + cur]
                    want.append(set(idx.tolist()))
                mine = ranks == r
                got = [set() for _ in shape]
                cells = 0
                for o, n in zip(offs[mine].tolist(), lens[mine].tolist()):
                    cells += int(np.prod(n))
                    for d in range(len(shape)):
                        got[d] |= set(range(o[d], o[d] + n[d]))
                assert got == want or (cells == 0 and 0 in [len(w) for w in want]), (shape, placements, r)
                assert cells == int(np.prod([len(w) for w in want])), (shape, placements, r)  # disjoint boxes


def test_strided_shard_in_several_runs_round_trips(results):
    out = _outcome(results, "scenario_strided_several_boxes")
    assert out[0]["chunks"] == 4  # two boxes per rank, each stored once
    assert all(o["derived"] == [True, False] for o in out)  # read-once derives the multi-box plans


def test_sub_mesh_dtensor_saves_from_its_ranks_and_loads(results):
    out = _outcome(results, "scenario_sub_mesh")
    # without read-once rank 0 reads "w" (16 bytes) and its half of "b" (12), rank 1 only its half of "b"
    assert [o[False] for o in out] == [28, 12]
    assert sum(o[True] for o in out) == 16 + 24  # with read-once: every stored byte read once


def test_meta_device_destination_becomes_a_real_tensor(tmp_path):
    """``hyperdcp.load({"w": torch.empty(4, device="meta")}, p)`` fills a real CPU tensor in its place."""
    path = str(tmp_path / "ckpt")
    w = torch.arange(4.0) * 3
    hyperdcp.save({"w": w, "nested": [torch.ones(2, dtype=torch.int64)]}, path)
    state = {"w": torch.empty(4, device="meta"), "nested": [torch.empty(2, dtype=torch.int64, device="meta")]}
    hyperdcp.load(state, path)
    assert state["w"].device.type == "cpu" and torch.equal(state["w"], w)
    assert state["nested"][0].device.type == "cpu" and state["nested"][0].tolist() == [1, 1]


def test_saving_a_meta_tensor_is_refused_naming_it(tmp_path):
    with pytest.raises(hyperdcp.CheckpointError, match="'w'.*meta device"):
        hyperdcp.save({"w": torch.empty(4, device="meta")}, str(tmp_path / "ckpt"))


def test_meta_device_dtensor_destination(results):
    assert all(_outcome(results, "scenario_meta_dtensor"))


def test_stateful_objects_load_in_one_order_on_every_rank(results):
    for o in _outcome(results, "scenario_stateful_order"):
        assert o["save"] == {"A": [("state_dict", ["A", "A"])], "B": [("state_dict", ["B", "B"])]}, o
        assert o["load"] == {"A": [("state_dict", ["A", "A"]), ("load_state_dict", ["A", "A"])],
                             "B": [("state_dict", ["B", "B"]), ("load_state_dict", ["B", "B"])]}, o


def test_async_save_of_legacy_sharded_tensor_and_shards_wrapper(results):
    assert _outcome(results, "scenario_async_custom_shards") == [2, 2]


def test_partial_placement_is_refused_naming_the_tensor(results):
    for msg in _outcome(results, "scenario_partial_refused"):
        assert msg and "'grad'" in msg and "Replicate()" in msg, msg


def test_a_missing_meta_destination_stays_on_meta_instead_of_uninitialized_memory(tmp_path):
    """With strict=False a key the checkpoint lacks is reported missing and its meta tensor is left as it is."""
    path = str(tmp_path / "ckpt")
    hyperdcp.save({"w": torch.arange(4.0)}, path)
    state = {"w": torch.empty(4, device="meta"), "absent": torch.empty(3, device="meta")}
    res = hyperdcp.load(state, path, strict=False)
    assert res.missing_keys == ["absent"]
    assert state["absent"].device.type == "meta"
    assert torch.equal(state["w"], torch.arange(4.0))
