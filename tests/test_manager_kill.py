"""kill -9 during a CheckpointManager's saves and retention: the newest committed step always restores
bit-exact, and the keep rules always hold.

A training loop (a forked child of a numpy-only campaign process: no torch, no process group) resumes
from the newest step and saves every step under ``keep_last=2, keep_every_steps=5``; it is killed with
SIGKILL either at a random moment, or at an exact point of a save (before the commit, between writing the
commit record and the rename, right after the commit) or of a retention (a checkpoint renamed to trash
and none of it removed yet, or its files removed and its directory not). The kill points are those of a
storage of the test's own, registered for ``killat://`` (tests/faults/storage.py: around ``staging.commit``,
and inside ``Storage.delete`` where a seccomp filter stops the removal); no hyperdcp code is patched. After
each kill a new manager (on the plain path) must:

* restore the newest committed step (the largest step ``hyperdcp.list_checkpoints`` finds), bit-exact,
  never older than the last step the loop saw committed;
* find every step the rules keep still there, and nothing visible that is not a complete checkpoint;
* once it committed the next step: exactly the steps the rules keep, and no leftover (temporary
  directory, trash) of the killed process.

Run as ``python -m tests.test_manager_kill TRIALS ROOT``: the test below does, and checks its report.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

KEEP_LAST, KEEP_EVERY = 2, 5
MODES = ("random", "save-before-commit", "save-before-rename", "save-after-commit", "trash-renamed",
         "trash-emptied")


def state_of(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(2048).astype(np.float32), "ids": rng.integers(0, 1 << 62, 64), "step": step}


def required(steps_so_far: int) -> set[int]:
    """The steps the rules keep once steps 1..steps_so_far all committed."""
    return set(range(max(1, steps_so_far - KEEP_LAST + 1), steps_so_far + 1)) | set(range(KEEP_EVERY, steps_so_far + 1,
                                                                                         KEEP_EVERY))


def manager(root: str):
    import hyperdcp

    return hyperdcp.CheckpointManager(root, keep_last=KEEP_LAST, keep_every_steps=KEEP_EVERY)


def _train(root: str, mode: str, seed: int, ack: int) -> None:
    """The child: resume, then save every step (an acknowledged step is written to fd ``ack``).

    Its manager runs on ``killat://root``: the root through :class:`tests.faults.storage.KillAtStorage`, which
    SIGKILLs the process at the ``nth`` time it reaches the point ``mode`` names (no hyperdcp code is patched)."""
    from tests.faults import storage as faults

    if mode != "random":
        os.environ[faults.KILL_AT_ENV] = f"{mode}:{random.Random(seed).randint(1, 3)}"
    mgr = manager(f"killat://{root}")
    st = state_of(0)
    start = mgr.restore(st) or 0
    # a random kill: save until killed (a fast machine saves 40 steps within the campaign's longest wait)
    for step in range(start + 1, start + (1 << 30 if mode == "random" else 40)):
        mgr.save(step, state_of(step))
        os.write(ack, b"%d\n" % step)
    os._exit(0)  # a mode whose point was never reached: the trial reports it


def _hidden(root: str) -> list[str]:
    return sorted(e for e in os.listdir(root) if e.startswith(".") and not e.endswith(".hyperdcp-lock"))


def campaign(trials: int, root: str) -> list[dict]:
    import hyperdcp

    hyperdcp.storage.register_storage("killat", "tests.faults.storage:KillAtStorage")  # the forked children's too
    os.makedirs(root, exist_ok=True)
    rng = random.Random(16)
    out, committed = [], 0  # the newest step the previous trial ended with
    for t in range(trials):
        mode = MODES[t % len(MODES)]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _train(root, mode, 1000 + t, w)
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
            finally:
                os._exit(3)
        os.close(w)
        if mode == "random":
            time.sleep(rng.uniform(0.02, 0.25))
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            acked = [int(x) for x in f.read().split()]
        rec = {"mode": mode, "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
               "last_ack": max(acked, default=committed), "hidden_after_kill": _hidden(root)}
        rec["trash_after_kill"] = [sorted(os.listdir(os.path.join(root, h))) for h in rec["hidden_after_kill"]
                                   if ".hyperdcp-trash-" in h]
        visible = sorted(e for e in os.listdir(root) if not e.startswith("."))
        rec["visible_incomplete"] = [e for e in visible if not hyperdcp.is_checkpoint(os.path.join(root, e))]
        newest = hyperdcp.list_checkpoints(root)
        rec["newest_committed"] = int(os.path.basename(newest[-1]).split("-")[1]) if newest else 0
        rec["latest_url"] = hyperdcp.latest_checkpoint(f"killat://{root}")  # the child's view of the root
        mgr = manager(root)
        st = {"w": np.zeros(2048, np.float32), "ids": np.zeros(64, np.int64), "step": -1}
        s = mgr.restore(st)  # None: nothing committed yet (a kill during the very first save), st untouched
        want = state_of(s) if s is not None else {"w": np.zeros(2048, np.float32), "ids": np.zeros(64, np.int64)}
        rec["bit_exact"] = (st["w"].tobytes() == want["w"].tobytes() and st["ids"].tobytes() == want["ids"].tobytes()
                            and st["step"] == (s if s is not None else -1))
        rec["restored"] = s = s or 0
        rec["present"] = mgr.steps()
        rec["required"] = sorted(required(s))
        mgr.save(s + 1, state_of(s + 1))  # the next commit: retention and sweeping catch up
        rec["present_after_next"] = mgr.steps()
        rec["required_after_next"] = sorted(required(s + 1))
        rec["hidden_after_next"] = _hidden(root)
        mgr.close()
        committed = s + 1
        out.append(rec)
    return out


def test_kill_during_save_and_retention(tmp_path):
    """30 trials, 5 per kill point; the whole campaign runs in one numpy-only process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                                          os.environ.get("PYTHONPATH", "")])}
    root = str(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "tests.test_manager_kill", "30", root], capture_output=True,
                          text=True, timeout=120, env=env, cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert proc.returncode == 0, proc.stderr[-4000:]
    trials = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(trials) == 30
    for i, t in enumerate(trials):
        where = f"trial {i} ({t['mode']}): {t}"
        assert t["killed"], where  # every kill point was reached
        assert t["visible_incomplete"] == [], where
        assert t["restored"] == t["newest_committed"] and t["restored"] >= t["last_ack"] >= 0, where
        assert t["bit_exact"], where
        assert t["latest_url"] == (f"killat://{root}/step-{t['newest_committed']}" if t["newest_committed"]
                                   else None), where
        assert set(t["required"]) <= set(t["present"]), where
        assert t["present_after_next"] == t["required_after_next"], where
        assert t["hidden_after_next"] == [], where
    # the kill points really left what they should: a killed save its temporary directory, a killed deletion
    # its trash (which the next manager removed, checked above)
    by_mode = {m: [t for t in trials if t["mode"] == m] for m in MODES}
    for m in ("save-before-commit", "save-before-rename"):
        assert all(any(".hyperdcp-tmp-" in h for h in t["hidden_after_kill"]) for t in by_mode[m]), m
    for m in ("trash-renamed", "trash-emptied"):
        assert all(any(".hyperdcp-trash-" in h for h in t["hidden_after_kill"]) for t in by_mode[m]), m
    # renamed to trash before any removal (the record included), and emptied before its directory went
    assert all(any("hyperdcp.json" in files for files in t["trash_after_kill"]) for t in by_mode["trash-renamed"])
    assert all(t["trash_after_kill"] == [[]] for t in by_mode["trash-emptied"])
    # a kill right after the commit: that step is restored although the loop never saw it acknowledged
    assert all(t["restored"] == t["last_ack"] + 1 for t in by_mode["save-after-commit"])
    assert trials[-1]["restored"] > 30  # the run made progress across the kills


