"""Run a function on N local CPU ranks (spawned processes, gloo) with a hard timeout.

    results = run_ranks(4, fn, arg1, arg2, timeout=120)   # fn(rank, world_size, *args) -> picklable

A rank that raises fails the call with its traceback; a run that exceeds ``timeout`` kills every rank
and fails, so a hang can never block the suite.

Ranks start from a fork server that has imported torch once (``HYPERDCP_TEST_START=spawn`` starts
each rank as a fresh interpreter instead): a rank then starts in milliseconds instead of seconds of
torch imports. hyperdcp itself is imported fresh by every rank, and every rank gets the caller's
environment as it is at the call (``env`` on top), as a spawned process would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback

import pytest

_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        method = os.environ.get("HYPERDCP_TEST_START", "forkserver")
        _CONTEXT = mp.get_context(method)
        if method == "forkserver":
            _CONTEXT.set_forkserver_preload(["numpy", "torch", "torch.distributed"])
    return _CONTEXT


def _entry(fn, rank, world, store_path, q, args, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        try:
            out = fn(rank, world, *args)
            q.put((rank, True, out))
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    except BaseException:  # noqa: BLE001
        q.put((rank, False, traceback.format_exc()))


def run_ranks(world: int, fn, *args, timeout: float = 120, env: dict | None = None):
    ctx = _context()
    q = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="hyperdcp-store-")
    os.close(fd)
    os.unlink(store)
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store, q, args, {**os.environ, **(env or {})}),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    import queue as _queue
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, out = q.get(timeout=min(left, 1.0))
            except _queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and q.empty():
                    dead = [r for r, p in enumerate(procs)
                            if p.exitcode not in (None, 0) and r not in results and r not in errors]
                    if dead:
                        time.sleep(0.5)
                        if q.empty():
                            for r in dead:
                                errors[r] = f"rank {r} exited with code {procs[r].exitcode}"
                continue
            (results if ok else errors)[rank] = out
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if os.path.exists(store):
            os.unlink(store)
    if errors:
        first = min(errors)
        pytest.fail(f"rank {first} failed:\n{errors[first]}", pytrace=False)
    if len(results) < world:
        missing = sorted(set(range(world)) - set(results))
        pytest.fail(f"timed out after {timeout}s waiting for rank(s) {missing}", pytrace=False)
    return [results[r] for r in range(world)]


def run_scenarios(rank: int, world: int, tmp: str, scenarios) -> dict:
    """Inside ``run_ranks``: run every scenario function on this rank, a barrier after each.

    Returns ``{name: (True, its result) or (False, its traceback)}``, read back with :func:`outcome`, so
    one spawn of the ranks serves many tests and each test reports its own scenario's failure."""
    import torch.distributed as dist

    out = {}
    for fn in scenarios:
        try:
            out[fn.__name__] = (True, fn(rank, world, tmp))
        except Exception:  # noqa: BLE001 - reported by the scenario's own test
            out[fn.__name__] = (False, traceback.format_exc())
        dist.barrier()
    return out


def outcome(results, name: str) -> list:
    """Every rank's result of scenario ``name`` from :func:`run_scenarios`; fails naming the rank that raised."""
    for rank, res in enumerate(results):
        ok, val = res[name]
        assert ok, f"rank {rank}:\n{val}"
    return [res[name][1] for res in results]
