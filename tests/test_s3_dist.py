"""Multi-rank saves and loads on s3:// (moto's server on 127.0.0.1, reached through the AWS env vars only).

The resharding matrix on S3: a 4-rank HSDP (2,2) [Replicate, Shard(0)] save, a 4-rank async save (the
persist processes upload) and a no-collectives async save (finalized from the URL); then loads on 3
ranks (1-D, uneven shards), on 2 ranks (sharded on the last dim) and in one process, all bit-exact.
Then kill -9 of a rank during the upload: the previous checkpoint loads bit-exact and the interrupted
one is never listed or loaded.
"""

from __future__ import annotations

import random
import signal

import pytest

torch = pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from tests.dist import outcome, run_ranks, run_scenarios  # noqa: E402
from tests.layouts import GLOBAL, REPLICATED, VALUES, check_state, full, make_state  # noqa: E402


def _hsdp(mesh, zeros=False):
    from torch.distributed.tensor import Replicate, Shard

    return make_state(mesh, lambda name, nd: [Replicate(), Shard(0)], zeros=zeros)


def save_sync(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    res = hyperdcp.save(_hsdp(mesh), f"{root}/sync")
    back = _hsdp(mesh, zeros=True)
    hyperdcp.load(back, f"{root}/sync")  # same layout, read-once
    check_state(back)
    return res.bytes_written


def save_async(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    state = _hsdp(mesh)
    fut = hyperdcp.async_save(state, f"{root}/async")
    for t in state["model"].values():  # training goes on: must not reach the checkpoint
        (t.to_local() if hasattr(t, "to_local") else t).zero_()
    return fut.result(timeout=60).bytes_written


def save_no_collectives(rank, world, root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    hyperdcp.async_save(_hsdp(mesh), f"{root}/alone", coordination="none").result(timeout=60)
    dist.barrier()
    with pytest.raises(hyperdcp.IncompleteCheckpointError):
        hyperdcp.read_metadata(f"{root}/alone")  # not a checkpoint until finalized
    dist.barrier()
    if rank == 0:
        hyperdcp.finalize(f"{root}/alone")
    return True


def _load_1d(root, name, world, dim):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    state = make_state(mesh, lambda n, nd: [Shard(min(dim, nd - 1)) if dim >= 0 else Shard(nd - 1)], zeros=True)
    res = hyperdcp.load(state, f"{root}/{name}")
    check_state(state)
    return res.bytes_read


def load_all(rank, world, root):
    return {name: _load_1d(root, name, world, 0 if world == 3 else -1) for name in ("sync", "async", "alone")}


def _load_one_process(url):
    state = {"model": {n.split(".", 1)[1]: torch.zeros_like(full(n)) for n in {**GLOBAL, **REPLICATED}}}
    state.update({k: None for k in VALUES})
    hyperdcp.load(state, url)
    check_state(state)


def test_resharding_matrix_on_s3(s3):
    root = f"s3://{s3.bucket}/matrix"
    results = run_ranks(4, _save_all, root, timeout=150, env=s3.env)
    for name in ("save_sync", "save_async"):
        written = outcome(results, name)
        assert sum(written) == hyperdcp.read_metadata(f"{root}/{name[5:]}").data_file_bytes  # each byte once
    outcome(results, "save_no_collectives")
    assert hyperdcp.list_checkpoints(root) == [f"{root}/{n}" for n in ("sync", "async", "alone")]  # commit order
    for world in (3, 2):
        reads = run_ranks(world, load_all, root, timeout=120, env=s3.env)
        for name in ("sync", "async", "alone"):  # read once: the ranks together read each stored byte once
            assert sum(r[name] for r in reads) <= hyperdcp.read_metadata(f"{root}/{name}").data_file_bytes
    for name in ("sync", "async", "alone"):
        _load_one_process(f"{root}/{name}")


def _save_all(rank, world, root):
    return run_scenarios(rank, world, root, [save_sync, save_async, save_no_collectives])


# -- kill -9 of a rank during the upload (tests/faults/s3_kill.py; 30 trials: python -m tests.faults.s3_kill) --
@pytest.mark.parametrize("world,trial", [(2, 0), (1, 1), (1, 2)])
def test_kill_9_of_a_rank_during_the_upload(s3, world, trial):
    from tests.faults import s3_kill

    root = f"s3://{s3.bucket}/kill"
    # multipart uploads, killed between parts
    env = {**s3.env, "HYPERDCP_S3_PART_BYTES": str(5 << 20), "HYPERDCP_S3_SINGLE_PUT_BYTES": "0"}
    codes = s3_kill.run_trial(env, root, world, delay=random.Random(trial).uniform(0.1, 0.8), timeout=120)
    assert None not in codes, f"a rank did not finish within 120 s: {codes}"
    assert -signal.SIGKILL in codes or s3_kill.check(root) == "committed"  # killed, or after its commit
    s3_kill.check(root)  # step-1 loads bit-exact; step-2 listed iff committed, never partly loaded
