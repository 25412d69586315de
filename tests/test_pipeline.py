"""Pipeline parallel (issue 10): ranks hold different tensors. Each tensor is stored from the ranks that hold
it (deduplicated, balanced), and loads into another pipeline split, or none, like any reshard."""

from __future__ import annotations

import zlib

import pytest

torch = pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

LAYERS = 4
SHAPES = {"weight": (6, 4), "norm": (4,)}


def ref(name: str) -> torch.Tensor:
    """The global value of tensor ``name`` (deterministic)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(SHAPES[name.rsplit(".", 1)[1]], generator=g)


def _issue_example(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    torch.manual_seed(rank)
    sd = {f"l{rank}.weight": torch.randn(4, 4)}
    hyperdcp.save(sd, f"{root}/p")
    # the no-collectives async mode cannot know which ranks hold a plain tensor (it takes every rank to);
    # as a DTensor on its stage's mesh the holders are known, and it is written by them
    stage = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    dsd = {f"l{rank}.weight": DTensor.from_local(sd[f"l{rank}.weight"], stage, [Replicate()], run_check=False)}
    hyperdcp.async_save(dsd, f"{root}/none-dtensor", coordination="none").result(timeout=60)
    plain = {f"l{rank}.w0": sd[f"l{rank}.weight"]}
    hyperdcp.async_save(plain, f"{root}/none-plain", coordination="none").result(timeout=60)
    return sd[f"l{rank}.weight"].tolist()  # a list: a tensor would travel by a shared fd that dies with the rank


def test_ranks_saving_different_layer_keys(tmp_path):
    """The issue's example: two ranks, each its own layer; loaded whole in one process."""
    saved = [torch.tensor(t) for t in run_ranks(2, _issue_example, str(tmp_path))]
    for ckpt in ("p", "none-dtensor"):
        back = {"l0.weight": torch.zeros(4, 4), "l1.weight": torch.zeros(4, 4)}
        hyperdcp.load(back, tmp_path / ckpt)
        assert torch.equal(back["l0.weight"], saved[0]) and torch.equal(back["l1.weight"], saved[1]), ckpt
    meta = hyperdcp.read_metadata(tmp_path / "p")
    assert sorted(meta.tensors) == ["l0.weight", "l1.weight"] and not meta.per_rank_tensors
    # plain tensors on some ranks in the no-collectives mode: the writer picked for 'l0.w0' (by a hash of
    # its name among all ranks) is rank 1, which does not hold it -- refused by name, never a silent gap
    with pytest.raises(hyperdcp.MismatchError, match=r"no rank wrote tensor 'l0.w0' \(held whole by rank\(s\) \[0\]\)"):
        hyperdcp.read_metadata(tmp_path / "none-plain")


def _two_stages(rank, world, root):
    """2 pipeline stages x 2 data-parallel ranks: stage s holds layers 2s and 2s+1, FSDP-sharded within
    the stage (weights Shard(0), norms replicated on the stage's two ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, pp = mesh["dp"], mesh.get_coordinate()[0]
    sd = {"step": 7}
    for layer in (2 * pp, 2 * pp + 1):
        sd[f"l{layer}.weight"] = distribute_tensor(ref(f"l{layer}.weight"), stage, [Shard(0)])
        sd[f"l{layer}.norm"] = distribute_tensor(ref(f"l{layer}.norm"), stage, [Replicate()])
    res = hyperdcp.save(sd, f"{root}/pp")
    return res.bytes_written


def _load_on_three(rank, world, root):
    """On 3 ranks: (a) no pipeline, every layer on every rank sharded along its last dimension (uneven:
    a reshard); (b) another pipeline split of plain tensors: rank 0 layer 0, rank 1 layers 1-2, rank 2
    layer 3. Returns the bytes each load read on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (3,))
    sd = {"step": 0}
    for layer in range(LAYERS):
        for part, shape in SHAPES.items():
            sd[f"l{layer}.{part}"] = distribute_tensor(torch.zeros(shape), mesh, [Shard(len(shape) - 1)])
    one = hyperdcp.load(sd, f"{root}/pp")
    for name, t in sd.items():
        if name != "step":
            assert torch.equal(t.full_tensor(), ref(name)), name
    assert sd["step"] == 7

    layers = {0: [0], 1: [1, 2], 2: [3]}[rank]
    sd = {f"l{layer}.{part}": torch.zeros(shape) for layer in layers for part, shape in SHAPES.items()}
    split = hyperdcp.load(sd, f"{root}/pp")
    for name, t in sd.items():
        assert torch.equal(t, ref(name)), name
    return one.bytes_read, split.bytes_read


def test_two_stages_load_into_one_stage_and_another_split_on_three_ranks(tmp_path):
    written = run_ranks(4, _two_stages, str(tmp_path))
    meta = hyperdcp.read_metadata(tmp_path / "pp")
    assert sorted(meta.tensors) == sorted(f"l{i}.{p}" for i in range(LAYERS) for p in SHAPES)
    # dedup: each element stored once (the replicated norms once per layer); balance: every rank of a
    # stage writes the same bytes (half the weights, one of the two norms)
    assert all(len(meta.tensors[f"l{i}.norm"].chunks) == 1 for i in range(LAYERS))
    unique = sum(ref(n).numel() * 4 for n in meta.tensors)
    stored = sum(int((t.chunks.end - t.chunks.begin).sum()) for t in meta.tensors.values())
    assert stored == unique == meta.tensor_bytes and sum(written) == meta.data_file_bytes
    assert written == [written[0]] * 4
    # read-once: every stored byte read once cluster-wide, whatever the split
    reads = run_ranks(3, _load_on_three, str(tmp_path))
    assert sum(r[0] for r in reads) == stored and sum(r[1] for r in reads) == stored
    # and into no pipeline at all, in one process
    back = {n: torch.zeros(SHAPES[n.rsplit(".", 1)[1]]) for n in meta.tensors}
    hyperdcp.load(back, tmp_path / "pp")
    assert all(torch.equal(t, ref(n)) for n, t in back.items())


def test_planner_joins_stage_tables_of_different_ranks():
    """At the planner: stages with tensors of different ranks (dimensions), and a rank holding nothing."""
    import numpy as np

    from hyperdcp.errors import MismatchError
    from hyperdcp.planning.save_plan import LocalPlan, TensorSpec, plan_global

    a = LocalPlan([TensorSpec("head.b", "F32", (4,))], ["step"], [0], np.array([[0]]), np.array([[4]]))
    b = LocalPlan([TensorSpec("emb.w", "F32", (2, 3))], ["step"], [0], np.array([[0, 0]]), np.array([[2, 3]]))
    idle = LocalPlan([], ["step"], [], np.zeros((0, 0)), np.zeros((0, 0)))
    g = plan_global([LocalPlan.from_bytes(p.to_bytes()) for p in (a, b, idle)])
    assert [t.fqn for t in g.tensors] == ["emb.w", "head.b"]
    assert g.u_writer.tolist() == [1, 0] and [x.tolist() for x in g.assignments] == [[0], [0], []]
    # ranks that share a tensor still must agree on it
    b2 = LocalPlan([TensorSpec("head.b", "F32", (5,))], ["step"], [0], np.array([[0]]), np.array([[5]]))
    with pytest.raises(MismatchError, match=r"'head.b': rank 0 says global shape \[4\] F32, rank 1 says \[5\] F32"):
        plan_global([a, b2])
