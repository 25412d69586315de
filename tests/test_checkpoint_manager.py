"""CheckpointManager: when it saves, what it keeps, and that it never lists, keeps or deletes the wrong one.

The keep rules are specified on :class:`hyperdcp.retention.Retention` directly (steps, commit times and
metrics in, steps kept out); the manager is then exercised end to end on local directories: numpy
states in one process, DTensors on 2 gloo ranks, restored on another world size.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import hyperdcp
from hyperdcp.retention import Retention, SaveSchedule, StepInfo
from hyperdcp.storage.local_commit import SaveTarget
from tests.dist import outcome, run_ranks, run_scenarios


def infos(*steps, losses=None, ages=None, now=1000.0):
    losses = losses or {}
    ages = ages or {}
    return [StepInfo(s, f"step-{s}", now - ages.get(s, 0), {"loss": losses[s]} if s in losses else {}) for s in steps]


def kept(rules: Retention, steps, now=1000.0, protected=()):
    return sorted(rules.kept(steps, now, protected))


# -- the keep rules ------------------------------------------------------------------------------------
def test_no_rule_keeps_everything():
    assert kept(Retention(), infos(1, 2, 3)) == [1, 2, 3]


def test_keep_last_n_keeps_the_n_newest_steps():
    assert kept(Retention(keep_last=2), infos(10, 30, 20, 40)) == [30, 40]


def test_keep_every_steps_keeps_multiples_forever_in_addition():
    assert kept(Retention(keep_last=1, keep_every_steps=100), infos(50, 100, 150, 200, 250)) == [100, 200, 250]


def test_keep_best_by_min_or_max_metric_keeps_unscored_unless_told():
    losses = {1: 5.0, 2: 3.0, 3: 4.0, 5: 2.0}  # step 4 and 6 have no loss
    steps = infos(1, 2, 3, 4, 5, 6, losses=losses)
    assert kept(Retention(keep_best=2, best_metric="loss"), steps) == [2, 4, 5, 6]
    assert kept(Retention(keep_best=2, best_metric="loss", keep_unscored=False), steps) == [2, 5, 6]
    assert kept(Retention(keep_best=1, best_metric="loss", best_mode="max", keep_unscored=False), steps) == [1, 6]


def test_the_newest_step_is_kept_even_when_it_is_the_worst():
    steps = infos(1, 2, 3, losses={1: 1.0, 2: 2.0, 3: 9.0})
    assert kept(Retention(keep_best=1, best_metric="loss"), steps) == [1, 3]


def test_keep_for_keeps_what_committed_within_the_duration():
    steps = infos(1, 2, 3, 4, ages={1: 7200, 2: 3000, 3: 100, 4: 50})
    assert kept(Retention(keep_for=3600), steps) == [2, 3, 4]
    assert kept(Retention(keep_for=60), steps) == [4]


def test_a_step_being_restored_is_never_let_go():
    assert kept(Retention(keep_last=1), infos(1, 2, 3), protected=[1]) == [1, 3]


def test_rules_are_checked_when_built():
    for bad in ({"keep_last": 0}, {"keep_best": 2}, {"best_metric": "loss"}, {"keep_best": 1, "best_metric": "l",
                                                                               "best_mode": "lowest"},
                {"keep_for": -1}):
        with pytest.raises(ValueError):
            Retention(**bad)


def test_save_schedule_every_n_steps_and_at_given_steps():
    sched = SaveSchedule(save_interval_steps=500, save_at_steps=frozenset({7, 1234}))
    assert [s for s in range(0, 1600) if sched.due(s)] == [0, 7, 500, 1000, 1234, 1500]
    assert [s for s in range(10) if SaveSchedule(None, frozenset({3})).due(s)] == [3]


# -- the manager, one process ------------------------------------------------------------------------
def state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((4, 8)).astype(np.float32), "step": step}


def blank() -> dict:
    return {"w": np.zeros((4, 8), np.float32), "step": -1}


def test_fresh_start_then_save_and_restore_bit_exact(tmp_path):
    mgr = hyperdcp.CheckpointManager(tmp_path / "run", keep_last=2, save_interval_steps=3)
    st = blank()
    assert mgr.restore(st) is None and st["step"] == -1
    saved = [s for s in range(1, 11) if mgr.save(s, state(s), metrics={"loss": 1.0 / s})]
    assert saved == [3, 6, 9]
    assert mgr.steps() == [6, 9] and mgr.latest_step() == 9
    assert sorted(os.listdir(tmp_path / "run")) == ["step-6", "step-9"]
    assert mgr.metrics(6) == {"loss": 1.0 / 6}
    st = blank()
    assert mgr.restore(st) == 9
    assert st["w"].tobytes() == state(9)["w"].tobytes() and st["step"] == 9
    assert mgr.restore(st, step=6) == 6 and st["w"].tobytes() == state(6)["w"].tobytes()
    with pytest.raises(hyperdcp.CheckpointNotFoundError, match="step 3 .* committed steps: \\[6, 9\\]"):
        mgr.restore(st, step=3)
    mgr.close()


def test_a_step_already_saved_is_not_saved_again_after_resume(tmp_path):
    with hyperdcp.CheckpointManager(tmp_path) as mgr:
        assert mgr.save(5, state(5))
    with hyperdcp.CheckpointManager(tmp_path) as mgr:
        step = mgr.restore(blank())
        assert step == 5 and not mgr.should_save(5) and mgr.should_save(6)
        assert not mgr.save(5, state(99))  # the loop's first iteration after a resume repeats the step
        assert mgr.save(6, state(6)) and mgr.steps() == [5, 6]


def test_metrics_live_in_the_commit_record_of_the_step(tmp_path):
    with hyperdcp.CheckpointManager(tmp_path, step_format="ckpt_{step:06d}") as mgr:
        mgr.save(42, state(42), metrics={"loss": 0.25, "split": "val"})
        with pytest.raises(ValueError):
            mgr.save(43, state(43), metrics={"loss": float("nan")})  # refused before anything is written
        assert mgr.steps() == [42]
    meta = hyperdcp.read_metadata(tmp_path / "ckpt_000042")
    assert meta.user["hyperdcp.manager"] == {"step": 42, "metrics": {"loss": 0.25, "split": "val"}}
    assert all(n.startswith(("hyperdcp.", "r0")) for n in os.listdir(tmp_path / "ckpt_000042"))
    for bad in ("step", "{epoch}-{step}", "{step}/x", ".{step}", "{step}{step}"):
        with pytest.raises(ValueError):
            hyperdcp.CheckpointManager(tmp_path, step_format=bad)


def test_keep_best_end_to_end(tmp_path):
    losses = {1: 5.0, 2: 3.0, 3: 4.0, 4: 1.0, 5: 2.0, 6: 6.0}
    with hyperdcp.CheckpointManager(tmp_path, keep_best=2, best_metric="loss") as mgr:
        for s, loss in losses.items():
            mgr.save(s, state(s), metrics={"loss": loss})
        assert mgr.steps() == [4, 5, 6]  # the two best, and the newest (the worst) until a newer one commits


def test_only_committed_steps_are_listed_and_leftovers_of_killed_runs_are_swept(tmp_path):
    root = tmp_path
    hyperdcp.save(state(1), root / "step-1")
    os.makedirs(root / "step-2")  # a directory without a commit record
    os.makedirs(root / ".step-3.hyperdcp-tmp-0123abcd")  # a save killed before its commit
    (root / ".step-3.hyperdcp-tmp-0123abcd" / "r00000-00.safetensors").write_bytes(b"x")
    os.makedirs(root / ".step-0.hyperdcp-trash-00ff00ff")  # a deletion killed midway
    live = SaveTarget(str(root / "step-4"))  # a save in progress (another process holds its lock)
    live.prepare()
    try:
        mgr = hyperdcp.CheckpointManager(root, keep_last=1)
        assert mgr.steps() == [1] and mgr.latest_step() == 1
        left = sorted(os.listdir(root))
        assert ".step-3.hyperdcp-tmp-0123abcd" not in left and ".step-0.hyperdcp-trash-00ff00ff" not in left
        assert os.path.isdir(live.tmp)  # a live save's temporary directory is not abandoned
        assert "step-2" in left  # not ours to delete: it is not a committed checkpoint
    finally:
        live.abort()
    st = blank()
    assert mgr.restore(st) == 1 and st["w"].tobytes() == state(1)["w"].tobytes()


def test_retention_waits_for_a_newer_commit(tmp_path):
    with hyperdcp.CheckpointManager(tmp_path) as keep_all:
        for s in range(1, 5):
            keep_all.save(s, state(s))
    mgr = hyperdcp.CheckpointManager(tmp_path, keep_last=1)
    assert mgr.restore(blank()) == 4 and mgr.steps() == [1, 2, 3, 4]  # restoring deletes nothing
    with pytest.raises(hyperdcp.StateDictError):
        mgr.save(5, {"w": object()})  # a failed save is no newer commit
    assert mgr.steps() == [1, 2, 3, 4]
    assert mgr.save(6, state(6)) and mgr.steps() == [6]
    mgr.close()
    with pytest.raises(hyperdcp.CheckpointError, match="closed"):
        mgr.save(7, state(7))


def test_async_saves_one_in_flight_and_failures_surface_at_the_next_call(tmp_path):
    big = {"w": np.ones(8 << 20, np.float32)}
    mgr = hyperdcp.CheckpointManager(tmp_path, keep_last=1, async_save=True, skip_if_busy=True)
    assert mgr.save(1, big)
    assert not mgr.save(2, big)  # step 1 still in flight: skipped, not queued
    mgr.wait_until_finished()
    assert mgr.steps() == [1]
    mgr.skip_if_busy = False
    (tmp_path / "step-3").write_bytes(b"a file where step 3 goes")
    assert mgr.save(3, state(3))  # started; it fails in the background
    with pytest.raises(hyperdcp.StorageError, match="step-3"):
        mgr.close()  # ... and the failure surfaces here, the next call
    assert hyperdcp.CheckpointManager(tmp_path).steps() == [1]
    mgr = hyperdcp.CheckpointManager(tmp_path, keep_last=1, async_save=True)
    assert mgr.save(4, state(4)) and mgr.save(5, state(5))  # the second waits for the first
    assert hyperdcp.is_checkpoint(tmp_path / "step-4")
    mgr.close()
    assert hyperdcp.CheckpointManager(tmp_path).steps() == [5]


def test_sigterm_makes_the_next_save_save_then_exit(tmp_path):
    prev = signal.getsignal(signal.SIGTERM)
    try:
        mgr = hyperdcp.CheckpointManager(tmp_path, save_interval_steps=1000, save_on_preemption=True)
        assert not mgr.save(1, state(1))
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(SystemExit) as exc:
            mgr.save(2, state(2))
        assert exc.value.code == 143 and hyperdcp.CheckpointManager(tmp_path).steps() == [2]
        assert signal.getsignal(signal.SIGTERM) == prev  # closed: the handler is gone

        got = []
        signal.signal(signal.SIGTERM, lambda *a: got.append("previous handler"))
        mgr = hyperdcp.CheckpointManager(tmp_path, save_interval_steps=1000, save_on_preemption=True,
                                         on_preemption="signal")
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.save(3, state(3)) and got == ["previous handler"]
        assert hyperdcp.CheckpointManager(tmp_path).steps() == [2, 3]
    finally:
        signal.signal(signal.SIGTERM, prev)


def test_deletion_refuses_what_is_not_a_checkpoint_name(tmp_path):
    from hyperdcp.storage.local import LocalStorage

    (tmp_path / "notes.txt").write_text("mine")
    root = LocalStorage(tmp_path)
    for bad in ("../elsewhere", ".hidden", "notes.txt", ""):
        with pytest.raises(hyperdcp.StorageError):
            root.delete(bad)
    root.delete("absent")  # nothing there: nothing to do
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_is_checkpoint(tmp_path):
    hyperdcp.save(state(1), tmp_path / "a")
    os.makedirs(tmp_path / "b")
    assert hyperdcp.is_checkpoint(tmp_path / "a")
    assert not hyperdcp.is_checkpoint(tmp_path / "b") and not hyperdcp.is_checkpoint(tmp_path / "nothing")


# -- two gloo ranks ----------------------------------------------------------------------------------
def _sharded(step: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8) * step
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}


def _ranks_save_restore_retain(rank, world, tmp):
    mgr = hyperdcp.CheckpointManager(os.path.join(tmp, "sync"), keep_last=2, keep_every_steps=4)
    for s in range(1, 7):
        mgr.save(s, _sharded(s), metrics={"loss": float(s)})
    st = _sharded(0)
    step = mgr.restore(st)
    return step, mgr.steps(), mgr.metrics(5), st["w"].full_tensor().tolist()


def _ranks_async_failure_everywhere(rank, world, tmp):
    root = os.path.join(tmp, "async")
    mgr = hyperdcp.CheckpointManager(root, keep_last=1, async_save=True)
    mgr.save(1, _sharded(1))
    mgr.wait_until_finished()
    if rank == 0:
        open(os.path.join(root, "step-2"), "w").close()  # rank 0's commit of step 2 will fail
    import torch.distributed as dist

    dist.barrier()
    mgr.save(2, _sharded(2))
    try:
        mgr.save(3, _sharded(3))  # the next call
        raised = None
    except hyperdcp.CheckpointError as e:
        raised = type(e).__name__
    mgr.close()
    return raised, hyperdcp.CheckpointManager(root).steps()


def _ranks_preempted_on_one_rank(rank, world, tmp):
    mgr = hyperdcp.CheckpointManager(os.path.join(tmp, "preempt"), save_interval_steps=100, save_on_preemption=True,
                                     on_preemption="continue")
    try:
        mgr.save(1, _sharded(1))
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is told
        saved = mgr.save(2, _sharded(2))
        return saved, mgr.preempted, mgr.steps()
    finally:
        mgr.close()


def test_two_ranks(tmp_path):
    res = run_ranks(2, run_scenarios, str(tmp_path),
                    [_ranks_save_restore_retain, _ranks_async_failure_everywhere, _ranks_preempted_on_one_rank],
                    timeout=120)
    for step, steps, metrics, full in outcome(res, "_ranks_save_restore_retain"):
        assert (step, steps, metrics) == (6, [4, 5, 6], {"loss": 5.0})
        assert full == (np.arange(64, dtype=np.float32).reshape(8, 8) * 6).tolist()
    assert outcome(res, "_ranks_async_failure_everywhere") == [("StorageError", [1]), ("RemoteRankError", [1])]
    assert outcome(res, "_ranks_preempted_on_one_rank") == [(True, True, [2])] * 2

    # the same run restored by one process (another world size): plain tensors, bit-exact
    import torch

    st = {"w": torch.zeros(8, 8), "step": -1}
    mgr = hyperdcp.CheckpointManager(tmp_path / "sync", keep_last=2, keep_every_steps=4)
    assert mgr.restore(st) == 6 and st["step"] == 6
    assert torch.equal(st["w"], torch.arange(64, dtype=torch.float32).reshape(8, 8) * 6)
    assert mgr.restore(st, step=4) == 4 and torch.equal(st["w"], torch.arange(64.0).reshape(8, 8) * 4)


def test_the_same_manager_lists_and_restores_through_a_remote_storage(tmp_path):
    """Through the Storage interface only: an fsspec URL (here fsspec's in-memory file system)."""
    import fsspec
    with hyperdcp.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state(s), metrics={"loss": s / 10})
    os.makedirs(tmp_path / "run" / ".step-4.hyperdcp-tmp-0a0b0c0d")  # an upload of a killed save: not listed
    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "run"), "/hyperdcp-manager-test/run", recursive=True)
    try:
        remote = hyperdcp.CheckpointManager("memory://hyperdcp-manager-test/run")
        assert remote.steps() == [2, 3] and remote.metrics(3) == {"loss": 0.3}
        st = blank()
        assert remote.restore(st) == 3 and st["w"].tobytes() == state(3)["w"].tobytes()
    finally:
        fs.rm("/hyperdcp-manager-test", recursive=True)
