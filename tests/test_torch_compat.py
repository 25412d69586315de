"""hyperdcp.torch: code written for torch.distributed.checkpoint switches by changing its import.

    import torch.distributed.checkpoint as dcp   ->   import hyperdcp.torch as dcp
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import hyperdcp
import hyperdcp.torch as dcp
from tests.dist import run_ranks


def model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def test_save_and_load_with_dcp_argument_names(tmp_path):
    model, opt = model_and_optim(0)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(sd, checkpoint_id=tmp_path / "a")
    dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path / "b")), no_dist=True)
    assert hyperdcp.is_checkpoint(tmp_path / "a") and hyperdcp.is_checkpoint(tmp_path / "b")
    for kw in ({"checkpoint_id": tmp_path / "a"}, {"storage_reader": FileSystemReader(str(tmp_path / "b"))}):
        other, other_opt = model_and_optim(1)
        got = {"model": other.state_dict(), "optim": other_opt.state_dict()}
        dcp.load(got, **kw)
        for k, v in sd["model"].items():
            assert torch.equal(got["model"][k], v), k
        assert torch.equal(got["optim"]["state"][0]["exp_avg"], sd["optim"]["state"][0]["exp_avg"])


def test_saving_again_replaces_like_dcp_unless_the_writer_says_not_to(tmp_path):
    dcp.save({"x": torch.zeros(3)}, checkpoint_id=tmp_path / "c")
    dcp.save({"x": torch.ones(3)}, checkpoint_id=tmp_path / "c")
    got = {"x": torch.empty(3)}
    dcp.load(got, checkpoint_id=tmp_path / "c")
    assert torch.equal(got["x"], torch.ones(3))
    with pytest.raises(hyperdcp.CheckpointExistsError):
        dcp.save({"x": torch.ones(3)}, storage_writer=FileSystemWriter(str(tmp_path / "c"), overwrite=False))


def test_async_save_returns_a_future_of_the_committed_save(tmp_path):
    fut = dcp.async_save({"x": torch.arange(5.0)}, checkpoint_id=tmp_path / "d", no_dist=True)
    fut.result(timeout=120)
    got = {"x": torch.zeros(5)}
    dcp.load(got, checkpoint_id=tmp_path / "d")
    assert torch.equal(got["x"], torch.arange(5.0))


def test_what_hyperdcp_does_not_take_is_refused_clearly(tmp_path):
    with pytest.raises(hyperdcp.StateDictError, match="planner=DefaultLoadPlanner.*key_map"):
        dcp.load({"x": torch.zeros(1)}, checkpoint_id=tmp_path, planner=DefaultLoadPlanner())
    with pytest.raises(hyperdcp.StateDictError, match="two different checkpoints"):
        dcp.save({"x": torch.zeros(1)}, checkpoint_id=tmp_path / "e", storage_writer=FileSystemWriter(str(tmp_path)))
    with pytest.raises(hyperdcp.StateDictError, match="checkpoint_id="):
        dcp.save({"x": torch.zeros(1)})


def _fsdp_save(rank, world, root):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root, process_group=dist.new_group([0, 1]))
    return {k: v.full_tensor().numpy() for k, v in msd.items()}  # numpy: tensors do not outlive the rank


def test_fsdp2_state_saved_on_two_ranks_loads_in_one_process(tmp_path):
    root = str(tmp_path / "fsdp")
    full = run_ranks(2, _fsdp_save, root, timeout=120)[0]
    plain, _ = model_and_optim(7)
    got = {"model": plain.state_dict()}
    dcp.load(got, checkpoint_id=root, no_dist=True, strict=False)  # the optimizer state is not asked for
    for k, v in full.items():
        assert torch.equal(got["model"][k], torch.from_numpy(v)), k
    assert os.path.isfile(os.path.join(root, "hyperdcp.json"))
