"""Loading a torch-written checkpoint: torch's ``dcp.load`` vs ``hyperdcp.load(source="torch-dcp")``, and the
conversion ``torch_dcp_to_hyperdcp`` vs ``dd``.

A third row per case, ``converted``, loads the same state converted to hyperdcp's own format (reference).

N local CPU ranks (gloo) save one HSDP state (``--tensors`` float32 matrices, ``--mib`` MiB, mesh (R, S)
[Replicate, Shard(0)]) with ``dcp.save``; then both libraries load that same checkpoint (a) in the same
layout and (b) as 1-D [Shard(1)] over all ranks, with a cold page cache (bench/load.py's drop_caches:
``drop_caches`` where permitted, else posix_fadvise DONTNEED on the files). Reported per load: read
amplification (bytes read summed over ranks / unique tensor bytes; /proc/self/io ``rchar``, and
hyperdcp's own count), wall time (slowest rank, median of ``--repeat``, the libraries taking turns).
Every load is checked element-exact. Then, in one process: the conversion to hyperdcp (cold cache,
fsync'd) against ``dd bs=8M conv=fsync`` of the same data files into the same file system, and the
conversion's peak RSS growth.

    python bench/load_torch_dcp.py --ranks 8 --mesh 4 2 --mib 1024
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from load import _check, _io, _state, add_experiment_args, drop_caches, set_rows  # noqa: E402


def _rank(rank, world, args, root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import hyperdcp

    R, S = args.mesh
    shapes = [(args.rows, args.cols)] * args.tensors
    hsdp = init_device_mesh("cpu", (R, S))
    flat = init_device_mesh("cpu", (world,))
    tp, hp = os.path.join(root, "torch"), os.path.join(root, "converted")
    dcp.save(_state(hsdp, [Replicate(), Shard(0)], shapes, fill=True), checkpoint_id=tp)
    dist.barrier()
    if rank == 0:  # the same checkpoint in hyperdcp's own format, for reference
        from hyperdcp.tools.convert_torch_dcp import torch_dcp_to_hyperdcp

        torch_dcp_to_hyperdcp(tp, hp)
    dist.barrier()
    cases = {"a_same_layout": (hsdp, [Replicate(), Shard(0)]), "b_1d_shard1": (flat, [Shard(1)])}
    libs = ["hyperdcp", "torch", "converted"] + (["converted-noverify"] if args.noverify_row else [])
    order = [(case, lib) for rep in range(args.repeat) for case in cases
             for lib in (libs if rep % 2 == 0 else libs[::-1])]
    results: dict = {}
    for case, lib in order:
        mesh, placements = cases[case]
        state = _state(mesh, placements, shapes, fill=False)
        dist.barrier()
        method = drop_caches([tp, hp]) if rank == 0 else ""
        dist.barrier()
        io0 = _io()
        t0 = time.perf_counter()
        counted = None
        if lib == "hyperdcp":
            counted = hyperdcp.load(state, tp, source="torch-dcp").bytes_read
        elif lib.startswith("converted"):
            counted = hyperdcp.load(state, hp, verify_checksums=lib == "converted").bytes_read
        else:
            dcp.load(state, checkpoint_id=tp)
        dist.barrier()
        wall = time.perf_counter() - t0
        io1 = _io()
        _check(state, shapes)
        results.setdefault((case, lib), []).append({"seconds": wall, "counted": counted, "cache": method,
                                                    "rchar": io1["rchar"] - io0["rchar"],
                                                    "read_bytes": io1["read_bytes"] - io0["read_bytes"]})
        del state
    return results


def _convert(root: str, repeat: int, check_crc: bool, threads: int) -> list[tuple[float, float, int, int]]:
    """(convert s, dd s, bytes, RSS growth) per run, each from a cold cache into a fresh directory."""
    from hyperdcp.tools.convert_torch_dcp import torch_dcp_to_hyperdcp

    src = os.path.join(root, "torch")
    files = sorted(n for n in os.listdir(src) if n.endswith(".distcp"))
    total = sum(os.path.getsize(os.path.join(src, n)) for n in files)
    out = []
    for i in range(repeat):
        dst, dd_dir = os.path.join(root, f"conv{i}"), os.path.join(root, f"dd{i}")
        drop_caches([src])
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.perf_counter()
        torch_dcp_to_hyperdcp(src, dst, check_crc=check_crc, threads=threads)
        conv = time.perf_counter() - t
        grow = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
        os.makedirs(dd_dir)
        drop_caches([src])
        t = time.perf_counter()
        for n in files:
            subprocess.run(["dd", f"if={os.path.join(src, n)}", f"of={os.path.join(dd_dir, n)}", "bs=8M", "conv=fsync",
                            "status=none"], check=True)
        out.append((conv, time.perf_counter() - t, total, grow))
        shutil.rmtree(dst)
        shutil.rmtree(dd_dir)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_experiment_args(ap)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--convert-threads", type=int, default=4)
    ap.add_argument("--noverify-row", action="store_true",
                    help="also load the converted checkpoint with verify_checksums=False")
    args = ap.parse_args()
    set_rows(args)
    root = tempfile.mkdtemp(prefix="hyperdcp-bench-", dir=args.dir)
    sys.path.insert(0, os.path.join(HERE, ".."))
    from tests.dist import run_ranks

    try:
        res = run_ranks(args.ranks, _rank, args, root, timeout=args.timeout)
        unique = args.tensors * args.rows * args.cols * 4
        print(f"{args.ranks} ranks, torch dcp.save of HSDP mesh {tuple(args.mesh)}: {args.tensors} x ({args.rows}, "
              f"{args.cols}) float32 = {unique / 2**20:.0f} MiB unique; cache: "
              f"{res[0][next(iter(res[0]))][0]['cache']}")
        print(f"{'case':<16}{'library':<10}{'ampl(counted)':>14}{'ampl(rchar)':>12}{'ampl(disk)':>11}{'wall s':>8}"
              "   wall s of each run")
        walls = {}
        for key in res[0]:
            case, lib = key
            first = [r[key][0] for r in res]
            counted = sum(x["counted"] for x in first) / unique if first[0]["counted"] is not None else float("nan")
            rchar = sum(x["rchar"] for x in first) / unique
            disk = sum(x["read_bytes"] for x in first) / unique
            each = [max(r[key][i]["seconds"] for r in res) for i in range(args.repeat)]
            walls[key] = statistics.median(each)
            print(f"{case:<16}{lib:<10}{counted:>14.3f}{rchar:>12.3f}{disk:>11.3f}{walls[key]:>8.2f}   "
                  + " ".join(f"{w:.2f}" for w in each))
        for case in dict.fromkeys(k[0] for k in res[0]):
            print(f"{case}: wall time hyperdcp(source=torch-dcp)/torch = "
                  f"{walls[(case, 'hyperdcp')] / walls[(case, 'torch')]:.3f}; hyperdcp on the converted checkpoint"
                  f"/torch = {walls[(case, 'converted')] / walls[(case, 'torch')]:.3f}")
        for crc in (True, False):
            _report_convert(_convert(root, args.repeat, crc, args.convert_threads), crc, args.convert_threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _report_convert(runs: list, crc: bool, threads: int) -> None:
    conv, dd = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    total = runs[0][2]
    print(f"convert torch-dcp-to-hyperdcp ({threads} threads, CRC-32 {'checked' if crc else 'not checked'}): "
          f"{total / 2**20:.0f} MiB in {conv:.2f} s ({total / conv / 1e9:.2f} GB/s); "
          f"dd bs=8M conv=fsync: {dd:.2f} s ({total / dd / 1e9:.2f} GB/s); throughput vs dd {dd / conv:.2f}x; "
          f"peak RSS growth {max(r[3] for r in runs) / 2**20:.0f} MiB; runs (convert/dd s) "
          + ", ".join(f"{c:.2f}/{d:.2f}" for c, d, _, _ in runs))


if __name__ == "__main__":
    main()
