"""Scenarios ported from torch's own checkpoint tests (test/distributed/checkpoint), run through hyperdcp.

From test_dtensor_resharding.py: placement changes on a 1-D and a 2-D mesh, 1-D <-> 2-D mesh
changes, empty shards, uneven ``from_local`` shards loaded into a plain tensor, and uneven custom
shards through ``LocalShardsWrapper``. From test_file_system_checkpoint_cpu.py: switching between
a legacy ``ShardedTensor`` (chunk and enumerable sharding specs, several shards per rank) and a plain
tensor. Where torch compares with ``assertEqual`` these compare bit for bit. All run in one 4-rank job;
each test checks its scenario.
"""

from __future__ import annotations

import itertools
import os

import pytest

torch = pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from tests.dist import outcome, run_ranks, run_scenarios  # noqa: E402


def _p(name: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}[name]


ONE_D = [["S0"], ["R"]]
TWO_D = [["R", "R"], ["R", "S0"], ["S0", "R"], ["S0", "S0"]]


def _full(dt):
    return dt.full_tensor() if hasattr(dt, "full_tensor") else dt


def scenario_1d_to_1d_and_2d_to_2d_placement_change(rank, world, tmp):
    """test_1d_to_1d_reshard_placement_change, test_2d_to_2d_reshard_placement_change."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, zeros

    g = torch.arange(16, dtype=torch.float).view(4, 4)
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2))
    n = 0
    for mesh, options in [(mesh1, ONE_D), (mesh2, TWO_D)]:
        for src, dst in itertools.permutations(options, 2):
            path = os.path.join(tmp, f"pc-{n}")
            n += 1
            hyperdcp.save({"dtensor": distribute_tensor(g, mesh, [_p(x) for x in src])}, path)
            state = {"dtensor": zeros([4, 4], device_mesh=mesh, placements=[_p(x) for x in dst])}
            hyperdcp.load(state, path, read_once=n % 2 == 0)
            assert torch.equal(state["dtensor"].full_tensor(), g), (src, dst)
    return n


def scenario_1d_to_2d_and_2d_to_1d_mesh_change(rank, world, tmp):
    """test_1d_to_2d_reshard_mesh_change, test_2d_to_1d_reshard_mesh_change."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, zeros

    g = torch.arange(16, dtype=torch.float).view(4, 4)
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2))
    n = 0
    for (m_src, o_src), (m_dst, o_dst) in [((mesh1, ONE_D), (mesh2, TWO_D)), ((mesh2, TWO_D), (mesh1, ONE_D))]:
        for src in o_src:
            path = os.path.join(tmp, f"mc-{n}")
            n += 1
            hyperdcp.save({"dtensor": distribute_tensor(g, m_src, [_p(x) for x in src])}, path)
            for dst in o_dst:
                state = {"dtensor": zeros([4, 4], device_mesh=m_dst, placements=[_p(x) for x in dst])}
                hyperdcp.load(state, path)
                assert torch.equal(state["dtensor"].full_tensor(), g), (src, dst)
    return n


def scenario_empty_shard(rank, world, tmp):
    """test_dtensor_checkpoint_resharding_with_empty_shard: one element over 4 ranks, loaded on (2, 2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.tensor([0.25])
    path = os.path.join(tmp, "empty")
    hyperdcp.save({"dtensor": distribute_tensor(g, init_device_mesh("cpu", (world,)), [Shard(0)])}, path)
    state = {"dtensor": distribute_tensor(torch.zeros(1), init_device_mesh("cpu", (2, world // 2)),
                                          [Shard(0), Shard(0)])}
    hyperdcp.load(state, path)
    assert torch.equal(state["dtensor"].full_tensor(), g)
    return True


def scenario_uneven_from_local_into_plain_tensor(rank, world, tmp):
    """test_dtensor_checkpoint_with_uneven_shards: rows 4/4/4/2 by from_local, loaded into a full tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rows = 2 if rank == world - 1 else 4
    local = torch.arange(rank * 4, rank * 4 + rows, dtype=torch.float).view(rows, 1)
    dt = DTensor.from_local(local, init_device_mesh("cpu", (world,)), [Shard(0)], run_check=True,
                            shape=torch.Size([14, 1]), stride=torch.Size([1, 1]))
    path = os.path.join(tmp, "uneven")
    hyperdcp.save({"uneven_sharded_dtensor": dt}, path)
    state = {"uneven_sharded_dtensor": torch.rand([14, 1])}  # re-sharding load into a plain tensor
    hyperdcp.load(state, path)
    assert torch.equal(state["uneven_sharded_dtensor"], torch.arange(14, dtype=torch.float).view(14, 1))
    return True


