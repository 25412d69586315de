"""Leaks (issue 11, second campaign): processes that end by a signal or ``os._exit`` in the middle of a
read-once load or an async save leave no shared memory, temporary directory or lock behind -- they
clean up on SIGTERM, and what SIGKILL leaves is reclaimed by the next save or load on the host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import hyperdcp
from hyperdcp import shm
from hyperdcp.storage.commit import is_complete

torch = pytest.importorskip("torch")

from tests.faults.ranks import Ranks  # noqa: E402

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
ROOT = os.path.dirname(SRC)
SHM = "/dev/shm"

needs_shm = pytest.mark.skipif(not (os.path.isdir(SHM) and os.access(SHM, os.W_OK)), reason="needs a writable /dev/shm")


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, ROOT, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _owned_by(pid: int) -> list[str]:
    """hyperdcp shared-memory files whose names say process ``pid`` created them."""
    return sorted(n for n in os.listdir(SHM) if n.startswith("hyperdcp-") and f"-{pid}-" in n)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_shared_memory_names_say_whether_their_process_is_gone(tmp_path):
    """pid namespace + pid + start time: a dead owner or a reused pid is an orphan; live owners and other
    pid namespaces (containers sharing /dev/shm) are left alone."""
    mine = shm.new_name("stage")
    ns = mine.split("-")[2]
    parent, start = os.getppid(), shm.start_time(os.getppid())
    names = {
        "dead": f"hyperdcp-ro-{ns}-{_dead_pid()}-12345-0123456789ab",
        "reused pid": f"hyperdcp-stage-{ns}-{parent}-{start + 1}-0123456789ab",
        "alive": f"hyperdcp-stage-{ns}-{parent}-{start}-0123456789ab",
        "mine": mine,
        "other namespace": f"hyperdcp-ro-{int(ns, 16) + 1:x}-{_dead_pid()}-1-0123456789ab",
        "legacy dead": f"hyperdcp-stage-{_dead_pid()}-0123456789ab",
        "unrelated": "hyperdcp-notes.txt",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    assert shm.reclaim(str(tmp_path)) == 3
    assert sorted(os.listdir(tmp_path)) == sorted(names[k] for k in ("alive", "mine", "other namespace", "unrelated"))


class _Late:
    """A stateful object whose state_dict() waits for file ``go``: its rank plans late, so the other ranks sit
    in the read-once plan exchange with their segments named."""

    def __init__(self, go: str):
        self.go, self.sd = go, {"w": torch.zeros(256, 1024)}

    def state_dict(self):
        deadline = time.monotonic() + 90
        while not os.path.exists(self.go) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.sd

    def load_state_dict(self, sd):
        self.sd = sd


def _load_then_wait(rank, world, path, go):
    import hyperdcp

    m = _Late(go) if rank == 0 else _Late("/")
    try:
        hyperdcp.load({"m": m}, path, timeout=20)
    except hyperdcp.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return bool(torch.equal(m.sd["w"], torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024)))


@needs_shm
def test_a_rank_sigtermed_during_a_read_once_load_unlinks_its_segment_and_still_dies_of_sigterm(tmp_path):
    """Rank 1 waits in the plan exchange (rank 0 plans late) with its segment named; SIGTERM unlinks it once
    the blocking collective returns, and the rank ends by SIGTERM; rank 0 fails with a CheckpointError."""
    path = str(tmp_path / "c")
    hyperdcp.save({"m": {"w": torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024)}}, path)
    go = str(tmp_path / "go")
    r = Ranks(2, _load_then_wait, path, go)
    victim = r.procs[1].pid
    deadline = time.monotonic() + 90
    while not _owned_by(victim) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _owned_by(victim), "rank 1 never created its segment"
    os.kill(victim, signal.SIGTERM)
    time.sleep(0.3)
    open(go, "w").close()
    out = r.collect(60)
    r.kill_all()
    assert r.procs[1].exitcode == -signal.SIGTERM  # the default action, not swallowed
    assert out[0][0] == "ok" and isinstance(out[0][1], str) and "Error" in out[0][1], out  # a CheckpointError on rank 0
    assert _owned_by(victim) == []


_SEGMENT_THEN_HANG = """
    import time
    from hyperdcp.exchange import _Segment
    seg = _Segment(1 << 20)
    print(seg.name, flush=True)
    time.sleep(60)
