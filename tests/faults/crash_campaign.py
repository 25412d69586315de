"""Crash campaign: kill -9 one rank at a random point of a multi-rank save, then check the invariants.

    python -m tests.faults.crash_campaign --trials 50 --world 3 [--mode sync|async-rank|async-persist]

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
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time

import numpy as np

NTENSORS = 6
ROWS_PER_RANK = 128
COLS = 2048
TIMEOUT = 5.0


def full(i: int, step: int, world: int):
    import torch

    n = world * ROWS_PER_RANK * COLS
    return (torch.arange(n, dtype=torch.float32) * (i + 1) + step * 1000.0).reshape(world * ROWS_PER_RANK, COLS)


def expected(step: int, world: int) -> dict:
    return {"model": {f"t{i}": full(i, step, world) for i in range(NTENSORS)}, "step": step}


def worker(rank: int, world: int, root: str, step: int, mode: str):
    import torch
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
    try:
        if mode == "sync":
            open(os.path.join(root, f".ready-{step}-{rank}"), "w").close()
            hyperdcp.save(state, path, timeout=TIMEOUT)
        else:
            from hyperdcp.async_save import async_save

            fut = async_save(state, path, timeout=TIMEOUT)
            with open(os.path.join(root, f".ready-{step}-{rank}"), "w") as f:
                f.write(str(_persist_pid()))
            fut.result(timeout=60)
    except hyperdcp.CheckpointError as e:
        return ("error", type(e).__name__, str(e)[:500], time.perf_counter() - t0)
    return ("saved", "", "", time.perf_counter() - t0)


def _persist_pid() -> int:
    """pid of this rank's persist process (async modes), found among our children."""
    import multiprocessing

    kids = [p.pid for p in multiprocessing.active_children()]
    if kids:
        return kids[-1]
    try:
        out = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
        return int(out[-1]) if out else 0
    except OSError:
        return 0


def load_exact(path: str, step: int, world: int) -> None:
    import torch

    import hyperdcp

    want = expected(step, world)
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": None}
    hyperdcp.load(got, path)
    assert got["step"] == step, (path, got["step"], step)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"{path}: {k} differs"


