"""Blocking time, time to commit and peak host memory of hyperdcp.async_save vs torch DCP async_save.

    python bench/async_save.py --ranks 4 --mesh 2,2 --total-mib 256 --tensors 16 1024
    python bench/async_save.py --ranks 8 --mesh 4,2 --total-mib 1024 --tensors 16 1024   # the full matrix

Each configuration spawns ``--ranks`` local CPU ranks (gloo) holding an HSDP state dict on a mesh
(dp, fsdp) with placements [Replicate(), Shard(0)]: ``--tensors`` fp32 parameters of ``--total-mib``
MiB in all (each rank holds 1/fsdp of it). All ratios come from the same run. Per method:

* copy floor: copying the same local tensors into already-allocated, already-touched buffers (one
  ``copy_`` per tensor), measured right before each warm save call (max over ranks, median);
* blocking: wall time of the async_save call, max over ranks; first call and warm calls (median);
* commit: from the call until ``result()`` returns, max over ranks (median of warm calls);
* peak host memory: increase of the ranks' peak RSS (VmHWM) during the method's saves, summed over
  ranks, plus (hyperdcp) the persist processes' peak RSS. Shared staging pages count in both.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def _hwm_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _status(pid="self") -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM", "VmRSS")):
                    k, v = line.split(":")
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _rank(rank, world, store, args, q):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import hyperdcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dp, fs = args["mesh"]
    mesh = init_device_mesh("cpu", (dp, fs))
    n = args["tensors"]
    cols = 256
    rows = max(fs, (args["total_mib"] << 20) // (4 * cols * n) // fs * fs)
    g = torch.Generator().manual_seed(rank % fs)
    state = {"model": {}}
    for i in range(n):
        local = torch.randn(rows // fs, cols, generator=g)
        state["model"][f"layer{i:05d}.weight"] = DTensor.from_local(local, mesh, [Replicate(), Shard(0)],
                                                                    run_check=False)
    state["step"] = 0
    locals_ = [t.to_local() for t in state["model"].values()]
    local_bytes = sum(t.numel() * 4 for t in locals_)

    def maxall(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def sumall(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    out = {"local_mib": local_bytes / 2**20, "global_mib": n * rows * cols * 4 / 2**20}
    # copy floor: what any caller would do to snapshot the state: copy each local tensor into an
    # already-allocated (and already touched) buffer, one copy_ per tensor. Measured right before every
    # save call under the same barrier, so floor and blocking see the same machine load.
    dst = [torch.empty_like(t) for t in locals_]
    for d, s in zip(dst, locals_):
        d.copy_(s)
    floors: list[float] = []

    def floor() -> None:
        dist.barrier()
        t0 = time.perf_counter()
        for d, s in zip(dst, locals_):
            d.copy_(s)
        floors.append(maxall(time.perf_counter() - t0))

    root = args["dir"]

    def run(method: str) -> dict:
        blocks, commits = [], []
        base = _status()["VmRSS"]
        _hwm_reset()
        pid = None
        for k in range(1 + args["warm"]):
            path = f"{root}/{method}-{k}"
            if k > 0:
                floor()
            dist.barrier()
            t0 = time.perf_counter()
            if method == "hyperdcp":
                fut = hyperdcp.async_save(state, path, coordination=args["coordination"])
                pid = fut.worker_pid
            else:
                fut = dcp.async_save(state, checkpoint_id=path)
            b = time.perf_counter() - t0
            # what training would do next: mutate the parameters
            for t in locals_:
                t.add_(0.0)
            fut.result()
            c = time.perf_counter() - t0
            blocks.append(maxall(b))
            commits.append(maxall(c))
            dist.barrier()
            if rank == 0 and k > 0:
                shutil.rmtree(f"{root}/{method}-{k - 1}", ignore_errors=True)
        peak = _status()["VmHWM"] - base
        child = _status(pid).get("VmHWM", 0) if pid else 0
        dist.barrier()
        if rank == 0:
            shutil.rmtree(f"{root}/{method}-{args['warm']}", ignore_errors=True)
        return {"first_block_s": blocks[0], "warm_block_s": statistics.median(blocks[1:]),
                "first_commit_s": commits[0], "warm_commit_s": statistics.median(commits[1:]),
                "peak_rss_delta_mib": sumall(peak) / 2**20, "persist_proc_hwm_mib": sumall(child) / 2**20}

    out["hyperdcp"] = run("hyperdcp")
    out["torch"] = run("torch")
    out["floor_s"] = statistics.median(floors)  # same statistic as the warm blocking times
    out["floor_min_s"] = min(floors)
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def run_config(world: int, mesh: tuple[int, int], total_mib: int, tensors: int, warm: int, coordination: str,
               directory: str) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="hyperdcp-bench-store-")
    os.close(fd)
    os.unlink(store)
    args = {"mesh": mesh, "total_mib": total_mib, "tensors": tensors, "warm": warm, "dir": directory,
            "coordination": coordination}
    procs = [ctx.Process(target=_rank, args=(r, world, store, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=1800) for _ in range(world))
    for p in procs:
        p.join(timeout=120)
    return res[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[4])
    ap.add_argument("--mesh", nargs="+", default=["2,2"], help="dp,fsdp per --ranks entry")
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, nargs="+", default=[16, 1024])
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--coordination", default="gloo")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    directory = a.dir or tempfile.mkdtemp(prefix="hyperdcp-bench-")
    rows = []
    for world, m in zip(a.ranks, a.mesh):
        mesh = tuple(int(x) for x in m.split(","))
        assert mesh[0] * mesh[1] == world, f"mesh {mesh} does not have {world} ranks"
        for nt in a.tensors:
            r = run_config(world, mesh, a.total_mib, nt, a.warm, a.coordination, directory)
            h, t, fl = r["hyperdcp"], r["torch"], r["floor_s"]
            rows.append({"world": world, "mesh": list(mesh), "tensors": nt, **r})
            print(f"\n== {world} ranks, mesh {mesh}, {r['global_mib']:.0f} MiB fp32 in {nt} tensors "
                  f"({r['local_mib']:.0f} MiB local per rank), coordination={a.coordination}")
            print(f"copy floor (max over ranks, median) {fl * 1e3:9.1f} ms (min {r['floor_min_s'] * 1e3:.1f} ms)")
            for name, x in (("hyperdcp.async_save", h), ("torch dcp.async_save", t)):
                print(f"{name:22s} blocking first {x['first_block_s'] * 1e3:9.1f} ms "
                      f"({x['first_block_s'] / fl:5.2f}x floor)"
                      f"  warm {x['warm_block_s'] * 1e3:9.1f} ms ({x['warm_block_s'] / fl:5.2f}x floor)"
                      f"  commit first {x['first_commit_s']:6.2f} s warm {x['warm_commit_s']:6.2f} s"
                      f"  peak RSS +{x['peak_rss_delta_mib']:7.0f} MiB"
                      + (f" (+ persist procs {x['persist_proc_hwm_mib']:.0f} MiB)" if x["persist_proc_hwm_mib"]
                         else ""))
            print(f"ratios: warm blocking hyperdcp/floor {h['warm_block_s'] / fl:.2f} (target <= 1.5), "
                  f"hyperdcp/torch warm blocking {h['warm_block_s'] / t['warm_block_s']:.2f}, "
                  f"commit hyperdcp/torch {h['warm_commit_s'] / t['warm_commit_s']:.2f} (target <= 1)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not a.dir:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
