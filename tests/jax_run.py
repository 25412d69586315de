"""Run a function in fresh JAX processes on CPU with a hard timeout (the pytest process never imports jax).

    results = run_jax(2, 4, "tests.test_jax_multiprocess:_save", {"path": p}, timeout=60)

starts 2 processes with 4 CPU devices each (``XLA_FLAGS`` is set before jax is imported),
``jax.distributed.initialize`` on 127.0.0.1 when there are several, calls ``fn(pid, nprocs, **args)`` in
each and returns their JSON results in process order. A process that raises fails the call with its
traceback; a run past ``timeout`` kills every process and fails, so a hang never blocks the suite.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MARK = "@@hyperdcp-result@@"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jax(nprocs: int, devices: int, target: str, args: dict | None = None, timeout: float = 60,
            expect_fail: bool = False) -> list:
    """``expect_fail``: return each process's (ok, result or traceback) instead of failing on errors."""
    env = dict(os.environ)
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.join(_ROOT, "src"), _ROOT]))
    port = _free_port()
    payload = json.dumps(args or {})
    procs = [subprocess.Popen([sys.executable, "-m", "tests.jax_run", target, str(i), str(nprocs), str(port), payload],
                              cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(nprocs)]
    deadline = time.monotonic() + timeout
    outs: list[str | None] = [None] * nprocs
    try:
        for i, p in enumerate(procs):
            try:
                outs[i], _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for i, out in enumerate(outs):
        if out is None:
            pytest.fail(f"timed out after {timeout}s waiting for JAX process {i}", pytrace=False)
        line = [ln for ln in out.splitlines() if ln.startswith(_MARK)]
        if not line:
            pytest.fail(f"JAX process {i} exited with {procs[i].returncode} and no result:\n{out[-4000:]}",
                        pytrace=False)
        ok, val = json.loads(line[-1][len(_MARK):])
        if not ok and not expect_fail:
            pytest.fail(f"JAX process {i} failed:\n{val}", pytrace=False)
        results.append((ok, val) if expect_fail else val)
    return results


def _main() -> None:
    target, pid, n, port, payload = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    try:
        import jax

        if n > 1:
            jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid,
                                       initialization_timeout=60)
        mod, fn = target.split(":")
        out = (True, getattr(importlib.import_module(mod), fn)(pid, n, **json.loads(payload)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out = (False, traceback.format_exc())
    print(_MARK + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip jax.distributed's shutdown barrier: a failed peer must not hold the others


if __name__ == "__main__":
    _main()