def campaign(trials: int, world: int = 3, mode: str = "sync", seed: int = 0, root: str | None = None, log=print) -> dict:
    import hyperdcp
    from tests.faults.ranks import Ranks

    rng = random.Random(seed)
    own = root is None
    tmp = tempfile.TemporaryDirectory(prefix="hdcp-crash-") if own else None
    root = tmp.name if own else root
    counts: dict[str, int] = {}
    failures: list[dict] = []
    t_start = time.perf_counter()

    def bump(k):
        counts[k] = counts.get(k, 0) + 1

    # step 0: an uninterrupted save gives the previous checkpoint and calibrates the save duration
    r = Ranks(world, worker, root, 0, mode)
    out = r.collect(120)
    r.kill_all()
    if not all(o[0] == "ok" and o[1][0] == "saved" for o in out.values()):
        raise RuntimeError(f"baseline save failed: {out}")
    save_s = max(o[1][3] for o in out.values())
    window = 1.5 * save_s + 0.05
    prev, step = 0, 1
    try:
        for trial in range(trials):
            info = {"trial": trial, "step": step}
            r = Ranks(world, worker, root, step, mode)
            deadline = time.monotonic() + 120
            ready = [os.path.join(root, f".ready-{step}-{k}") for k in range(world)]
            while not all(os.path.exists(p) for p in ready) and time.monotonic() < deadline:
                time.sleep(0.005)
            delay = rng.uniform(0, window)
            time.sleep(delay)
            victim = rng.randrange(world)
            if mode == "async-persist":
                try:
                    pid = int(open(ready[victim]).read() or 0)
                except (OSError, ValueError):
                    pid = 0
                target = pid
            else:
                target = r.procs[victim].pid
            try:
                if target:
                    os.kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass
            info.update(delay=round(delay, 4), victim=victim)
            t_kill = time.monotonic()
            out = r.collect(4 * TIMEOUT + 20)
            info["survivors_s"] = round(time.monotonic() - t_kill, 2)
            r.kill_all()
            for p in ready:
                if os.path.exists(p):
                    os.unlink(p)
            problems = []
            survivors = {k: v for k, v in out.items() if k != victim or mode == "async-persist"}
            if any(v[0] == "hung" for v in survivors.values()):
                problems.append(f"hung ranks: {[k for k, v in survivors.items() if v[0] == 'hung']}")
            if any(v[0] == "error" for v in survivors.values()):
                problems.append(f"non-CheckpointError on a rank: {[v[1][-300:] for v in survivors.values() if v[0] == 'error']}")
            reported = [k for k, v in out.items() if v[0] == "ok" and v[1][0] == "saved"]
            path = os.path.join(root, f"step-{step}")
            complete = _complete(path)
            try:
                load_exact(os.path.join(root, f"step-{prev}"), prev, world)
            except Exception as e:  # noqa: BLE001
                problems.append(f"PREVIOUS CHECKPOINT LOST: {type(e).__name__}: {e}")
            latest = hyperdcp.latest_checkpoint(root)
            if complete:
                bump("committed")
                try:
                    load_exact(path, step, world)
                except Exception as e:  # noqa: BLE001
                    problems.append(f"complete checkpoint does not load bit-exact: {type(e).__name__}: {e}")
                if latest != path:
                    problems.append(f"latest_checkpoint is {latest}, not the complete {path}")
                left = [e for e in os.listdir(root) if e.startswith(f".step-{step}.hyperdcp-tmp-")]
                if left:
                    problems.append(f"leftovers after a complete save: {left}")
            else:
                bump("interrupted")
                if reported:
                    problems.append(f"rank(s) {reported} reported an incomplete checkpoint as saved")
                if latest != os.path.join(root, f"step-{prev}"):
                    problems.append(f"latest_checkpoint picked {latest}, not the previous step-{prev}")
                try:
                    load_exact(path, step, world)
                    problems.append("loading the interrupted checkpoint succeeded")
                except hyperdcp.IncompleteCheckpointError:
                    bump("load: IncompleteCheckpointError")
                except hyperdcp.CheckpointNotFoundError:
                    bump("load: CheckpointNotFoundError")
                except Exception as e:  # noqa: BLE001
                    problems.append(f"loading the interrupted checkpoint: {type(e).__name__}: {e}")
            for k, v in survivors.items():
                bump(f"rank outcome: {v[0] if v[0] != 'ok' else v[1][0] + ('/' + v[1][1] if v[1][1] else '')}")
            if problems:
                info["problems"] = problems
                info["outcomes"] = {k: (v[0], str(v[1])[:300]) for k, v in out.items()}
                failures.append(info)
                log(f"trial {trial}: FAIL {info}")
                bump("failed")
            if complete:
                # keep the disk small: the new checkpoint becomes the previous one
                import shutil

                shutil.rmtree(os.path.join(root, f"step-{prev}"), ignore_errors=True)
                prev, step = step, step + 1
            # else: the next trial saves to the same path again (retry over the leftovers)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return {"mode": mode, "world": world, "trials": trials, "seed": seed, "save_window_s": round(window, 3),
            "seconds": round(time.perf_counter() - t_start, 1), "counts": counts, "failures": failures}


def _complete(path: str) -> bool:
    from hyperdcp.storage.commit import is_complete

    return is_complete(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--mode", default="sync", choices=("sync", "async-rank", "async-persist"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", help="directory to save into (default: a temporary one)")
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args(argv)
    res = campaign(a.trials, a.world, a.mode, a.seed, a.root)
    print(json.dumps({k: v for k, v in res.items() if k != "failures"}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print("PASS" if not res["failures"] else f"FAIL: {len(res['failures'])} trial(s)")
    return 0 if not res["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