"""


@needs_shm
def test_a_segment_of_a_sigkilled_process_is_reclaimed_by_the_next_one():
    """SIGKILL cannot be caught: the segment stays, and the next read-once segment created on this host
    reclaims it (its name carries the dead pid and start time)."""
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_SEGMENT_THEN_HANG)], stdout=subprocess.PIPE, text=True,
                         env=_env())
    name = p.stdout.readline().strip()
    assert os.path.exists(os.path.join(SHM, name))
    p.kill()
    p.wait()
    assert os.path.exists(os.path.join(SHM, name)) and shm.orphaned(name)
    from hyperdcp.exchange import _Segment

    _Segment(4096).close()
    assert not os.path.exists(os.path.join(SHM, name))


def _leftovers(parent, name: str) -> list[str]:
    return sorted(e for e in os.listdir(parent) if e.startswith(f".{name}.hyperdcp-"))


_EXIT_AFTER_ASYNC_SAVE = """
    import os, signal, sys, torch, hyperdcp
    how, path = sys.argv[1], sys.argv[2]
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # 32 MiB: the save takes a moment
    fut = hyperdcp.async_save(state, path)
    print(fut.worker_pid, flush=True)
    if how == "os._exit":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGTERM)
"""


@needs_shm
@pytest.mark.parametrize("how", ["os._exit", "SIGTERM"])
def test_a_training_process_ending_right_after_async_save_leaves_nothing_behind(tmp_path, how):
    """Its persist process finishes the save (committed, or failed and cleaned up), then exits: no temporary
    directory, no lock, no staging area in /dev/shm."""
    path = str(tmp_path / "c")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXIT_AFTER_ASYNC_SAVE), how, path], capture_output=True,
                       text=True, timeout=120, env=_env())
    child = int(r.stdout.split()[0])
    deadline = time.monotonic() + 60
    while shm.start_time(child) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shm.start_time(child) is None, "the persist process outlived its parent by a minute"
    assert _leftovers(tmp_path, "c") == []
    assert is_complete(path) or not os.path.exists(path)
    stage = [n for n in os.listdir(SHM) if n.startswith("hyperdcp-stage-") and shm.orphaned(n)]
    assert stage == [], stage
    if is_complete(path):
        got = {f"t{i}": torch.zeros(1 << 20) for i in range(8)}
        hyperdcp.load(got, path)
        assert all(torch.equal(got[f"t{i}"], torch.full((1 << 20,), float(i))) for i in range(8))


def test_sigterm_to_a_persist_process_mid_save_removes_its_temporary_directory_and_lock(tmp_path):
    from hyperdcp.async_saving import PersistProcessDiedError
    from hyperdcp.async_saving import session as saver
    from hyperdcp.storage import register_storage, unregister_storage

    hyperdcp.async_save({"w": torch.zeros(4)}, tmp_path / "c").result(timeout=60)  # the previous checkpoint
    # the same directory through a storage whose data-file writes hang (a hung network file system), served
    # for its URL scheme in the persist process too
    register_storage("stalling", "tests.faults.storage:StallingLocalStorage")
    try:
        fut = hyperdcp.async_save({"w": torch.ones(4)}, f"stalling://{tmp_path / 'c'}", overwrite=True)
        deadline = time.monotonic() + 30
        while not [e for e in _leftovers(tmp_path, "c") if "-tmp-" in e] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [e for e in _leftovers(tmp_path, "c") if "-tmp-" in e], "the save never created its temporary directory"
        assert [e for e in _leftovers(tmp_path, "c") if e.endswith("-lock")], "the save holds no lock"
        os.kill(fut.worker_pid, signal.SIGTERM)
        with pytest.raises(PersistProcessDiedError, match="SIGTERM"):
            fut.result(timeout=30)
        assert _leftovers(tmp_path, "c") == []
    finally:
        unregister_storage("stalling")
        saver.shutdown()
    got = {"w": torch.full((4,), 7.0)}
    hyperdcp.load(got, tmp_path / "c")
    assert torch.equal(got["w"], torch.zeros(4))  # the previous checkpoint, intact


_SIGTERM_GUARD = """
    import os, signal, sys, time
    from hyperdcp.shm import sigterm_cleanup
    mark = sys.argv[1]
    if sys.argv[2] == "user":
        signal.signal(signal.SIGTERM, lambda s, f: open(mark + ".user", "w").close())
    with sigterm_cleanup(lambda: open(mark + ".cleanup", "w").close()):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
    print("alive, handler restored:", signal.getsignal(signal.SIGTERM).__name__ == "<lambda>")
"""


@pytest.mark.parametrize("handler", ["default", "user"])
def test_sigterm_cleans_up_then_terminates_and_never_swallows_a_users_handler(tmp_path, handler):
    mark = str(tmp_path / "m")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_SIGTERM_GUARD), mark, handler], capture_output=True,
                       text=True, timeout=60, env=_env())
    if handler == "default":
        assert r.returncode == -signal.SIGTERM and os.path.exists(mark + ".cleanup"), (r.returncode, r.stderr)
    else:  # the user's handler runs instead and the process goes on; theirs is still installed afterwards
        assert r.returncode == 0 and os.path.exists(mark + ".user") and not os.path.exists(mark + ".cleanup"), r.stderr
        assert "alive, handler restored: True" in r.stdout
