"""kill -9 of a rank while it uploads a checkpoint to S3, then the invariants (issue 14).

    python -m tests.faults.s3_kill --trials 30 [--world 2]      # starts its own moto server on 127.0.0.1

Each trial: ``--world`` spawned gloo ranks save step-1 of a 16 MiB sharded state to
``s3://BUCKET/trial-N/step-1``, then step-2, and rank ``world - 1`` SIGKILLs itself a random delay
into the second save (``--world 1``: a lone process, no torch.distributed). Then, from the driver:

* the previous checkpoint (step-1) is listed and loads bit-exact;
* step-2 is listed iff it committed (the kill came after the commit) and then loads bit-exact; else
  loading it raises IncompleteCheckpointError / CheckpointNotFoundError: never a partial load.

Prints one line per trial and a summary; exits non-zero on any loss.
"""

from __future__ import annotations

import argparse
import faulthandler
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import threading
import time

import numpy as np

ROWS, COLS = 4096, 1024  # float32: 16 MiB; with 5 MiB parts every rank's file of a 2-rank save is a multipart upload


def expected(step: int) -> np.ndarray:
    return np.random.default_rng(step).standard_normal((ROWS, COLS), dtype=np.float32)


#: the watchdogs' files (kept open for faulthandler), one per rank of this process
_DUMPS: list = []


def _watchdog(rank: int) -> None:
    """A rank still alive ``HYPERDCP_KILL_DUMP`` seconds after it started writes every thread's stack to
    ``$HYPERDCP_KILL_DUMP_DIR/rank-<rank>.txt`` (and goes on): a void trial then tells where it hung."""
    where = os.environ.get("HYPERDCP_KILL_DUMP_DIR")
    if where:
        f = open(os.path.join(where, f"rank-{rank}.txt"), "w")  # noqa: SIM115 - open for the process's life
        _DUMPS.append(f)
        faulthandler.dump_traceback_later(float(os.environ.get("HYPERDCP_KILL_DUMP", "100")), exit=False, file=f)


def _rank(rank: int, world: int, root: str, delay: float) -> str:
    """One rank of a trial (inside tests.dist._entry when world > 1)."""
    import hyperdcp

    _watchdog(rank)

    def state(step: int):
        full = expected(step)
        if world == 1:
            return {"w": full, "step": step}
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        return {"w": distribute_tensor(torch.from_numpy(full), init_device_mesh("cpu", (world,)), [Shard(0)]),
                "step": step}

    hyperdcp.save(state(1), f"{root}/step-1")
    # built before the timer starts: distribute_tensor is a collective with torch's own (long) timeout, so a kill
    # landing in it would hang the other ranks there, outside the save under test
    sd = state(2)
    if rank == world - 1:
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    try:
        hyperdcp.save(sd, f"{root}/step-2", timeout=5)
    except hyperdcp.CheckpointError as e:
        return f"failed: {type(e).__name__}"
    return "committed"


def _alone(root: str, delay: float) -> None:
    _rank(0, 1, root, delay)


