"""Read-once plans derived from the layout (issue 4): when every rank can compute every other rank's
boxes from DTensor meshes and placements, only a digest is exchanged instead of the load plans.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hyperdcp.core.layout import REPLICATE, GridLayout

torch = pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.layouts import GLOBAL, full, make_state  # noqa: E402


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (3, 2), (2, 3, 2)])
def test_grid_boxes_follow_torch_dtensor_rule(mesh_shape):
    """Every rank's box equals torch's own computation, uneven and empty shards and nested Shard(d) included."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    options = [Replicate(), Shard(0), Shard(1)]
    mesh = np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape)
    for shape in [(7, 5), (2, 9), (1, 1), (12, 3)]:
        for placements in itertools.product(options, repeat=len(mesh_shape)):
            layout = GridLayout(mesh, tuple(REPLICATE if isinstance(p, Replicate) else p.dim for p in placements),
                                GridLayout.digest_mesh(mesh))
            ranks, offs, lens = layout.boxes(shape)
            for r, off, ln in zip(ranks.tolist(), offs.tolist(), lens.tolist()):
                coord = [int(c) for c in np.unravel_index(r, mesh_shape)]
                t_len, t_off = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, placements)
                assert tuple(ln) == tuple(t_len), (shape, placements, coord)
                if all(ln):  # an empty shard's offset does not matter: it holds nothing
                    assert tuple(off) == tuple(t_off), (shape, placements, coord)


def test_layout_validity():
    mesh = np.arange(4).reshape(2, 2)
    key = GridLayout.digest_mesh(mesh)
    assert GridLayout(mesh, (REPLICATE, 0), key).valid_for(ndim=2, world=4)
    assert not GridLayout(mesh, (REPLICATE, 2), key).valid_for(ndim=2, world=4)  # no tensor dim 2
    assert not GridLayout(mesh, (0,), key).valid_for(ndim=2, world=4)  # one placement for a 2-D mesh
    assert not GridLayout(mesh, (0, 1), key).valid_for(ndim=2, world=3)  # rank 3 outside the group
    assert not GridLayout(np.zeros((2, 2), np.int64), (0, 1), key).valid_for(ndim=2, world=4)  # repeated ranks


def _hsdp(name, nd):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate(), Shard(0)]


def _save(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh

    hyperdcp.save(make_state(init_device_mesh("cpu", (2, 2)), _hsdp), path)
    return True


def _load_with(rank, world, path):
    """Three loads, recording whether plans were derived and how many exchanges the plan step took."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import hyperdcp.loading.read_once as X  # where read_once looks build_schedule up

    seen = []
    real = X.build_schedule

    def spy(*a, **k):
        sched = real(*a, **k)
        seen.append(sched)
        return sched

    X.build_schedule = spy
    out = {}
    mesh = init_device_mesh("cpu", (2, 2))
    mixed = make_state(mesh, _hsdp, zeros=True)
    if rank == 3:  # rank 3 leaves one tensor out: layouts differ, so the plans are exchanged
        del mixed["model"]["w1"]
    for case, state in [
        ("same", make_state(mesh, _hsdp, zeros=True)),
        ("cols", make_state(init_device_mesh("cpu", (4,)), lambda name, nd: [Shard(nd - 1)], zeros=True)),
        ("mixed", mixed),
    ]:
        seen.clear()
        res = hyperdcp.load(state, path, strict=False)
        _check_local(state)
        out[case] = (seen[-1].derived, res.bytes_read)
    return out


def _check_local(state) -> None:
    """Each rank's shards equal the matching part of the global reference (no collective)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name in GLOBAL:
        t = state["model"].get(name.split(".", 1)[1])
        if t is None:
            continue
        assert isinstance(t, DTensor)
        shape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        want = full(name)[tuple(slice(o, o + n) for o, n in zip(off, shape))]
        got = t.to_local()
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                           want.view(torch.uint8) if want.dtype == torch.bfloat16 else want), name


def test_plans_derived_from_dtensor_layouts_when_all_ranks_agree(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(4, _save, path, timeout=180)
    unique = hyperdcp.read_metadata(path).tensor_bytes
    res = run_ranks(4, _load_with, path, timeout=240)
    for case in ("same", "cols"):
        assert all(r[case][0] for r in res), case  # derived on every rank
        assert sum(r[case][1] for r in res) == unique, case  # still every byte read once
    assert not any(r["mixed"][0] for r in res)  # one rank differs: plans exchanged
    assert sum(r["mixed"][1] for r in res) <= unique
