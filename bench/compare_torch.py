"""hyperdcp vs torch.distributed.checkpoint: the same state dict saved and loaded on N local ranks.

Layout: HSDP mesh (2, N/2) [Replicate, Shard(0)] of fp32 matrices (MiB total configurable); load into
the same layout. Reported per library: wall time (max over ranks), bytes written and read at the
syscall level (/proc/self/io wchar/rchar deltas, summed over ranks), checkpoint size on disk, peak RSS
(max over ranks), and the physical floor (dd of the same number of bytes into the same file system).

    python bench/compare_torch.py --ranks 4 --mib 256
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def _io() -> tuple[int, int]:
    d = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            d[k] = int(v)
    return d["rchar"], d["wchar"]


def _state(mesh, mib: int, zeros: bool):
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    n = 16
    rows = int((mib << 20) / 4 / n / 1024)
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(n):
        t = torch.zeros(rows, 1024) if zeros else torch.randn(rows, 1024, generator=g)
        out[f"layer{i}.weight"] = distribute_tensor(t, mesh, [Replicate(), Shard(0)])
    return out


def _worker(rank, world, store, root, mib, q):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh

        import hyperdcp

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (2, world // 2))
        sd = _state(mesh, mib, zeros=False)
        res = {}
        for lib in ("torch", "hyperdcp"):
            path = os.path.join(root, lib)
            dist.barrier()
            r0, w0 = _io()
            t = time.perf_counter()
            if lib == "torch":
                dcp.save(sd, checkpoint_id=path)
            else:
                hyperdcp.save(sd, path)
            dist.barrier()
            save_s = time.perf_counter() - t
            r1, w1 = _io()
            target = _state(mesh, mib, zeros=True)
            dist.barrier()
            t = time.perf_counter()
            if lib == "torch":
                dcp.load(target, checkpoint_id=path)
            else:
                hyperdcp.load(target, path)
            dist.barrier()
            load_s = time.perf_counter() - t
            r2, w2 = _io()
            ok = all(torch.equal(target[k].to_local(), sd[k].to_local()) for k in sd)
            res[lib] = {"save_s": save_s, "load_s": load_s, "written": w1 - w0, "read": r2 - r1, "ok": ok}
        res["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        q.put((rank, res))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        q.put((rank, traceback.format_exc()))


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256, help="unique fp32 bytes in the state dict")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="hdcp-cmp-", dir=args.dir)
    store = tempfile.mktemp(prefix="hdcp-cmp-store-")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, store, root, args.mib, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, res = q.get(timeout=1800)
        if isinstance(res, str):
            sys.exit(f"rank {rank} failed:\n{res}")
        out[rank] = res
    for p in procs:
        p.join()
    unique = args.mib << 20
    os.sync()  # the floor must not pay for the benchmark's own pending writeback
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={root}/dd.bin", "bs=4M", f"count={unique >> 22}", "conv=fsync"],
                   check=True, capture_output=True)
    dd_s = time.perf_counter() - t
    print(f"{args.ranks} ranks, HSDP (2,{args.ranks // 2}) [Replicate, Shard(0)], {args.mib} MiB unique fp32; "
          f"floor: dd of {args.mib} MiB with fsync {dd_s:.2f}s")
    print(f"{'':10} {'save s':>8} {'load s':>8} {'written/unique':>15} {'read/unique':>12} {'size/unique':>12} "
          f"{'bit-exact':>9}")
    rows = {}
    for lib in ("torch", "hyperdcp"):
        save_s = max(o[lib]["save_s"] for o in out.values())
        load_s = max(o[lib]["load_s"] for o in out.values())
        w = sum(o[lib]["written"] for o in out.values())
        r = sum(o[lib]["read"] for o in out.values())
        size = _du(os.path.join(root, lib))
        ok = all(o[lib]["ok"] for o in out.values())
        rows[lib] = (save_s, load_s)
        print(f"{lib:10} {save_s:8.2f} {load_s:8.2f} {w / unique:15.3f} {r / unique:12.3f} {size / unique:12.4f} "
              f"{str(ok):>9}")
    print("peak RSS per rank (both libraries in one process): "
          f"{max(o['maxrss_kib'] for o in out.values()) / 1024:.0f} MiB")
    print(f"ratios torch/hyperdcp: save {rows['torch'][0] / rows['hyperdcp'][0]:.2f}x, load "
          f"{rows['torch'][1] / rows['hyperdcp'][1]:.2f}x; "
          f"hyperdcp save / dd floor {rows['hyperdcp'][0] / dd_s:.2f}x")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