def run_trial(env: dict, root: str, world: int, delay: float, timeout: float = 240) -> list:
    """Spawn the trial's ranks and wait for them; their exit codes (the victim's is -9; None for a rank the
    harness had to kill after ``timeout``: the trial is void)."""
    from tests.dist import _entry

    ctx = mp.get_context("spawn")
    fd, store = tempfile.mkstemp(prefix="hyperdcp-store-")
    os.close(fd)
    os.unlink(store)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned children inherit it
    try:
        if world == 1:
            procs = [ctx.Process(target=_alone, args=(root, delay), daemon=True)]
        else:
            q = ctx.Queue()
            procs = [ctx.Process(target=_entry, args=(_rank, r, world, store, q, (root, delay), env), daemon=True)
                     for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        hung = []
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                hung.append(p)
                p.kill()
                p.join(5)
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        if os.path.exists(store):
            os.unlink(store)
    return [None if p in hung else p.exitcode for p in procs]


def check(root: str) -> str:
    """The invariants after a trial: "interrupted" or "committed"; AssertionError on a loss."""
    import hyperdcp

    listed = hyperdcp.list_checkpoints(root)
    assert listed in ([f"{root}/step-1"], [f"{root}/step-1", f"{root}/step-2"]), f"listed: {listed}"
    for step in range(1, len(listed) + 1):
        back = {"w": np.zeros((ROWS, COLS), np.float32), "step": 0}
        hyperdcp.load(back, f"{root}/step-{step}")
        assert np.array_equal(back["w"], expected(step)) and back["step"] == step, f"step-{step} differs"
    if len(listed) == 2:
        return "committed"
    try:
        hyperdcp.load({"w": np.zeros((ROWS, COLS), np.float32), "step": 0}, f"{root}/step-2")
    except (hyperdcp.IncompleteCheckpointError, hyperdcp.CheckpointNotFoundError):
        return "interrupted"
    raise AssertionError("step-2 is not listed but loads")


def hyperdcp_errors() -> type:
    import hyperdcp

    return hyperdcp.CheckpointError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--max-delay", type=float, default=1.2, help="kill within this many seconds of the save start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delay", type=float, default=None, help="kill this many seconds into every trial's save")
    ap.add_argument("--first", type=int, default=0, help="start at this trial (its seeded delay as in a full run)")
    ap.add_argument("--timeout", type=float, default=240, help="a trial with a rank alive after this is void")
    args = ap.parse_args(argv)
    from tests.s3_server import S3Server

    server = S3Server.start()
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    losses = 0
    try:
        server.make_bucket("kill-campaign")
        os.environ.update(server.env)
        os.environ["HYPERDCP_S3_PART_BYTES"] = str(5 << 20)  # multipart uploads, killed between parts
        os.environ["HYPERDCP_S3_SINGLE_PUT_BYTES"] = "0"
        t0 = time.monotonic()
        for i in range(args.first + args.trials):
            root, delay = f"s3://kill-campaign/trial-{i}", rng.uniform(0.05, args.max_delay)
            if i < args.first:
                continue
            delay = delay if args.delay is None else args.delay
            dumps = tempfile.mkdtemp(prefix="hyperdcp-kill-")
            env = {**server.env, "HYPERDCP_S3_PART_BYTES": str(5 << 20), "HYPERDCP_S3_SINGLE_PUT_BYTES": "0",
                   "HYPERDCP_KILL_DUMP_DIR": dumps,
                   "HYPERDCP_KILL_DUMP": str(max(1.0, args.timeout - 20))}
            codes = run_trial(env, root, args.world, delay, args.timeout)
            if None in codes:  # a rank outlived the trial's timeout: no verdict; where it hung, from its watchdog
                counts["void"] = counts.get("void", 0) + 1
                print(f"trial {i:2d}: VOID, kill after {delay:.2f} s, a rank did not finish within {args.timeout:g} s: "
                      f"exit codes {codes}", flush=True)
                for r, code in enumerate(codes):
                    path = os.path.join(dumps, f"rank-{r}.txt")
                    if code is None and os.path.exists(path):
                        print(f"--- rank {r}'s threads {args.timeout - 20:g} s into the trial:\n" + open(path).read(),
                              flush=True)
                continue
            try:
                outcome = check(root)
            except (AssertionError, hyperdcp_errors()) as e:  # a listed checkpoint that does not load is a loss
                outcome, losses = f"LOSS: {e}", losses + 1
            counts[outcome.split(":")[0]] = counts.get(outcome.split(":")[0], 0) + 1
            print(f"trial {i:2d}: kill after {delay:.2f} s, exit codes {codes}: {outcome}", flush=True)
        pending = server.boto().list_multipart_uploads(Bucket="kill-campaign").get("Uploads") or []
        print(f"{args.trials} trials, world {args.world}, {time.monotonic() - t0:.0f} s: {counts}, losses {losses}; "
              f"unfinished multipart uploads left by killed ranks: {len(pending)}")
    finally:
        server.stop()
    return 1 if losses else 0


if __name__ == "__main__":
    sys.exit(main())
