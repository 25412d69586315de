"""Read amplification and cold-cache load time: hyperdcp (read-once) vs torch.distributed.checkpoint.

N local CPU ranks (gloo). The state (``--tensors`` float32 matrices, ``--mib`` MiB in all) is saved as
HSDP on a (R, S) mesh [Replicate, Shard(0)] by both libraries, then loaded (a) in the same layout and
(b) as 1-D [Shard(1)] over all ranks. For every load it reports:

* read amplification: bytes read from storage summed over ranks / the checkpoint's unique bytes,
  counted by hyperdcp's storage layer (``LoadResult.bytes_read``) and cross-checked with
  /proc/self/io (``rchar``: bytes through read syscalls; ``read_bytes``: bytes fetched from the device);
* wall time (slowest rank, between barriers; the median of ``--repeat`` runs, the libraries taking
  turns to go first) with a cold page cache: before each load rank 0 runs
  ``sync; echo 3 > /proc/sys/vm/drop_caches`` where permitted, else evicts the checkpoint's files
  with posix_fadvise(DONTNEED) (the method used is printed);
* extra host memory: the peak of host-wide used memory (MemTotal - MemAvailable, sampled every 2 ms on
  rank 0; shared memory counted once, the page cache not at all) minus its level before the load (the
  destinations are resident before it); and per rank the RSS peak (VmHWM - VmRSS before the load,
  VmHWM reset through /proc/self/clear_refs), which counts every mapped shared page in every rank;
* the physical floors on this machine, measured in the same run: reading the checkpoint's unique bytes
  cold (``--ranks`` x 4 threads of 8 MiB preads over the data files, like a parallel ``dd``), and
  filling the destinations (each rank's bytes memcpy'd into resident memory, one thread per rank); wall
  times are printed as ratios to the larger of the two (the floor if reading and copying overlapped
  perfectly).

Every load is checked element-exact.

    python bench/load.py --ranks 8 --mesh 4 2 --mib 1024
    python bench/load.py --ranks 8 --mesh 4 2 --mib 256 --json out.json
    python bench/load.py --ranks 8 --mesh 4 2 --mib 256 --no-torch --no-shm     # read-once over gloo only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def _io() -> dict[str, int]:
    out = {"rchar": 0, "read_bytes": 0}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, v = line.split(":")
                out[k] = int(v)
    except OSError:  # not every kernel (e.g. gVisor) has it; the counts then read 0
        pass
    return out


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def drop_caches(dirs: list[str]) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    evict_files(dirs)
    return "fadvise"


def evict_files(dirs: list[str]) -> None:
    """Drop just these directories' files from the page cache (posix_fadvise DONTNEED)."""
    for d in dirs:
        for root, _, names in os.walk(d):
            for n in names:
                fd = os.open(os.path.join(root, n), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


class HostMemory:
    """Samples the host's used memory (MemTotal - MemAvailable: anonymous and shared memory, not the page
    cache) every few milliseconds from a thread; ``peak`` - ``base`` is what the load added host-wide."""

    def __init__(self, interval: float = 0.002):
        import threading

        self.interval, self.base, self.peak = interval, self.used(), 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @staticmethod
    def used() -> int:
        vals = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    k, v = line.split(":")
                    vals[k] = int(v.split()[0]) * 1024
        except OSError:
            return 0
        return vals.get("MemTotal", 0) - vals.get("MemAvailable", 0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.used())
        return self.peak - self.base


def _fill(t, box_off, cols_total):
    """Deterministic exact values from global element indices (float32-exact)."""
    import torch

    r0, c0 = box_off
    rows = torch.arange(r0, r0 + t.shape[0], dtype=torch.int64)[:, None]
    cols = torch.arange(c0, c0 + t.shape[1], dtype=torch.int64)[None, :]
    return ((rows * cols_total + cols) % 65521).to(t.dtype)


def _state(mesh, placements, shapes, fill: bool, salt: int = 0):
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for i, shape in enumerate(shapes):
        lshape, off = compute_local_shape_and_global_offset(shape, mesh, placements)
        local = torch.zeros(tuple(lshape), dtype=torch.float32)
        if fill:
            local = _fill(local, tuple(off), shape[1]) + i
        out[f"layer{i}.weight"] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                                    stride=(shape[1], 1))
    return out


def _check(state, shapes):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for i, shape in enumerate(shapes):
        dt = state[f"layer{i}.weight"]
        _, off = compute_local_shape_and_global_offset(shape, dt.device_mesh, dt.placements)
        local = dt.to_local()
        want = _fill(local, tuple(off), shape[1]) + i
        if not bool((local == want).all()):
            raise AssertionError(f"layer{i}.weight differs after load")


