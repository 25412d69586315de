"""Async save: staging isolation, the three coordination modes, plan reuse, failures and dead persist processes."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tests.dist import run_ranks  # noqa: E402
from tests.layouts import check_state, make_state  # noqa: E402


def _hsdp(mesh):
    from torch.distributed.tensor import Replicate, Shard

    return make_state(mesh, lambda name, nd: [Replicate(), Shard(0)])


def _clobber(state) -> None:
    """Overwrite every local tensor (what the next optimizer step would do)."""
    from torch.distributed.tensor import DTensor

    for t in state["model"].values():
        (t.to_local() if isinstance(t, DTensor) else t).fill_(7)
    state["step"] = -1


def _round_trip(rank, world, root, mode):
    from torch.distributed.device_mesh import init_device_mesh

    import hyperdcp

    mesh = init_device_mesh("cpu", (2, 2))
    state = _hsdp(mesh)
    fut = hyperdcp.async_save(state, f"{root}/a", coordination=mode)
    _clobber(state)  # right after return: must not reach the checkpoint
    res = fut.result(timeout=60)
    assert res.world_size == world and fut.done()
    back = _hsdp_zeros(mesh)
    hyperdcp.load(back, f"{root}/a")
    check_state(back)

    # a second async save of the same structure reuses the staging area and (collective modes) the plan
    state = _hsdp(mesh)
    fut2 = hyperdcp.async_save(state, f"{root}/b", coordination=mode)
    assert not fut2.first_call
    res2 = fut2.result(timeout=60)
    if mode != "none":
        assert res2.plan_cache_hit
        # the plan computed in the persist process flowed back: a sync save skips planning too
        assert hyperdcp.save(state, f"{root}/c").plan_cache_hit
    back = _hsdp_zeros(mesh)
    hyperdcp.load(back, f"{root}/b")
    check_state(back)
    return res.bytes_written


def _hsdp_zeros(mesh):
    from torch.distributed.tensor import Replicate, Shard

    return make_state(mesh, lambda name, nd: [Replicate(), Shard(0)], zeros=True)


@pytest.mark.parametrize("mode", ["gloo", "file", "none"])
def test_round_trip_4_ranks(tmp_path, mode):
    written = run_ranks(4, _round_trip, str(tmp_path), mode, timeout=90)
    import hyperdcp

    meta = hyperdcp.read_metadata(str(tmp_path / "a"))
    assert sum(written) == meta.data_file_bytes  # each unique byte written once, in every mode
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".hyperdcp-xchg") and os.listdir(tmp_path / e)]


def _failures(rank, world, root, mode):
    import resource
    import signal
    import time

    import hyperdcp
    from hyperdcp.async_saving import PersistProcessDiedError, SaveInProgressError
    from hyperdcp.async_saving import session as saver

    # "r" differs between the ranks, so it is stored per rank: every rank writes its own 1 MiB of it
    state = {"w": torch.arange(12.0).reshape(4, 3) + rank * 0, "step": 1, "r": torch.full((1 << 18,), float(rank))}
    first = hyperdcp.async_save(state, f"{root}/ok", coordination=mode)
    first.result(timeout=60)
    pid = first.worker_pid  # this rank's persist process; it handles the next saves too

    # 1. a write error in rank 1's persist process (a real one: its file-size limit, EFBIG) fails every future
    if rank == 1:
        limit = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (64 << 10, limit[1]))  # exchange files fit, data files do not
    fut = hyperdcp.async_save(state, f"{root}/bad", coordination=mode)
    try:
        with pytest.raises(hyperdcp.CheckpointError, match="File too large") as ei:
            fut.result(timeout=60)
    finally:
        if rank == 1:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, limit)
    assert fut.worker_pid == pid and not isinstance(ei.value, TimeoutError)
    if rank == 1:  # its own error, with the persist process's traceback
        assert isinstance(ei.value, hyperdcp.StorageError) and "StorageError" in ei.value.original_type
        assert "write_data_file" in ei.value.remote_traceback
    else:
        assert isinstance(ei.value, hyperdcp.RemoteRankError) and "rank 1" in str(ei.value)
    assert not os.path.exists(f"{root}/bad")

    # 2. rank 1's persist process is killed mid-save (overwriting a committed checkpoint); it is stopped
    #    (SIGSTOP) before the save is submitted, so the save is still in flight when the kill lands
    if rank == 1:
        os.kill(pid, signal.SIGSTOP)
    state2 = {"w": torch.full((4, 3), 5.0), "step": 2, "r": torch.full((1 << 18,), 2.0 + rank)}
    fut = hyperdcp.async_save(state2, f"{root}/ok", coordination=mode, overwrite=True)
    assert fut.worker_pid == pid
    with pytest.raises(SaveInProgressError):
        hyperdcp.async_save(state2, f"{root}/other", coordination=mode, wait=False)
    if rank == 1:
        time.sleep(0.5)
        os.kill(fut.worker_pid, signal.SIGKILL)
    with pytest.raises(hyperdcp.CheckpointError) as ei:
        fut.result(timeout=60)
    assert not isinstance(ei.value, TimeoutError)  # detected, not waited out
    if rank == 1:
        assert isinstance(ei.value, PersistProcessDiedError) and "SIGKILL" in str(ei.value), repr(ei.value)
    else:
        assert "rank 1" in str(ei.value), ei.value
    back = {"w": torch.zeros(4, 3), "step": 0, "r": torch.zeros(1 << 18)}
    hyperdcp.load(back, f"{root}/ok")  # the previous checkpoint is intact
    assert torch.equal(back["w"], torch.arange(12.0).reshape(4, 3)) and back["step"] == 1
    assert torch.equal(back["r"], state["r"])

    # 3. the next save works (with a new persist process on rank 1)
    res = hyperdcp.async_save(state2, f"{root}/ok", coordination=mode, overwrite=True).result(timeout=60)
    hyperdcp.load(back, f"{root}/ok")
    assert torch.equal(back["w"], state2["w"]) and back["step"] == 2

    # 4. rank 1's persist process dies while idle: only rank 1 starts a new one, yet the ranks agree on
    #    the persist group (gloo: every rank re-forms it at the next save, decided by a vote in the store)
    if rank == 1:
        w = saver.current_session().worker
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait(timeout=10)
    state2["step"] = 4
    res = hyperdcp.async_save(state2, f"{root}/ok", coordination=mode, overwrite=True).result(timeout=60)
    hyperdcp.load(back, f"{root}/ok")
    assert back["step"] == 4
    return res.bytes_written


@pytest.mark.parametrize("mode", ["gloo", "file"])
def test_failures_2_ranks(tmp_path, mode):
    run_ranks(2, _failures, str(tmp_path), mode, timeout=120)


def test_single_process_numpy_and_values(tmp_path):
    import numpy as np

    import hyperdcp

    state = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "t": torch.ones(3, dtype=torch.bfloat16),
             "x": {"lr": 0.1}}
    fut = hyperdcp.async_save(state, tmp_path / "c")
    state["a"][:] = -1
    state["t"].zero_()
    fut.result(timeout=60)
    back = {"a": np.zeros((2, 3), np.float32), "t": torch.zeros(3, dtype=torch.bfloat16), "x": None}
    hyperdcp.load(back, tmp_path / "c")
    assert (back["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and back["t"].float().tolist() == [1, 1, 1]
            and back["x"] == {"lr": 0.1})
    with pytest.raises(hyperdcp.CheckpointExistsError):
        hyperdcp.async_save(state, tmp_path / "c").result(timeout=60)


def test_warm_staging_detects_changes(tmp_path):
    """The warm path (cached walk, descriptions and destinations) must stage exactly what the full path would."""
    import hyperdcp
    from hyperdcp.async_saving import session as saver

    def save_and_load(state, name, like):
        fut = hyperdcp.async_save(state, tmp_path / name)
        for v in state["m"].values():  # mutation right after return must not reach the checkpoint
            if isinstance(v, torch.Tensor):
                v.fill_(-9) if v.dtype.is_floating_point else None
        fut.result(timeout=60)
        hyperdcp.load(like, tmp_path / name)
        return like, fut

    def fresh(n=300):
        return {"m": {f"p{i}": torch.full((3, i % 5 + 1), float(i)) for i in range(n)}, "step": 1}

    state = fresh()
    save_and_load(state, "a", fresh())
    stager = saver.current_session().stager
    state = fresh()
    back, fut = save_and_load(state, "b", {"m": {k: torch.zeros_like(v) for k, v in fresh()["m"].items()}, "step": 0})
    assert not fut.first_call and stager._fast is not None
    assert all(torch.equal(back["m"][f"p{i}"], torch.full((3, i % 5 + 1), float(i))) for i in range(300))
    assert back["step"] == 1

    # same objects, in-place changes of values, shape and dtype (.data), a new key: all staged correctly
    state = fresh()
    hyperdcp.async_save(state, tmp_path / "c").result(timeout=60)  # warm cache on these objects
    state["step"] = 7
    state["m"]["p1"].data = torch.full((4, 2), 3.0)  # same object, new shape
    state["m"]["p2"].data = torch.full((3, 3), 5, dtype=torch.float64)  # same object, new dtype
    fut = hyperdcp.async_save(state, tmp_path / "d")
    fut.result(timeout=60)
    meta = hyperdcp.read_metadata(str(tmp_path / "d"))
    assert fut.first_call  # a different structure: new staging area
    like = {"m": {k: torch.zeros_like(v) for k, v in state["m"].items()}, "step": 0}
    hyperdcp.load(like, tmp_path / "d")
    assert (like["step"] == 7 and like["m"]["p1"].shape == (4, 2)
            and torch.equal(like["m"]["p1"], torch.full((4, 2), 3.0)))
    assert (like["m"]["p2"].dtype == torch.float64
            and torch.equal(like["m"]["p2"], torch.full((3, 3), 5, dtype=torch.float64)))
    assert meta is not None
    hyperdcp.async_save(state, tmp_path / "e").result(timeout=60)
    state["m"]["extra"] = torch.ones(2)
    fut = hyperdcp.async_save(state, tmp_path / "f")
    fut.result(timeout=60)
    assert fut.first_call
    like = {"m": {k: torch.zeros_like(v) for k, v in state["m"].items()}, "step": 0}
    hyperdcp.load(like, tmp_path / "f")
    assert torch.equal(like["m"]["extra"], torch.ones(2))
    # a new tensor object with the same description (model.state_dict() style) stays on the warm path
    state["m"]["p0"] = torch.full((3, 1), 11.0)
    fut = hyperdcp.async_save(state, tmp_path / "g")
    fut.result(timeout=60)
    assert not fut.first_call
    like = {"m": {k: torch.zeros_like(v) for k, v in state["m"].items()}, "step": 0}
    hyperdcp.load(like, tmp_path / "g")
    assert torch.equal(like["m"]["p0"], torch.full((3, 1), 11.0))
    hyperdcp.async_save_shutdown() if hasattr(hyperdcp, "async_save_shutdown") else saver.shutdown()


def test_staging_files_of_dead_processes_are_removed(tmp_path):
    """A rank killed before its persist process mapped the staging file must not leak it in /dev/shm."""
    import subprocess
    import sys

    from hyperdcp.async_saving.staging import remove_stale_areas

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f"hyperdcp-stage-{dead}-0123456789ab"
    alive = tmp_path / f"hyperdcp-stage-{os.getppid()}-0123456789ab"
    other = tmp_path / "unrelated-file"
    for f in (stale, alive, other):
        f.write_bytes(b"x")
    assert remove_stale_areas(str(tmp_path)) == 1
    assert not stale.exists() and alive.exists() and other.exists()