def test_latest_checkpoint_through_a_registered_scheme(tmp_path):
    """latest_checkpoint / list_checkpoints on a URL of a registered scheme: that storage's listing, committed
    steps only (a file, a directory without a record and a killed save's temporary directory are not)."""
    import hyperdcp

    hyperdcp.storage.register_storage("killat", "tests.faults.storage:KillAtStorage")
    try:
        url = f"killat://{tmp_path}"
        assert hyperdcp.latest_checkpoint(url) is None
        with manager(url) as mgr:
            for step in (3, 10):
                mgr.save(step, state_of(step))
        (tmp_path / "notes.txt").write_text("x")
        (tmp_path / "step-11").mkdir()
        (tmp_path / ".step-12.hyperdcp-tmp-0123").mkdir()
        assert hyperdcp.list_checkpoints(url) == [f"{url}/step-3", f"{url}/step-10"]
        assert hyperdcp.latest_checkpoint(url) == f"{url}/step-10"
        st = {"w": np.zeros(2048, np.float32), "ids": np.zeros(64, np.int64), "step": -1}
        hyperdcp.load(st, hyperdcp.latest_checkpoint(url))
        assert st["w"].tobytes() == state_of(10)["w"].tobytes() and st["step"] == 10
    finally:
        hyperdcp.storage.unregister_storage("killat")


if __name__ == "__main__":
    print(json.dumps(campaign(int(sys.argv[1]), sys.argv[2])))
