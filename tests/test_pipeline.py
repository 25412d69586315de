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
    torch.manual_seed(rank)
    sd = {f"l{rank}.weight": torch.randn(4, 4)}
    hyperdcp.save(sd, f"{root}/p")
    return sd[f"l{rank}.weight"]


def test_ranks_saving_different_layer_keys(tmp_path):
    """The issue's example: two ranks, each its own layer; loaded whole in one process."""
    saved = run_ranks(2, _issue_example, str(tmp_path))
    back = {"l0.weight": torch.zeros(4, 4), "l1.weight": torch.zeros(4, 4)}
    hyperdcp.load(back, tmp_path / "p")
    assert torch.equal(back["l0.weight"], saved[0]) and torch.equal(back["l1.weight"], saved[1])
    meta = hyperdcp.read_metadata(tmp_path / "p")
    assert sorted(meta.tensors) == ["l0.weight", "l1.weight"] and not meta.per_rank_tensors


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
