"""Global save planning at scale, simulated in one process (no real ranks).

Layout: HSDP + TP on a (R, S, T) mesh of W = R*S*T ranks. Weights are [Replicate, Shard(0), Shard(1)]
(row-sharded by FSDP, column-sharded by TP), norms and biases [Replicate, Shard(0), Replicate].
Every rank's local plan is built as it would be on that rank, serialised as it would travel to rank 0,
and then timed: decoding all W plans + global planning (validation, dedup, balanced writers) +
building and encoding the metadata. torch.distributed.checkpoint's global plan step
(DefaultSavePlanner.create_global_plan) runs on the same layout in the same process.

    python bench/planner_scale.py --mesh 8 256 8 --tensors 100          # 16,384 ranks, 1.6 M entries
    python bench/planner_scale.py --mesh 2 4 2 --tensors 100 --no-torch  # quick
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from hyperdcp.core import wire  # noqa: E402
from hyperdcp.options import SaveOptions  # noqa: E402
from hyperdcp.planning.save_plan import LocalPlan, TensorSpec, plan_global  # noqa: E402
from hyperdcp.saving import build_metadata  # noqa: E402


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk-style split of n into parts: (offset, length) of part i (may be empty)."""
    size = -(-n // parts)
    lo = min(i * size, n)
    return lo, min(size, n - lo)


def layout(R: int, S: int, T: int, ntensors: int, hidden: int):
    """Tensor specs and, per rank, its boxes. Returns (specs, per-rank (tidx, offsets, lengths))."""
    specs, kinds = [], []
    for i in range(ntensors):
        if i % 4 == 3:
            specs.append(TensorSpec(f"layers.{i // 4}.norm.weight", "F32", (hidden,)))
            kinds.append("norm")
        else:
            specs.append(TensorSpec(f"layers.{i // 4}.w{i % 4}.weight", "BF16", (hidden * (1 + i % 2), hidden)))
            kinds.append("mat")
    specs_sorted = sorted(range(ntensors), key=lambda i: specs[i].fqn)
    specs = [specs[i] for i in specs_sorted]
    kinds = [kinds[i] for i in specs_sorted]
    W = R * S * T
    D = 2
    per_rank = []
    for rank in range(W):
        r, rem = divmod(rank, S * T)
        s, t = divmod(rem, T)
        tidx, offs, lens = [], [], []
        for k, (spec, kind) in enumerate(zip(specs, kinds)):
            if kind == "mat":
                o0, l0 = split(spec.shape[0], S, s)
                o1, l1 = split(spec.shape[1], T, t)
                box = ((o0, o1), (l0, l1))
            else:
                o0, l0 = split(spec.shape[0], S, s)
                box = ((o0, 0), (l0, 1))
            if np.prod(box[1]) == 0:
                continue
            tidx.append(k)
            offs.append(box[0])
            lens.append(box[1])
        per_rank.append((np.array(tidx), np.array(offs).reshape(-1, D), np.array(lens).reshape(-1, D)))
    return specs, kinds, per_rank


def bench_hyperdcp(specs, per_rank, W):
    raw = [LocalPlan(specs, ["step"], *p).to_bytes() for p in per_rank]
    gc.collect()
    t0 = time.perf_counter()
    tables: dict = {}
    plans = [LocalPlan.from_bytes(b, tables) for b in raw]
    t1 = time.perf_counter()
    gp = plan_global(plans)
    t2 = time.perf_counter()
    # simulated write results (what each writer would report back), then metadata
    results = []
    for r in range(W):
        n = len(gp.assignments[r])
        results.append(wire.pack({"files": [[f"r{r:05d}-00.safetensors", 1 << 40]], "checksums": ["0" * 16] * n},
                                 {"file": np.zeros(n, np.int64), "begin": np.arange(n, dtype=np.int64) * 16,
                                  "end": np.arange(1, n + 1, dtype=np.int64) * 16}))
    t3 = time.perf_counter()
    meta = build_metadata(gp, results, {"step": 1}, SaveOptions())
    record, index = meta.encode("hyperdcp-index-0123456789ab.safetensors")  # format 2 at >= 1024 chunks
    blob = record + (index or b"")
    t4 = time.perf_counter()
    nb = gp.bytes_per_rank
    writers = nb[nb > 0]
    return {
        "entries": int(sum(len(p[0]) for p in per_rank)),
        "unique_chunks": int(len(gp.u_writer)),
        "decode_s": t1 - t0,
        "plan_s": t2 - t1,
        "metadata_s": t4 - t3,
        "metadata_bytes": len(blob),
        "max_over_mean_writer": float(nb.max() / nb.mean()) if nb.mean() else 0.0,
        "writing_ranks": int(len(writers)),
    }


def bench_torch(specs, kinds, per_rank, W, repeat: int = 1):
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props = {s.fqn: TensorProperties(dtype=torch.bfloat16 if s.dtype == "BF16" else torch.float32) for s in specs}
    plans = []
    for tidx, offs, lens in per_rank:
        items = []
        for k, o, ln in zip(tidx.tolist(), offs.tolist(), lens.tolist()):
            s = specs[k]
            nd = len(s.shape)
            items.append(WriteItem(
                index=MetadataIndex(s.fqn, torch.Size(o[:nd])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(o[:nd]), sizes=torch.Size(ln[:nd])),
                    properties=props[s.fqn],
                    size=torch.Size(s.shape),
                ),
            ))
        plans.append(SavePlan(items, planner_data={}))
    times = []
    for _ in range(repeat):
        planner = DefaultSavePlanner()
        gc.collect()
        t0 = time.perf_counter()
        planner.create_global_plan(plans)
        times.append(time.perf_counter() - t0)
    return {"plan_s": float(np.median(times)), "all": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", type=int, nargs=3, default=[8, 256, 8], metavar=("R", "S", "T"))
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed.checkpoint")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each planner; medians are compared")
    args = ap.parse_args()
    R, S, T = args.mesh
    W = R * S * T
    specs, kinds, per_rank = layout(R, S, T, args.tensors, args.hidden)
    print(f"layout: HSDP+TP mesh ({R},{S},{T}) = {W} ranks, {args.tensors} tensors")
    runs = [bench_hyperdcp(specs, per_rank, W) for _ in range(args.repeat)]
    h = {k: float(np.median([r[k] for r in runs])) if isinstance(runs[0][k], float) else runs[0][k] for k in runs[0]}
    h["plan_all"] = [round(r["decode_s"] + r["plan_s"], 3) for r in runs]
    print(f"  chunk entries (rank x box): {h['entries']:,}; unique chunks: {h['unique_chunks']:,}; "
          f"medians of {args.repeat} runs (hyperdcp decode+plan runs: {h['plan_all']})")
    print(f"hyperdcp: decode {h['decode_s']:.3f}s + global plan {h['plan_s']:.3f}s = "
          f"{h['decode_s'] + h['plan_s']:.3f}s;"
          f" metadata build+encode {h['metadata_s']:.3f}s, {h['metadata_bytes'] / 1e6:.1f} MB;"
          f" largest writer / mean writer = {h['max_over_mean_writer']:.3f} over {h['writing_ranks']} writing ranks")
    if not args.no_torch:
        t = bench_torch(specs, kinds, per_rank, W, args.repeat)
        ours = h["decode_s"] + h["plan_s"]
        print(f"torch.distributed.checkpoint create_global_plan: {t['plan_s']:.3f}s (runs: "
              f"{[round(x, 3) for x in t['all']]})")
        print(f"ratio torch / hyperdcp (global planning): {t['plan_s'] / ours:.1f}x")
        print(f"ratio torch / hyperdcp (planning + metadata): {t['plan_s'] / (ours + h['metadata_s']):.1f}x")


if __name__ == "__main__":
    main()
