"""Crash campaign: kill -9 one rank at a random point of a multi-rank save, then check the invariants.

    python -m tests.faults.crash_campaign --trials 50 --world 3 [--mode sync|async-rank|async-persist]
                                          [--signal KILL|TERM|STOP]

Each trial spawns ``--world`` local gloo ranks that save step k of a deterministic sharded state to
``ROOT/step-k`` (timeout= a few seconds); once every rank is about to save, the driver sleeps a random
delay within the measured save time and SIGKILLs one random rank (``async-persist``: one rank's persist
process). Then:

* the surviving ranks end within the timeout (no hang), with a CheckpointError or a completed save;
* the previous checkpoint still loads bit-exact;
* the interrupted one is complete and loads bit-exact with step k (the kill came after the commit), or
  it is not complete: loading it raises IncompleteCheckpointError / CheckpointNotFoundError, no rank
  reported it saved, and ``latest_checkpoint`` does not pick it;
* the next trial saves to the same path again; once it completes, no temporary directory of it is left.

``--signal`` (second campaign, issue 11): ``TERM`` must leave nothing behind once every process of the
trial has ended -- no temporary directory, no lock, no orphaned ``/dev/shm/hyperdcp-*`` file -- and
the victim must still die of SIGTERM; ``STOP`` freezes the victim (a persist process stuck on a hung
file system): every other process must end within the bound (its persist process is declared stuck
after ``HYPERDCP_PERSIST_STALL_SECONDS``). In every mode, a killed *training* process's persist process
finishes or cleans up the save, so ``async-rank`` trials must leave nothing either; and at the end of
the campaign (after the final save, which reclaims orphans) no orphaned shared-memory file is left.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time

import numpy as np

from tests.faults.report import finish

NTENSORS = 6
ROWS_PER_RANK = 256
COLS = 2048
TIMEOUT = 5.0
STALL_S = 2.0  # HYPERDCP_PERSIST_STALL_SECONDS in the ranks: a stopped persist process counts as stuck after this
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "STOP": signal.SIGSTOP}


def shm_orphans() -> list[str]:
    """hyperdcp shared-memory files in /dev/shm whose creating process is gone."""
    from hyperdcp import shm

    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("hyperdcp-") and shm.orphaned(n))
    except OSError:
        return []


def _gone(pids: list[int], wait: float) -> bool:
    """Wait until every pid has exited (persist processes finish their save after their parent died)."""
    from hyperdcp.shm import start_time

    deadline = time.monotonic() + wait
    while any(p and start_time(p) is not None for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def full(i: int, step: int, world: int):
    import torch

    n = world * ROWS_PER_RANK * COLS
    return (torch.arange(n, dtype=torch.float32) * (i + 1) + step * 1000.0).reshape(world * ROWS_PER_RANK, COLS)


def expected(step: int, world: int) -> dict:
    return {"model": {f"t{i}": full(i, step, world) for i in range(NTENSORS)}, "step": step}


def worker(rank: int, world: int, root: str, step: int, mode: str, coordination: str = "gloo",
           timeout: float = TIMEOUT):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import hyperdcp

    mesh = init_device_mesh("cpu", (world,))
    model = {}
    for i in range(NTENSORS):
        g = full(i, step, world)
        local = g[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK].clone()
        model[f"t{i}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=g.shape, stride=g.stride())
    state = {"model": model, "step": step}
    path = os.path.join(root, f"step-{step}")
    t0 = time.perf_counter()
    ready = os.path.join(root, f".ready-{step}-{rank}")
    try:
        if mode == "sync":
            open(ready, "w").close()
            hyperdcp.save(state, path, timeout=timeout)
        else:
            from hyperdcp.async_saving import async_save

            if mode == "async-rank":  # the kill may also land during staging
                open(ready, "w").close()
            fut = async_save(state, path, timeout=timeout, coordination=coordination)
            # the persist process handling this save, as the async_save API reports it
            with open(ready + (".pid.tmp" if mode == "async-rank" else ".tmp"), "w") as f:
                f.write(str(fut.worker_pid or 0))
            if mode == "async-persist":
                os.rename(ready + ".tmp", ready)
            else:
                os.rename(ready + ".pid.tmp", ready + ".pid")
            fut.result(timeout=60)
    except hyperdcp.CheckpointError as e:
        return ("error", type(e).__name__, str(e)[:500], time.perf_counter() - t0)
    return ("saved", "", "", time.perf_counter() - t0)


def load_exact(path: str, step: int, world: int) -> None:
    import torch

    import hyperdcp

    want = expected(step, world)
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": None}
    hyperdcp.load(got, path)
    assert got["step"] == step, (path, got["step"], step)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"{path}: {k} differs"


def _wait_ready(ready: list[str], deadline: float) -> bool:
    while not all(os.path.exists(p) for p in ready):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _void(out: dict) -> bool:
    """Every rank failed before saving for a reason outside the campaign (e.g. a half-written source file
    while another engineer edits the tree): not a trial."""
    return all(v[0] == "error" and any(x in str(v[1]) for x in ("ImportError", "SyntaxError", "ModuleNotFound",
                                                                   "IndentationError", "NameError"))
               for v in out.values())


def campaign(trials: int, world: int = 3, mode: str = "sync", seed: int = 0, root: str | None = None, log=print,
             coordination: str = "gloo", warmup: int = 2, window_scale: float = 1.0, timeout: float = TIMEOUT,
             sig: str = "KILL") -> dict:
    """``warmup`` uninterrupted saves measure the commit latency L (from "every rank is about to save" to
    the checkpoint directory appearing, seen by this driver); each trial kills after a delay drawn
    uniformly from [0, window_scale * L], where L is the median of the latencies seen so far (trials that
    commit before their kill add theirs). Each trial records whether the kill came before or after the
    commit became visible, and whether the save nevertheless committed."""
    import shutil

    import hyperdcp
    from tests.faults.ranks import Ranks

    rng = random.Random(seed)
    own = root is None
    tmp = tempfile.TemporaryDirectory(prefix="hdcp-crash-") if own else None
    root = tmp.name if own else root
    counts: dict[str, int] = {}
    failures: list[dict] = []
    trial_log: list[dict] = []
    latencies: list[float] = []
    t_start = time.perf_counter()

    def bump(k):
        counts[k] = counts.get(k, 0) + 1

    def ready_files(step):
        return [os.path.join(root, f".ready-{step}-{k}") for k in range(world)]

    env = {"HYPERDCP_PERSIST_STALL_SECONDS": str(STALL_S)}
    signum = SIGNALS[sig]

    def persist_pids(step):
        out = []
        for p in ready_files(step):
            for q in (p, p + ".pid"):
                try:
                    out.append(int(open(q).read() or 0))
                except (OSError, ValueError):
                    pass
        return out

    def clear_ready(step):
        for p in ready_files(step):
            for q in (p, p + ".tmp", p + ".pid", p + ".pid.tmp"):
                if os.path.exists(q):
                    os.unlink(q)

    # warm-up: uninterrupted saves give the previous checkpoint and calibrate the commit latency
    prev, step = -1, 0
    for _ in range(max(1, warmup)):
        path = os.path.join(root, f"step-{step}")
        r = Ranks(world, worker, root, step, mode, coordination, timeout, env=env)
        _wait_ready(ready_files(step), time.monotonic() + 120)
        t0 = time.monotonic()
        while not os.path.exists(path) and time.monotonic() < t0 + 60:
            time.sleep(0.002)
        lat = time.monotonic() - t0
        out = r.collect(120)
        r.kill_all()
        clear_ready(step)
        if not all(o[0] == "ok" and o[1][0] == "saved" for o in out.values()):
            raise RuntimeError(f"warm-up save failed: {out}")
        latencies.append(lat)
        if prev >= 0:
            shutil.rmtree(os.path.join(root, f"step-{prev}"), ignore_errors=True)
        prev, step = step, step + 1
    warm_latencies = [round(x, 3) for x in latencies]
    valid = voids = 0
    max_survivor_s = 0.0
    try:
        while valid < trials:
            info: dict = {"trial": valid, "step": step}
            ready = ready_files(step)
            path = os.path.join(root, f"step-{step}")
            r = Ranks(world, worker, root, step, mode, coordination, timeout, env=env)
            if not _wait_ready(ready, time.monotonic() + 120):
                out = r.collect(5)
                r.kill_all()
                clear_ready(step)
                # every rank failed before the kill point (e.g. a timeout of the session's start-up on an
                # overloaded machine): nothing was interrupted, so not a trial
                early = all(v[0] == "ok" and v[1][0] == "error" for v in out.values())
                if (_void(out) or early) and voids < 10:
                    voids += 1
                    log(f"void trial (ranks failed before saving): {str(out)[:300]}")
                    continue
                raise RuntimeError(f"ranks never became ready: {out}")
            t_ready = time.monotonic()
            window = window_scale * float(np.median(latencies))
            delay = rng.uniform(0, window)
            committed_at = None
            while time.monotonic() < t_ready + delay:
                if committed_at is None and os.path.exists(path):
                    committed_at = time.monotonic() - t_ready
                time.sleep(0.001)
            victim = rng.randrange(world)
            if mode == "async-persist":
                try:
                    target = int(open(ready[victim]).read() or 0)
                except (OSError, ValueError):
                    target = 0
            else:
                target = r.procs[victim].pid
            visible = os.path.exists(path)
            try:
                if target:
                    os.kill(target, signum)
            except ProcessLookupError:
                pass
            t_kill = time.monotonic()
            if committed_at is not None:
                latencies.append(committed_at)
            phase = "after commit" if visible else "before commit"
            info.update(delay=round(delay, 4), window=round(window, 4), victim=victim, pid=target, phase=phase)
            out = r.collect(4 * timeout + 20)
            info["survivors_s"] = round(time.monotonic() - t_kill, 2)
            pids = [p for p in persist_pids(step) if p]
            if mode != "async-persist":
                r.procs[victim].join(15)  # it may have reported its result just before the signal came
            victim_exit = r.procs[victim].exitcode if mode != "async-persist" else None
            victim_reported = out.get(victim, ("",))[0] == "ok"
            r.kill_all()  # a stopped victim goes too (SIGKILL works on stopped processes)
            clear_ready(step)
            problems = []
            if sig == "TERM" and mode != "async-persist" and victim_exit != -signal.SIGTERM and not (
                    victim_reported and victim_exit == 0):
                problems.append(f"the victim did not die of SIGTERM (exit {victim_exit}): a handler swallowed it")
            # every process of the trial has ended (persist processes finish a save their parent left)
            if not _gone(pids, 4 * timeout + 20):
                problems.append(f"persist processes {pids} outlived their training processes")
            # SIGKILL/STOP of a committer may leave its temporary directory and lock for the next save to remove;
            # so may SIGTERM of a synchronous save (hyperdcp installs no handler there)
            strict = (sig == "TERM" and mode != "sync") or mode == "async-rank"
            left = sorted(e for e in os.listdir(root) if e.startswith(f".step-{step}.hyperdcp-"))
            if left and strict:
                problems.append(f"left behind by a {sig}ed "
                                f"{'training process' if mode != 'async-persist' else 'persist process'}: {left}")
            elif left:
                bump(f"SIG{sig} of the committer: temporary directory/lock left for the next save")
            orphans = shm_orphans()
            if orphans and sig == "TERM":
                problems.append(f"orphaned shared memory after SIGTERM: {orphans}")
            elif orphans:
                bump(f"SIG{sig}: orphaned shared memory left for the next save to reclaim")
            survivors = {k: v for k, v in out.items() if k != victim or mode == "async-persist"}
            if any(v[0] == "hung" for v in survivors.values()):
                problems.append(f"hung ranks: {[k for k, v in survivors.items() if v[0] == 'hung']}")
            if any(v[0] == "error" for v in survivors.values()):
                problems.append("non-CheckpointError on a rank: "
                                f"{[v[1][-300:] for v in survivors.values() if v[0] == 'error']}")
            max_survivor_s = max(max_survivor_s, info["survivors_s"])
            reported = [k for k, v in out.items() if v[0] == "ok" and v[1][0] == "saved"]
            complete = _complete(path)
            try:
                load_exact(os.path.join(root, f"step-{prev}"), prev, world)
            except Exception as e:  # noqa: BLE001
                problems.append(f"PREVIOUS CHECKPOINT LOST: {type(e).__name__}: {e}")
            latest = hyperdcp.latest_checkpoint(root)
            info["result"] = "committed" if complete else "interrupted"
            bump(f"kill {phase}, save {info['result']}")
            if complete:
                try:
                    load_exact(path, step, world)
                except Exception as e:  # noqa: BLE001
                    problems.append(f"complete checkpoint does not load bit-exact: {type(e).__name__}: {e}")
                if latest != path:
                    problems.append(f"latest_checkpoint is {latest}, not the complete {path}")
                left = [e for e in os.listdir(root) if e.startswith(f".step-{step}.hyperdcp-tmp-")]
                if left:
                    problems.append(f"leftovers after a complete save: {left}")
                if counts.pop("_pending_retry", None):
                    bump("next save over an interrupted one: committed")
            else:
                if reported:
                    problems.append(f"rank(s) {reported} reported an incomplete checkpoint as saved")
                if latest != os.path.join(root, f"step-{prev}"):
                    problems.append(f"latest_checkpoint picked {latest}, not the previous step-{prev}")
                try:
                    load_exact(path, step, world)
                    problems.append("loading the interrupted checkpoint succeeded")
                except hyperdcp.IncompleteCheckpointError as e:
                    bump("load: IncompleteCheckpointError")
                    if "incomplete checkpoint" not in str(e):
                        problems.append(f"unclear incomplete-checkpoint error: {e}")
                except hyperdcp.CheckpointNotFoundError:
                    bump("load: CheckpointNotFoundError")
                except Exception as e:  # noqa: BLE001
                    problems.append(f"loading the interrupted checkpoint: {type(e).__name__}: {e}")
                counts["_pending_retry"] = 1
            for k, v in out.items():
                who = "victim" if k == victim and mode != "async-persist" else (
                    "victim's rank" if k == victim else "survivor")
                if who == "victim":
                    continue
                bump(f"{who}: {v[0] if v[0] != 'ok' else v[1][0] + ('/' + v[1][1] if v[1][1] else '')}")
            if problems:
                info["problems"] = problems
                info["outcomes"] = {k: (v[0], str(v[1])[:300]) for k, v in out.items()}
                failures.append(info)
                log(f"trial {valid}: FAIL {info}")
                bump("failed")
            else:
                log(f"trial {valid}: ok {info}")
            trial_log.append(info)
            valid += 1
            if complete:
                # keep the disk small: the new checkpoint becomes the previous one
                shutil.rmtree(os.path.join(root, f"step-{prev}"), ignore_errors=True)
                prev, step = step, step + 1
            # else: the next trial saves to the same path again (retry over the leftovers)
        # a final uninterrupted save over whatever the last trial left
        r = Ranks(world, worker, root, step, mode, coordination, timeout, env=env)
        out = r.collect(120)
        r.kill_all()
        _gone(persist_pids(step), 30)
        clear_ready(step)
        orphans_at_end = shm_orphans()  # the final save reclaimed any the trials left
        if orphans_at_end:
            failures.append({"trial": "final",
                             "problems": [f"orphaned shared memory after the final save: {orphans_at_end}"]})
        final_ok = all(o[0] == "ok" and o[1][0] == "saved" for o in out.values()) and _complete(
            os.path.join(root, f"step-{step}"))
        if not final_ok:
            failures.append({"trial": "final", "outcomes": {k: (v[0], str(v[1])[:300]) for k, v in out.items()}})
        leftovers = sorted(e for e in os.listdir(root) if e.startswith(".") and not e.startswith(".ready-"))
    finally:
        if tmp is not None:
            tmp.cleanup()
    counts.pop("_pending_retry", None)
    return {"mode": mode, "signal": sig, "coordination": coordination if mode != "sync" else None,
            "world": world, "trials": trials,
            "seed": seed, "timeout_s": timeout, "void_trials": voids, "warmup_commit_latency_s": warm_latencies,
            "final_window_s": round(window_scale * float(np.median(latencies)), 3),
            "max_survivor_end_s": max_survivor_s, "final_save_ok": final_ok, "leftover_entries_at_end": leftovers,
            "seconds": round(time.perf_counter() - t_start, 1), "counts": dict(sorted(counts.items())),
            "failures": failures, "trials_log": trial_log}


def _complete(path: str) -> bool:
    from hyperdcp.storage.commit import is_complete

    return is_complete(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--mode", default="sync", choices=("sync", "async-rank", "async-persist"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--coordination", default="gloo", choices=("gloo", "file", "none"),
                    help="async modes: the persist processes' coordination mode")
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help="the saves' timeout= (raise it on busy machines)")
    ap.add_argument("--warmup", type=int, default=2, help="uninterrupted saves that calibrate the commit latency")
    ap.add_argument("--window-scale", type=float, default=1.0, help="kill delay ~ U[0, scale x commit latency]")
    ap.add_argument("--signal", default="KILL", choices=tuple(SIGNALS), help="what the victim gets")
    ap.add_argument("--root", help="directory to save into (default: a temporary one)")
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args(argv)
    res = campaign(a.trials, a.world, a.mode, a.seed, a.root, coordination=a.coordination, warmup=a.warmup,
                   window_scale=a.window_scale, timeout=a.timeout, sig=a.signal, log=lambda m: print(m, flush=True))
    return finish(res, a.json, len(res["failures"]), hidden=("failures", "trials_log"))


if __name__ == "__main__":
    sys.exit(main())