def _rank(rank, world, args, root):
    if args.hosts > 1:
        os.environ["HYPERDCP_HOST"] = f"bench-host-{rank % args.hosts}"
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import hyperdcp

    R, S = args.mesh
    shapes = [(args.rows, args.cols)] * args.tensors
    hsdp = init_device_mesh("cpu", (R, S))
    flat = init_device_mesh("cpu", (world,))
    hp, tp = os.path.join(root, "hyperdcp"), os.path.join(root, "torch")
    src = _state(hsdp, [Replicate(), Shard(0)], shapes, fill=True)
    hyperdcp.save(src, hp)
    if not args.no_torch:
        dcp.save(src, checkpoint_id=tp)
    del src
    dist.barrier()
    cases = {"a_same_layout": (hsdp, [Replicate(), Shard(0)]), "b_1d_shard1": (flat, [Shard(1)])}
    libs = ["hyperdcp"] + ([] if args.no_torch else ["torch"])
    results = {}
    # the libraries take turns going first, so neither always follows the save or the other case
    order = [(case, lib) for rep in range(args.repeat) for case in cases
             for lib in (libs if rep % 2 == 0 else libs[::-1])]
    for case, lib in order:
        mesh, placements = cases[case]
        state = _state(mesh, placements, shapes, fill=False)
        dist.barrier()
        method = drop_caches([hp, tp]) if rank == 0 else ""
        dist.barrier()
        peak_ok = _reset_peak()
        rss0, io0 = _status_kib("VmRSS"), _io()
        host = HostMemory() if rank == 0 else None
        dist.barrier()
        t0 = time.perf_counter()
        counted = None
        if lib == "hyperdcp":
            counted = hyperdcp.load(state, hp, read_once=not args.no_read_once,
                                    read_once_batch_bytes=args.batch_mib << 20,
                                    read_once_broadcast=not args.no_broadcast).bytes_read
        else:
            dcp.load(state, checkpoint_id=tp)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        host_added = host.stop() if host is not None else 0
        dest = sum(v.to_local().numel() * v.to_local().element_size() for v in state.values())
        io1 = _io()
        peak = (_status_kib("VmHWM") - rss0) * 1024 if peak_ok else -1
        _check(state, shapes)
        results.setdefault((case, lib), []).append({
            "seconds": t1 - t0, "seconds_to_barrier": t2 - t0, "counted": counted,
            "rchar": io1["rchar"] - io0["rchar"], "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "peak_extra": peak, "cache": method, "host_added": host_added, "dest_bytes": dest,
        })
        del state
    return results


def floors(ckpt: str, dest_bytes: list[int], threads_per_rank: int = 4, piece: int = 8 << 20) -> tuple[float, float]:
    """(seconds to read the checkpoint's data files cold in parallel, seconds to fill fresh destinations)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    files = [os.path.join(ckpt, n) for n in sorted(os.listdir(ckpt)) if n.endswith(".safetensors")]
    jobs = [(f, off, min(piece, os.path.getsize(f) - off))
            for f in files for off in range(0, os.path.getsize(f), piece)]
    drop_caches([ckpt])
    nthreads = max(1, len(dest_bytes)) * threads_per_rank
    bufs = [np.empty(piece, dtype=np.uint8) for _ in range(nthreads)]

    def read(i):
        fd = os.open(jobs[i][0], os.O_RDONLY)
        try:
            os.preadv(fd, [memoryview(bufs[i % nthreads])[: jobs[i][2]]], jobs[i][1])
        finally:
            os.close(fd)

    t = time.perf_counter()
    with ThreadPoolExecutor(nthreads) as ex:
        list(ex.map(read, range(len(jobs))))
    disk = time.perf_counter() - t
    src = np.ones(max(dest_bytes), dtype=np.uint8)

    dests = [np.zeros(n, dtype=np.uint8) for n in dest_bytes]
    for d in dests:
        d.fill(0)  # resident, like the benchmark's torch.zeros destinations

    t = time.perf_counter()
    with ThreadPoolExecutor(len(dests)) as ex:
        list(ex.map(lambda d: np.copyto(d, src[: d.size]), dests))
    return disk, time.perf_counter() - t


def add_experiment_args(ap: argparse.ArgumentParser) -> None:
    """The experiment's shape, shared with bench/load_remote.py."""
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--mesh", type=int, nargs=2, default=(4, 2))
    ap.add_argument("--mib", type=int, default=1024, help="total tensor MiB")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--batch-mib", type=int, default=256, help="read_once_batch_bytes in MiB")
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")