def scenario_uneven_shards_wrapper(rank, world, tmp):
    """test_uneven_reshard_with_dtensor_shards_wrapper_api: custom uneven shards saved and loaded
    with another uneven plan, into the LocalShardsWrapper's own shard tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    saving = [(0, 4), (4, 3), (7, 4), (11, 5)]
    loading = [(0, 6), (6, 2), (8, 1), (9, 7)]
    mesh = init_device_mesh("cpu", (world,))
    off, ln = saving[rank]
    wrapper = LocalShardsWrapper(local_shards=[torch.arange(off, off + ln, dtype=torch.float).view(ln, 1)],
                                 local_offsets=[(off, 0)])
    dt = DTensor.from_local(wrapper, mesh, [Shard(0)], shape=torch.Size([16, 1]), stride=torch.Size([1, 1]))
    path = os.path.join(tmp, "wrapper")
    hyperdcp.save({"checkpointable_tensor": dt}, path)
    for read_once in (True, False):
        off, ln = loading[rank]
        target = torch.rand([ln, 1])
        wrapper = LocalShardsWrapper(local_shards=[target], local_offsets=[(off, 0)])
        dt = DTensor.from_local(wrapper, mesh, [Shard(0)], shape=torch.Size([16, 1]), stride=torch.Size([1, 1]))
        hyperdcp.load({"checkpointable_tensor": dt}, path, read_once=read_once)
        assert torch.equal(target, torch.arange(off, off + ln, dtype=torch.float).view(ln, 1)), read_once
    # and the whole tensor, as a plain tensor
    plain = {"checkpointable_tensor": torch.zeros(16, 1)}
    hyperdcp.load(plain, path)
    assert torch.equal(plain["checkpointable_tensor"], torch.arange(16, dtype=torch.float).view(16, 1))
    return True


def scenario_switch_between_sharded_tensor_and_tensor(rank, world, tmp):
    """test_switch_between_sharded_tensor_to_tensor (2 of the ranks' worth of specs, on every rank of
    the group): a legacy ShardedTensor saved and loaded into a plain tensor, and a plain tensor
    loaded into a ShardedTensor in place, for every pair of sharding specs."""
    import torch.distributed as dist
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata

    size = 32
    specs = [
        ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)]),
        ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:1/cpu", "rank:0/cpu"]),
        EnumerableShardingSpec(shards=[ShardMetadata(shard_offsets=[0], shard_sizes=[8], placement="rank:1/cpu"),
                                       ShardMetadata(shard_offsets=[8], shard_sizes=[size - 8],
                                                     placement="rank:0/cpu")]),
        EnumerableShardingSpec(shards=[ShardMetadata(shard_offsets=[0], shard_sizes=[10], placement="rank:0/cpu"),
                                       ShardMetadata(shard_offsets=[10], shard_sizes=[size - 10],
                                                     placement="rank:3/cpu")]),
    ]

    def gather(st) -> torch.Tensor:
        out = torch.zeros(size)
        for sh in st.local_shards():
            o, n = sh.metadata.shard_offsets[0], sh.metadata.shard_sizes[0]
            out[o:o + n] = sh.tensor
        dist.all_reduce(out)  # shards are disjoint: the sum is the whole tensor
        return out

    n = 0
    for i, save_spec in enumerate(specs):
        for j, load_spec in enumerate(specs):
            torch.manual_seed(i * 10 + j)
            save = {"sharded": sharded_tensor.rand(save_spec, size), "replicated": torch.rand(size)}
            dist.broadcast(save["replicated"], src=0)
            path = os.path.join(tmp, f"st-{n}")
            n += 1
            hyperdcp.save(save, path)
            load = {"sharded": torch.zeros(size), "replicated": sharded_tensor.zeros(load_spec, size)}  # swapped
            hyperdcp.load(load, path, read_once=n % 2 == 0)
            assert torch.equal(load["sharded"], gather(save["sharded"])), (i, j)
            assert torch.equal(gather(load["replicated"]), save["replicated"]), (i, j)
    # ShardedTensor -> ShardedTensor with another spec, in place
    src = sharded_tensor.rand(specs[1], size)
    path = os.path.join(tmp, "st-st")
    hyperdcp.save({"t": src}, path)
    dst = sharded_tensor.zeros(specs[2], size)
    hyperdcp.load({"t": dst}, path)
    assert torch.equal(gather(dst), gather(src))
    return n


SCENARIOS = [
    scenario_1d_to_1d_and_2d_to_2d_placement_change,
    scenario_1d_to_2d_and_2d_to_1d_mesh_change,
    scenario_empty_shard,
    scenario_uneven_from_local_into_plain_tensor,
    scenario_uneven_shards_wrapper,
    scenario_switch_between_sharded_tensor_and_tensor,
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(4, run_scenarios, str(tmp_path_factory.mktemp("dcp")), SCENARIOS, timeout=240)


_outcome = outcome


def test_placement_change_on_1d_and_2d_meshes(results):
    assert _outcome(results, "scenario_1d_to_1d_and_2d_to_2d_placement_change") == [2 + 12] * 4


def test_mesh_change_1d_to_2d_and_back(results):
    assert _outcome(results, "scenario_1d_to_2d_and_2d_to_1d_mesh_change") == [2 + 4] * 4


def test_empty_shards_reshard(results):
    assert all(_outcome(results, "scenario_empty_shard"))


def test_uneven_from_local_shards_into_plain_tensor(results):
    assert all(_outcome(results, "scenario_uneven_from_local_into_plain_tensor"))


def test_uneven_local_shards_wrapper_reshard(results):
    assert all(_outcome(results, "scenario_uneven_shards_wrapper"))


def test_switch_between_legacy_sharded_tensor_and_tensor(results):
    assert _outcome(results, "scenario_switch_between_sharded_tensor_and_tensor") == [16] * 4
