"""Crash consistency and coordination failures on spawned local gloo ranks (issue 5).

Full campaign: ``python -m tests.faults.crash_campaign --trials 50 --world 3`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")

from tests.dist import run_ranks  # noqa: E402
from tests.faults import crash_campaign as cc  # noqa: E402
from tests.faults.ranks import Ranks  # noqa: E402


def test_crash_campaign_sample():
    res = cc.campaign(2, world=2, mode="sync", seed=5, log=lambda *a: None)
    assert not res["failures"], res["failures"]


def _absent(rank, world, path, who, op, timeout):
    import hyperdcp

    sd = {"w": torch.arange(8.0)}
    if op == "load" and rank == 0 and who < 0:
        pass
    if rank == who:
        time.sleep(timeout * 2 + 3)
        return "absent"
    t = time.time()
    try:
        if op == "save":
            hyperdcp.save(sd, path, timeout=timeout)
        else:
            hyperdcp.load(sd, path, timeout=timeout)
    except hyperdcp.CoordinationError as e:
        return (str(e), time.time() - t)
    return ("no error", 0)


@pytest.mark.parametrize("op,who", [("save", 2), ("load", 0)])
def test_missing_rank_is_named_within_timeout(tmp_path, op, who):
    import hyperdcp

    path = str(tmp_path / "ck")
    hyperdcp.save({"w": torch.arange(8.0)}, path)  # something to load
    if op == "save":
        path = str(tmp_path / "ck2")
    r = Ranks(3, _absent, path, who, op, 2.0)
    try:
        out = r.collect(40)
    finally:
        r.kill_all()
    for rank, (kind, val) in out.items():
        if rank == who:
            continue
        assert kind == "ok", val
        msg, took = val
        assert f"rank(s) {who}" in msg and "did not arrive within 2 s" in msg, msg
        assert took < 2.0 * 1.25 + 3, took
    assert not os.path.exists(str(tmp_path / "ck2"))


def _different(rank, world, path, what):
    import hyperdcp

    if what == "keys":
        sd = {"w": torch.zeros(4), f"only_on_{rank}": torch.zeros(2)}
    else:
        sd = {"w": torch.zeros(4 + rank)}
    try:
        hyperdcp.save(sd, path, timeout=20)
    except hyperdcp.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


@pytest.mark.parametrize("what", ["keys", "shapes"])
def test_ranks_passing_different_keys_or_shapes(tmp_path, what):
    path = str(tmp_path / "ck")
    out = run_ranks(2, _different, path, what, timeout=90)
    if what == "keys":  # keys held by some ranks only are saved from those ranks (issue 10)
        import hyperdcp

        assert out == ["saved", "saved"]
        assert sorted(hyperdcp.read_metadata(path).tensors) == ["only_on_0", "only_on_1", "w"]
        return
    for msg in out:
        assert msg.startswith(("MismatchError", "RemoteRankError")), msg
    assert any("rank" in m for m in out), out
    assert not os.path.exists(path)


def test_lock_file_removed_and_stale_inode_refused(tmp_path):
    """The lock file ``.<name>.hyperdcp-lock`` is removed when a save ends, while still held, and a
    saver that locked an unlinked (stale) inode retries on the current file: two savers can never hold
    locks on different inodes at once."""
    import fcntl

    import hyperdcp
    from hyperdcp.storage.local_commit import SaveTarget

    ck = str(tmp_path / "ck")
    hyperdcp.save({"w": torch.arange(4.0)}, ck)
    hyperdcp.save({"w": torch.arange(4.0)}, ck, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    lock = str(tmp_path / ".ck.hyperdcp-lock")
    a = SaveTarget(ck, overwrite=True)
    a._lock()
    stale = os.open(lock, os.O_RDWR)  # a racer opened the file before A removes it
    with pytest.raises(hyperdcp.CheckpointExistsError):
        SaveTarget(ck, overwrite=True)._lock()
    a.release()
    assert not os.path.exists(lock)
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the racer now holds the stale inode...
    assert not SaveTarget._same_file(stale, lock)  # ...which _lock() detects (it then retries)
    b = SaveTarget(ck, overwrite=True)
    b._lock()  # a new file: B holds the lock the path names
    with pytest.raises(hyperdcp.CheckpointExistsError):
        SaveTarget(ck, overwrite=True)._lock()
    b.release()
    os.close(stale)
    # a lock file left by a killed saver is taken over and removed by the next save
    open(lock, "w").close()
    hyperdcp.save({"w": torch.arange(4.0)}, ck, overwrite=True)
    assert not os.path.exists(lock)
