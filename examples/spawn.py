"""Run ``fn(rank, world, *args)`` on ``world`` local gloo ranks (spawned, hard timeout); their return values.

Shared by the example tests, which run outside the project's test suite (see dev/test_examples.sh).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile

import torch.multiprocessing as mp


def _entry(rank, fn, world, port, out, args):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = fn(rank, world, *args)
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, fn, *args, timeout: float = 300) -> list:
    """Every rank's JSON-able return value, in rank order; a failing rank raises (with its traceback)."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), out, args), nprocs=world, join=False,
                                 start_method="spawn")
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks still running after {timeout}s")
        results = []
        for r in range(world):
            with open(os.path.join(out, f"{r}.json")) as f:
                results.append(json.load(f))
        return results
