"""The read-once planning step at scale, simulated in one process (no ranks are started).

A checkpoint saved as HSDP on an (R, S) mesh [Replicate, Shard(0)] (``--tensors`` matrices, each stored
as S row chunks in S files) is loaded in the same layout by R*S ranks. This times what every rank does
before reading: deriving every rank's plan from the grid layouts (``derive_plans``; with mismatching
layouts the plans are exchanged and decoded instead) and building the global schedule
(``build_schedule``: units, readers balanced by bytes, batches), and reports the process's peak RSS.

    python bench/read_once_scale.py --mesh 8 128 --tensors 100      # 1,024 ranks
    python bench/read_once_scale.py --mesh 8 2048 --tensors 100     # 16,384 ranks
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hyperdcp.core.layout import REPLICATE, GridLayout  # noqa: E402
from hyperdcp.core.shards import ShardedTensor  # noqa: E402
from hyperdcp.format.metadata import ChunkTable, FileMeta, Metadata, TensorMeta  # noqa: E402
from hyperdcp.planning import read_once as exchange  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", type=int, nargs=2, default=(8, 128), help="replicas R, shards S")
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--rows-per-shard", type=int, default=8)
    ap.add_argument("--cols", type=int, default=1024)
    args = ap.parse_args()
    R, S = args.mesh
    W, T = R * S, args.tensors
    rows, cols, per = args.rows_per_shard * S, args.cols, args.rows_per_shard
    nb = per * cols * 4
    tensors = {}
    for t in range(T):
        offs = np.zeros((S, 2), np.int64)
        offs[:, 0] = np.arange(S) * per
        lens = np.tile(np.array([per, cols], np.int64), (S, 1))
        begin = np.full(S, 64 + t * nb, np.int64)
        tensors[f"layer{t}.weight"] = TensorMeta(
            "F32", (rows, cols), ChunkTable(offs, lens, np.arange(S, dtype=np.int64), begin, begin + nb, ["0" * 16] * S))
    meta = Metadata(W, [FileMeta(f"f{i}.safetensors", 64 + T * nb) for i in range(S)], tensors, {})
    mesh = np.arange(W).reshape(R, S)
    key = GridLayout.digest_mesh(mesh)
    sts = [ShardedTensor(n, "F32", (rows, cols), [], layout=GridLayout(mesh, (REPLICATE, 0), key)) for n in tensors]
    t0 = time.perf_counter()
    plans = exchange.derive_plans(meta, sts, W)
    t1 = time.perf_counter()
    sched = exchange.build_schedule(meta, plans, True, 256 << 20)
    t2 = time.perf_counter()
    pieces = sum(map(len, plans))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{W} ranks (mesh {R}x{S}), {T} tensors, {pieces:,} pieces, {len(sched.units):,} units, "
          f"{len(sched.batches)} batches: derive {t1 - t0:.2f} s, schedule {t2 - t1:.2f} s, "
          f"peak RSS {rss:.0f} MiB (per rank, every rank does this)")
    loads = np.asarray(sched.read_bytes, dtype=np.float64)
    print(f"bytes read per rank: max/mean {loads.max() / loads.mean():.4f}")


if __name__ == "__main__":
    main()