def set_rows(args: argparse.Namespace) -> None:
    """Rows per matrix for ``--mib`` in ``--tensors`` float32 matrices, divisible by the shard count."""
    assert args.mesh[0] * args.mesh[1] == args.ranks, "mesh must cover the ranks"
    per = (args.mib << 20) // args.tensors
    args.rows = per // (4 * args.cols)
    args.rows -= args.rows % args.mesh[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_experiment_args(ap)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-read-once", action="store_true")
    ap.add_argument("--no-broadcast", action="store_true",
                    help="replicas on other hosts get their chunks point to point, not by broadcast in mesh groups")
    ap.add_argument("--no-shm", action="store_true",
                    help="read-once transfers over gloo only, also between ranks of one host "
                         "(HYPERDCP_READ_ONCE_SHM=0)")
    ap.add_argument("--hosts", type=int, default=1,
                    help="pretend the ranks sit on this many hosts (HYPERDCP_HOST=rank %% hosts): shared memory "
                         "within, gloo across")
    ap.add_argument("--repeat", type=int, default=3, help="loads per case and library (medians reported)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    set_rows(args)
    root = tempfile.mkdtemp(prefix="hyperdcp-bench-", dir=args.dir)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.dist import run_ranks

    try:
        t = time.perf_counter()
        env = {"HYPERDCP_READ_ONCE_SHM": "0"} if args.no_shm else {}
        res = run_ranks(args.ranks, _rank, args, root, timeout=args.timeout, env=env)
        import hyperdcp

        unique = hyperdcp.read_metadata(os.path.join(root, "hyperdcp")).tensor_bytes
        print(f"{args.ranks} ranks, HSDP mesh {tuple(args.mesh)} save, {args.tensors} x ({args.rows}, {args.cols}) "
              f"float32 = {unique / 2**20:.0f} MiB unique; cache: {res[0][next(iter(res[0]))][0]['cache']}; "
              f"read_once_batch_bytes {args.batch_mib} MiB; transport: "
              f"{'gloo only' if args.no_shm else 'shm within a host, gloo across'}, {args.hosts} host(s); total run "
              f"{time.perf_counter() - t:.0f} s")
        report = {}
        floor = {}
        med = statistics.median
        n = args.repeat
        for case in dict.fromkeys(k[0] for k in res[0]):
            runs = [floors(os.path.join(root, "hyperdcp"), [r[(case, "hyperdcp")][0]["dest_bytes"] for r in res])
                    for _ in range(n)]
            disk, fill = med(d for d, _ in runs), med(f for _, f in runs)
            floor[case] = max(disk, fill)
            report[f"{case}/floor"] = {"disk_s": disk, "fill_s": fill, "runs": runs}
            print(f"floor {case}: cold parallel read of the unique bytes {disk:.2f} s, filling the destinations "
                  f"{fill:.2f} s")
        print(f"{'case':<16}{'library':<10}{'ampl(counted)':>14}{'ampl(rchar)':>12}{'ampl(disk)':>11}"
              f"{'wall s':>8}{'/floor':>8}{'host extra MiB':>16}{'rank RSS peak MiB':>19}   wall s of each run")
        walls = {}
        for key in res[0]:
            case, lib = key
            first = [r[key][0] for r in res]
            counted = sum(x["counted"] for x in first) / unique if first[0]["counted"] is not None else float("nan")
            rchar = sum(x["rchar"] for x in first) / unique
            disk = sum(x["read_bytes"] for x in first) / unique
            each = [max(r[key][i]["seconds_to_barrier"] for r in res) for i in range(n)]
            wall = walls[key] = med(each)
            peak = med(max(r[key][i]["peak_extra"] for r in res) for i in range(n)) / 2**20
            host_extra = med(res[0][key][i]["host_added"] for i in range(n)) / 2**20
            print(f"{case:<16}{lib:<10}{counted:>14.3f}{rchar:>12.3f}{disk:>11.3f}{wall:>8.2f}"
                  f"{wall / floor[case]:>8.2f}"
                  f"{host_extra:>16.0f}{peak:>19.0f}   {' '.join(f'{w:.2f}' for w in each)}")
            if first[0]["counted"] is not None:  # read-once: how evenly the ranks share the reading
                per = [x["counted"] for x in first]
                print(f"{'':<26}bytes read per rank: max/mean {max(per) / (sum(per) / len(per)):.3f} "
                      f"(MiB: {' '.join(f'{x / 2**20:.0f}' for x in per)})")
            report[f"{case}/{lib}"] = {"ampl_counted": counted, "ampl_rchar": rchar, "ampl_disk": disk,
                                       "wall_s": wall, "wall_s_runs": each, "wall_over_floor": wall / floor[case],
                                       "host_extra_mib": host_extra, "rank_rss_peak_mib": peak,
                                       "per_rank": [r[key] for r in res]}
        for case in floor:
            if not args.no_torch:
                print(f"{case}: wall time hyperdcp/torch = {walls[(case, 'hyperdcp')] / walls[(case, 'torch')]:.3f} "
                      f"(medians of {n} runs)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
