"""The resharding matrix: save as HSDP (2,2) [Replicate, Shard(0)] on 4 ranks, load under other layouts.

Every load is checked bit-exact against the global reference tensors.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.layouts import check_state, make_state  # noqa: E402


def _save_hsdp(rank, world, path, read_once):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2))
    state = make_state(mesh, lambda name, nd: [Replicate(), Shard(0)])
    res = hyperdcp.save(state, path)
    # same layout back, into zeros
    back = make_state(mesh, lambda name, nd: [Replicate(), Shard(0)], zeros=True)
    hyperdcp.load(back, path, read_once=read_once)
    check_state(back)
    # 1-D mesh over the same 4 ranks, sharded on the last dim
    mesh1 = init_device_mesh("cpu", (4,))
    cols = make_state(mesh1, lambda name, nd: [Shard(nd - 1)], zeros=True)
    hyperdcp.load(cols, path, read_once=read_once)
    check_state(cols)
    return res.bytes_written


def _load_1d(rank, world, path, dim, read_once):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    state = make_state(mesh, lambda name, nd: [Shard(min(dim, nd - 1))], zeros=True)
    hyperdcp.load(state, path, read_once=read_once)
    check_state(state)
    return True


@pytest.fixture(scope="module")
def hsdp_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("matrix") / "ckpt")
    written = run_ranks(4, _save_hsdp, path, False, timeout=180)
    return path, written


def test_save_writes_each_unique_byte_once(hsdp_checkpoint):
    path, written = hsdp_checkpoint
    meta = hyperdcp.read_metadata(path)
    assert meta.world_size == 4
    assert sum(written) == meta.data_file_bytes
    on_disk = sum(os.path.getsize(os.path.join(path, f.name)) for f in meta.files)
    assert on_disk == meta.data_file_bytes
    assert on_disk / meta.tensor_bytes <= 1.001 + 4096 / meta.tensor_bytes  # headers only


def test_load_on_two_ranks_shard0(hsdp_checkpoint):
    run_ranks(2, _load_1d, hsdp_checkpoint[0], 0, False, timeout=120)


def test_load_on_three_ranks_uneven(hsdp_checkpoint):
    run_ranks(3, _load_1d, hsdp_checkpoint[0], 0, False, timeout=120)
    run_ranks(3, _load_1d, hsdp_checkpoint[0], 1, False, timeout=120)


def test_load_in_one_process_as_plain_tensors(hsdp_checkpoint):
    from tests.layouts import GLOBAL, REPLICATED, full

    state = {"model": {n.split(".", 1)[1]: torch.zeros_like(full(n)) for n in {**GLOBAL, **REPLICATED}}, "step": 0,
             "meta": None}
    res = hyperdcp.load(state, hsdp_checkpoint[0])
    check_state(state)
    assert res.bytes_read == hyperdcp.read_metadata(hsdp_checkpoint[0]).tensor_bytes


# -- read-once loads (issue 4): the same matrix, each stored byte read by one rank and exchanged -----


@pytest.fixture(scope="module")
def hsdp_checkpoint_read_once(tmp_path_factory):
    """Save, then load back the same layout and as 1-D [Shard(-1)], all with read-once on."""
    path = str(tmp_path_factory.mktemp("matrix_ro") / "ckpt")
    written = run_ranks(4, _save_hsdp, path, True, timeout=180)
    return path, written


def test_read_once_same_layout_and_columns(hsdp_checkpoint_read_once):
    path, written = hsdp_checkpoint_read_once
    assert sum(written) == hyperdcp.read_metadata(path).data_file_bytes


def test_read_once_on_three_ranks_uneven(hsdp_checkpoint):
    run_ranks(3, _load_1d, hsdp_checkpoint[0], 1, True, timeout=120)


def test_read_once_on_two_ranks_shard0(hsdp_checkpoint):
    run_ranks(2, _load_1d, hsdp_checkpoint[0], 0, True, timeout=120)
