"""Multi-rank saves and loads on s3:// (moto's server on 127.0.0.1, reached through the AWS env vars only).

The resharding matrix on S3: a 4-rank HSDP (2,2) [Replicate, Shard(0)] save, a 4-rank async save (the
persist processes upload) and a no-collectives async save (finalized from the URL); then loads on 3
ranks (1-D, uneven shards), on 2 ranks (sharded on the last dim) and in one process, all bit-exact.
Then kill -9 of a rank during the upload: the previous checkpoint loads bit-exact and the interrupted
one is never listed or loaded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import tempfile

import pytest

torch = pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from tests.dist import _entry, outcome, run_ranks, run_scenarios  # noqa: E402
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


# -- kill -9 of a rank during the upload ---------------------------------------------------------------
def _big_state(mesh, step):
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(step)
    return {"w": distribute_tensor(torch.randn(2048, 1024, generator=g), mesh, [Shard(0)]), "step": step}


def _killed_save(rank, world, root, delay):
    """Save step-1, then step-2 while rank 1 is SIGKILLed ``delay`` seconds into it."""
    import signal
    import threading

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    hyperdcp.save(_big_state(mesh, 1), f"{root}/step-1")
    if rank == 1:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        hyperdcp.save(_big_state(mesh, 2), f"{root}/step-2", timeout=8)
    except hyperdcp.CheckpointError as e:
        return f"failed: {type(e).__name__}"
    return "committed"


def kill_trial(env: dict, root: str, delay: float, timeout: float = 60) -> dict:
    """One trial on 2 spawned ranks; returns what the store shows afterwards (see check_after_kill)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="hyperdcp-store-")
    os.close(fd)
    os.unlink(store)
    procs = [ctx.Process(target=_entry, args=(_killed_save, r, 2, store, q, (root, delay), env), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)
    if os.path.exists(store):
        os.unlink(store)
    return {"exitcodes": [p.exitcode for p in procs]}


def check_after_kill(root: str) -> str:
    """The previous checkpoint loads bit-exact; step-2 is listed iff it committed, and then loads bit-exact."""
    listed = hyperdcp.list_checkpoints(root)
    assert listed in ([f"{root}/step-1"], [f"{root}/step-1", f"{root}/step-2"]), listed
    for step in (1, 2) if len(listed) == 2 else (1,):
        g = torch.Generator().manual_seed(step)
        state = {"w": torch.zeros(2048, 1024), "step": 0}
        hyperdcp.load(state, f"{root}/step-{step}")
        assert torch.equal(state["w"], torch.randn(2048, 1024, generator=g)) and state["step"] == step
    if len(listed) == 1:
        with pytest.raises((hyperdcp.IncompleteCheckpointError, hyperdcp.CheckpointNotFoundError)):
            hyperdcp.load({"w": torch.zeros(2048, 1024), "step": 0}, f"{root}/step-2")
        return "interrupted"
    return "committed"


@pytest.mark.parametrize("trial", range(2))
def test_kill_9_of_a_rank_during_the_upload(s3, trial):
    root = f"s3://{s3.bucket}/kill-{trial}"
    kill_trial(s3.env, root, delay=random.Random(trial).uniform(0.05, 0.6))
    check_after_kill(root)
