"""MindSpore layouts (device matrix + tensor map) turned into boxes, checked against MindSpore's own slicing.

The mapping (hyperdcp/adapters/mindspore_layout.py): a tensor-map entry ``k`` names the device-matrix dim
counted from the right, ``-1`` replicates, a tuple splits one tensor dim by several device dims (outer
first). For every layout below and every rank, the box hyperdcp derives must select exactly the slice
that ``mindspore.parallel._tensor._load_tensor`` (what MindSpore's checkpoint loading uses) gives that
rank, and the core's GridLayout built from it must list the same box for that rank. Then the real thing:
4 MindSpore processes under ``msrun`` (CPU, mccl) save sharded parameters through a hyperdcp
Coordinator over MindSpore's collectives and load them back under other layouts.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore.parallel import Layout  # noqa: E402
from mindspore.parallel._tensor import _expand_layout, _load_tensor  # noqa: E402

import hyperdcp  # noqa: E402
from hyperdcp.adapters import mindspore as msa  # noqa: E402
from hyperdcp.adapters import mindspore_layout as msl  # noqa: E402
from hyperdcp.core.boxes import Box  # noqa: E402

msa.prime()

#: (device matrix, tensor map, full shape): int maps as parallel networks report them, tuple (multi-axis) maps
INT_MAPS = [
    ((4,), (0, -1), (8, 6)),
    ((4,), (-1, 0), (6, 8)),
    ((2, 4), (1, 0), (6, 8)),
    ((2, 4), (0, 1), (8, 6)),
    ((2, 4), (-1, 1), (3, 6)),
    ((2, 2, 2), (2, -1, 0), (4, 3, 6)),
    ((2, 2, 2), (0, 2, -1), (2, 4, 5)),
    ((2, 3), (-1, -1), (5, 7)),
    ((3, 2), (0,), (12,)),
]
TUPLE_MAPS = [
    ((2, 4), ((1, 0), -1), (16, 3)),
    ((2, 4), ((0, 1), -1), (16, 3)),
    ((2, 2, 2), (-1, (2, 0)), (3, 8)),
    ((2, 2, 2), ((0, 2), 1), (8, 6)),
]


def piece(box: Box, full: np.ndarray) -> np.ndarray:
    return full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]


def boxes_of(dev, tmap, shape):
    spec = msl.parse_layout("t", {"device_matrix": dev, "tensor_map": tmap})
    return spec, [msl.local_box(spec, shape, msl.coordinate(spec, r)) for r in range(spec.world)]


@pytest.mark.parametrize("dev,tmap,shape", INT_MAPS)
def test_each_ranks_box_is_the_slice_mindspore_loads_on_that_rank(dev, tmap, shape):
    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    _, boxes = boxes_of(dev, tmap, shape)
    for r, box in enumerate(boxes):
        theirs = _load_tensor(ms.Tensor(full), list(dev), list(tmap), list(shape), rank_id=r)
        assert np.array_equal(piece(box, full), theirs), (dev, tmap, r)


@pytest.mark.parametrize("dev,tmap,shape", TUPLE_MAPS)
def test_a_tuple_entry_splits_one_dim_outer_axis_first_as_mindspore_expands_it(dev, tmap, shape):
    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    _, exp_map, exp_shape = _expand_layout(list(dev), [list(e) if isinstance(e, tuple) else e for e in tmap],
                                           list(shape))
    _, boxes = boxes_of(dev, tmap, shape)
    for r, box in enumerate(boxes):
        theirs = _load_tensor(ms.Tensor(full.reshape(exp_shape)), list(dev), exp_map, exp_shape, rank_id=r)
        assert np.array_equal(piece(box, full), theirs.reshape(box.lengths)), (dev, tmap, r)


@pytest.mark.parametrize("dev,tmap,shape", INT_MAPS + TUPLE_MAPS)
def test_the_grid_layout_lists_every_ranks_box_and_replicas_share_it(dev, tmap, shape):
    spec, boxes = boxes_of(dev, tmap, shape)
    grid = msl.grid_layout(spec, spec.ranks())
    assert grid.valid_for(len(shape), spec.world)
    ranks, offs, lens = grid.boxes(shape)
    by_rank = {int(r): Box(tuple(o.tolist()), tuple(n.tolist())) for r, o, n in zip(ranks, offs, lens)}
    assert by_rank == dict(enumerate(boxes))
    for r in range(spec.world):
        reps = msl.replica_positions(spec, msl.coordinate(spec, r))
        assert r in reps and all(boxes[int(q)] == boxes[r] for q in reps)
        assert len(reps) == sum(b == boxes[r] for b in boxes)


def test_the_layout_api_and_a_parameter_layout_list_give_the_same_layout():
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    from_api = msl.parse_layout("w", layout("dp", "mp"))
    assert from_api == msl.parse_layout("w", ([2, 2, 2], [2, 0], [4, 3], 0, True, "", [8, 6]))
    assert from_api.tensor_map == ((2,), (0,)) and from_api.strategy() == (2, 2)
    assert msl.parse_layout("w", layout(("dp", "mp"), "None")).strategy() == (4, 1)
    ranked = msl.parse_layout("w", Layout((2, 2), ("a", "b"), rank_list=[4, 5, 6, 7])("b", "None"))
    assert msl.coordinate(ranked, 6) == (1, 0) and msl.coordinate(ranked, 0) is None
    assert from_api.rank_list is None  # the default rank list, kept as None (O(1) to compare and hash)


@pytest.mark.parametrize("layout,why", [
    (([2, 2], [1, 0], [2, 2], 0, True, "opt_group_0", [4, 4]), "optimizer-parallel"),
    ({"device_matrix": (2, 2), "tensor_map": (1, 3)}, "names no dimension"),
    ({"device_matrix": (2, 2), "tensor_map": (1, 1)}, "twice"),
    ({"device_matrix": (2, 2), "tensor_map": (1, -1), "rank_list": [0, 1, 2]}, "rank_list"),
    ({"device_matrix": (2, 2), "tensor_map": (1, -1), "interleaved_parallel": True}, "interleaved"),
    ("dp", "not a MindSpore layout"),
])
def test_layouts_hyperdcp_cannot_store_are_refused_with_the_name(layout, why):
    with pytest.raises(hyperdcp.CheckpointError, match=f"'emb.weight'.*{why}"):
        msl.parse_layout("emb.weight", layout)


def test_an_uneven_split_is_refused_with_the_name(tmp_path):
    part = ms.Parameter(ms.Tensor(np.zeros((2, 3), np.float32)), name="w")
    with pytest.raises(hyperdcp.CheckpointError, match="'w'.*not divisible"):
        hyperdcp.save({"w": msa.Sharded(part, {"device_matrix": (4,), "tensor_map": (-1, 0)}, rank=0, shape=(2, 10))},
                      tmp_path / "c")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_four_mindspore_processes_save_sharded_and_load_under_other_layouts(tmp_path):
    """msrun on CPU: collective save through MindSporeCoordinator, resharded load, errors on every rank."""
    worker = pathlib.Path(__file__).parent / "ms_workers" / "reshard.py"
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(hyperdcp.__file__).parents[1]), OMP_NUM_THREADS="1",
               GLOG_v="3")
    msrun = "import sys; from mindspore.parallel.cluster.run import main; sys.argv[0] = 'msrun'; sys.exit(main())"
    cmd = [sys.executable, "-c", msrun, "--worker_num=4", "--local_worker_num=4",
           f"--master_port={_free_port()}", f"--log_dir={tmp_path / 'log'}", "--join=True",
           str(worker), str(tmp_path / "ckpt"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4) if (out / f"rank{r}.json").exists()]
    logs = "".join(p.read_text()[-3000:] for p in sorted((tmp_path / "log").glob("worker_*.log")))
    assert len(results) == 4, f"msrun exit {proc.returncode}\n{proc.stderr[-3000:]}\n{logs}"
    for res in results:
        assert res["world"] == 4 and res["ok"] == {"w": True, "e": True, "b": True, "whole": True}, res
        # the bad load raised on every rank: rank 1's own error there, the same error named on the others
        assert "'w'" in res["raised"] and ("rank(s) 1" in res["raised"] or res["rank"] == 1), res
    assert proc.returncode == 0, f"the workers finished but msrun failed:\n{proc.stderr[-3000:]}"
    meta = hyperdcp.read_metadata(tmp_path / "ckpt")
    assert meta.tensors["b"].dtype == "F16" and list(meta.tensors["w"].shape) == [8, 12]


def test_with_layouts_wraps_the_parameters_a_parallel_network_reports(tmp_path):
    net = ms.nn.SequentialCell([ms.nn.Dense(3, 4), ms.nn.ReLU(), ms.nn.Dense(4, 2)])
    params = net.parameters_dict()
    layouts = {"0.weight": ([1, 1], [1, 0], [4, 3], 0, True, "", [4, 3])}  # a parameter_layout_dict entry
    state = msa.with_layouts(params, layouts)
    assert isinstance(state["0.weight"], msa.Sharded) and state["0.bias"] is params["0.bias"]
    hyperdcp.save(state, tmp_path / "c")
    whole = {k: np.zeros(p.shape, np.float32) for k, p in params.items()}
    hyperdcp.load(whole, tmp_path / "c")
    assert all(whole[k].tobytes() == p.asnumpy().tobytes() for k, p in params.items())


@pytest.mark.parametrize("rank_list", [None, [3, 1, 2, 0]])
def test_each_rank_describes_its_slice_replicas_and_the_whole_grid(tmp_path, rank_list):
    """What a rank of a 4-process job hands the core for a slice (no collectives needed to describe it)."""
    from hyperdcp.coordination.files import FileCoordinator

    layout = {"device_matrix": (2, 2), "tensor_map": (0, -1)}  # rows split over the last axis, replicas on the first
    if rank_list is not None:
        layout["rank_list"] = rank_list
    spec = msl.parse_layout("w", layout)
    full = np.arange(24, dtype=np.float32).reshape(6, 4)
    for rank in range(4):
        coord = FileCoordinator(str(tmp_path / "x"), rank, 4)
        box = msl.local_box(spec, full.shape, msl.coordinate(spec, rank))
        part = ms.Parameter(ms.Tensor(np.ascontiguousarray(piece(box, full))), name="w")
        st = msa.to_sharded("w", msa.Sharded(part, layout), coord, for_load=True)
        (shard,) = st.shards
        assert st.shape == (6, 4) and shard.box == box
        pos = (rank_list or [0, 1, 2, 3]).index(rank)
        twins = [r for r in range(4) if (rank_list or [0, 1, 2, 3]).index(r) % 2 == pos % 2]
        assert shard.replica_ranks == tuple(sorted(twins))
        ranks, offs, lens = st.layout.boxes(st.shape)
        assert {int(r): (tuple(o), tuple(n)) for r, o, n in zip(ranks, offs.tolist(), lens.tolist())}[rank] == \
            (box.offsets, box.lengths)
