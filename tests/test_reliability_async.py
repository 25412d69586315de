"""Coordination failures of async saves on spawned local gloo ranks (issue 5).

A rank that never calls ``async_save`` (or whose persist process dies before the exchange) must make
the other ranks' saves fail within the configured ``timeout``, with a ``CheckpointError`` naming the
missing rank, in every coordination mode; nothing is committed and the previous checkpoint still loads.
Full kill campaigns: ``python -m tests.faults.crash_campaign --mode async-rank|async-persist``
(docs/RELIABILITY.md).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")

from tests.faults.ranks import Ranks  # noqa: E402

T = 2.0  # the save timeout under test
SLACK = 6.0  # seconds allowed beyond it on 2 busy cores (process start-up, polling)


def _sd(step):
    return {"w": torch.arange(16.0) + step, "step": step}


def _missing(rank, world, root, who, mode, how):
    """Step 0 saves on every rank (a previous checkpoint, and a running session); for step 1 rank ``who``
    does not call async_save (``how="absent"``) or kills its own persist process right after the call
    (``how="persist-killed"``)."""
    import hyperdcp
    from hyperdcp.async_saving import async_save

    kw = {"coordination": mode, "timeout": T}
    # generous for the first save (persist processes start and rendezvous on busy cores)
    async_save(_sd(0), os.path.join(root, "step-0"), coordination=mode, timeout=60).result(timeout=120)
    path = os.path.join(root, "step-1")
    if rank == who and how == "absent":
        time.sleep(T + SLACK + 4)
        return ("absent", 0.0)
    t = time.monotonic()
    try:
        fut = async_save(_sd(1), path, **kw)
        if rank == who:
            os.kill(fut.worker_pid, signal.SIGKILL)
        fut.result(timeout=T + SLACK + 30)
    except hyperdcp.CheckpointError as e:
        return (f"{type(e).__name__}: {e}", time.monotonic() - t)
    return ("saved", time.monotonic() - t)


@pytest.mark.parametrize("mode,how,who", [
    ("gloo", "absent", 1),
    ("file", "absent", 0),
    ("gloo", "persist-killed", 1),
])
def test_async_missing_rank_is_named_within_timeout(tmp_path, mode, how, who):
    import hyperdcp

    world = 3 if (mode, how, who) == ("gloo", "absent", 1) else 2
    r = Ranks(world, _missing, str(tmp_path), who, mode, how)
    try:
        out = r.collect(120)
    finally:
        r.kill_all()
    for rank, (kind, val) in out.items():
        assert kind == "ok", (rank, val)
        if rank == who and how == "absent":
            continue
        msg, took = val
        assert msg != "saved", (rank, out)
        assert any(f in msg for f in (f"rank {who}", f"rank(s) {who}", f"rank(s) [{who}]")), (rank, msg)
        assert took < T + SLACK, (rank, took, msg)
    assert not hyperdcp.storage.commit.is_complete(str(tmp_path / "step-1"))
    assert hyperdcp.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-0")
