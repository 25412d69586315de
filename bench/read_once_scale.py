"""The read-once planning step at scale, simulated in one process (no ranks are started).

A checkpoint saved as HSDP on an (R, S) mesh [Replicate, Shard(0)] (``--tensors`` matrices, each stored
as S row chunks in S files) is loaded in the same layout by R*S ranks, 8 ranks to a host. This times
what one rank does before reading (every rank does the same): checking that the grid layouts
reproduce its own plan (``layout_digest``), finding who needs the chunks its host needs
(``grid_wants``) and building its host's part of the schedule (``local_schedule``: units, readers,
batches), and reports the process's peak RSS. ``--global`` times the old way instead: deriving every
rank's plan and building the global schedule (``derive_plans`` + ``build_schedule``). Times are CPU
seconds of the process (``time.process_time``), which a shared machine inflates less than wall time.

    python bench/read_once_scale.py --mesh 8 2048 --tensors 100          # 16,384 ranks, one line
    python bench/read_once_scale.py --ranks 1024 4096 16384 65536 --tensors 100 1000   # a table
    python bench/read_once_scale.py --mesh 8 128 --balance               # also max/mean bytes read
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hyperdcp.core.layout import REPLICATE, GridLayout  # noqa: E402
from hyperdcp.core.shards import ShardedTensor  # noqa: E402
from hyperdcp.format.metadata import ChunkTable, FileMeta, Metadata, TensorMeta  # noqa: E402
from hyperdcp.planning import read_once as exchange  # noqa: E402
from hyperdcp.planning.read_once_local import local_schedule  # noqa: E402
from hyperdcp.planning.read_once_wants import grid_wants, own_plan, plan_wants  # noqa: E402

HOST = 8  # ranks per host


def setup(R: int, S: int, T: int, per: int, cols: int):
    W, rows, nb = R * S, per * S, per * cols * 4
    tensors = {}
    for t in range(T):
        offs = np.zeros((S, 2), np.int64)
        offs[:, 0] = np.arange(S) * per
        lens = np.tile(np.array([per, cols], np.int64), (S, 1))
        begin = np.full(S, 64 + t * nb, np.int64)
        tensors[f"layer{t}.weight"] = TensorMeta(
            "F32", (rows, cols),
            ChunkTable(offs, lens, np.arange(S, dtype=np.int64), begin, begin + nb, ["0" * 16] * S))
    meta = Metadata(W, [FileMeta(f"f{i}.safetensors", 64 + T * nb) for i in range(S)], tensors, {})
    mesh = np.arange(W).reshape(R, S)
    key = GridLayout.digest_mesh(mesh)
    sts = [ShardedTensor(n, "F32", (rows, cols), [], layout=GridLayout(mesh, (REPLICATE, 0), key)) for n in tensors]
    return meta, sts


def plan_one(meta, sts, W: int, me: int) -> tuple[float, int, int, int]:
    """(seconds, units, batches, bytes read) of rank ``me``'s planning."""
    t0 = time.process_time()
    own = own_plan(meta, sts, me)  # what layout_digest checks against the rank's own pieces
    host = range(me - me % HOST, min(W, me - me % HOST + HOST))
    wants = grid_wants(meta, sts, W, host, {(ti, ci, b): e for e, (ti, ci, b) in enumerate(own)}, me)
    sched = local_schedule(meta, wants, True, 256 << 20, me)
    return time.process_time() - t0, len(sched.units), len(sched.batches), sched.read_bytes[me]


def one(R: int, S: int, T: int, args) -> dict:
    meta, sts = setup(R, S, T, args.rows_per_shard, args.cols)
    W = R * S
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"ranks": W, "tensors": T, "setup_rss": rss0}
    if args.global_:
        t0 = time.process_time()
        plans = exchange.derive_plans(meta, sts, W)
        sched = exchange.build_schedule(meta, plans, True, 256 << 20)
        out.update(seconds=time.process_time() - t0, units=len(sched.units), batches=len(sched.batches))
    else:
        me = W // 2 + 3  # a rank in the middle (all do the same)
        out["seconds"], out["units"], out["batches"], _ = plan_one(meta, sts, W, me)
        out["seconds"] = min(out["seconds"], plan_one(meta, sts, W, me)[0])  # warm (imports, caches)
    out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.balance:  # every rank's bytes read, from the global schedule by the same rules
        ref = local_schedule(meta, plan_wants(meta, exchange.derive_plans(meta, sts, W)), True, 256 << 20)
        loads = np.asarray(ref.read_bytes, dtype=np.float64)
        out["balance"] = float(loads.max() / loads.mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", type=int, nargs=2, default=None, help="replicas R, shards S (one run, one line)")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="world sizes (mesh 8 x W/8), a table")
    ap.add_argument("--tensors", type=int, nargs="+", default=[100])
    ap.add_argument("--rows-per-shard", type=int, default=8)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--global", dest="global_", action="store_true", help="time the global schedule (old way)")
    ap.add_argument("--balance", action="store_true", help="also max/mean bytes read over all ranks")
    args = ap.parse_args()
    if args.ranks is None:
        R, S = args.mesh or (8, 128)
        r = one(R, S, args.tensors[0], args)
        what = "global schedule" if args.global_ else "local schedule"
        print(f"{r['ranks']} ranks (mesh {R}x{S}), {r['tensors']} tensors, {what}: {r['units']:,} units, "
              f"{r['batches']} batches, {r['seconds']:.3f} s, peak RSS {r['rss']:.0f} MiB "
              f"(checkpoint metadata alone {r['setup_rss']:.0f} MiB; per rank, every rank does this)"
              + (f"; bytes read per rank max/mean {r['balance']:.4f}" if args.balance else ""))
        return
    print("| ranks | tensors | planning per rank | peak RSS (metadata alone) | units | batches |")
    print("|---:|---:|---:|---:|---:|---:|")
    first: dict[int, float] = {}
    for T in args.tensors:
        for W in args.ranks:
            cmd = [sys.executable, __file__, "--mesh", "8", str(W // 8), "--tensors", str(T),
                   "--rows-per-shard", str(args.rows_per_shard), "--cols", str(args.cols)]
            line = subprocess.run(cmd + (["--global"] if args.global_ else []), capture_output=True, text=True,
                                  check=True).stdout
            sec = float(line.split(" batches, ")[1].split(" s,")[0])
            rss = line.split("peak RSS ")[1].split(" MiB")[0]
            meta_rss = line.split("metadata alone ")[1].split(" MiB")[0]
            units = line.split("schedule: ")[1].split(" units")[0]
            batches = line.split(" units, ")[1].split(" batches")[0]
            first.setdefault(T, sec)
            print(f"| {W:,} | {T:,} | {sec:.3f} s | {rss} MiB ({meta_rss}) | {units} | {batches} |", flush=True)
        print(f"| growth {args.ranks[0]:,} -> {args.ranks[-1]:,} | {T:,} | {sec / first[T]:.2f}x | | | |", flush=True)


if __name__ == "__main__":
    main()
