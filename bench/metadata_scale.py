"""Checkpoint metadata at scale: format 2 (JSON record + binary chunk index) against torch's pickled .metadata.

Two layouts of bench/planner_scale.py (HSDP + TP, simulated in one process):

* ``--mesh 2 2 2 --tensors 100000 --hidden 256``: 8 ranks x 100,000 tensors, 350,000 chunks;
* ``--mesh 8 256 8 --tensors 100``: 16,384 ranks x 100 tensors, 160,000 chunks.

Per layout: the global plan and simulated write results (untimed), then, timed, rank 0's metadata
build + encode (``build_metadata`` + ``Metadata.encode``: record and index bytes) and every rank's decode
+ strict validation (``Metadata.from_json`` with the index). torch.distributed.checkpoint's ``Metadata``
of the same structure (one ``ChunkStorageMetadata`` and one ``_StorageInfo`` per chunk) is built and
``pickle.dumps``/``pickle.loads``-ed in the same run: that is what torch's ``.metadata`` file holds.

    python bench/metadata_scale.py                 # both layouts
    python bench/metadata_scale.py --only 100k --json   # one layout, plus the format-1 JSON record
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hyperdcp.core import wire  # noqa: E402
from hyperdcp.format.metadata import Metadata  # noqa: E402
from hyperdcp.options import SaveOptions  # noqa: E402
from hyperdcp.planning.save_plan import LocalPlan, plan_global  # noqa: E402
from hyperdcp.saving import build_metadata  # noqa: E402
from planner_scale import layout  # noqa: E402

LAYOUTS = {"100k": ((2, 2, 2), 100_000, 256), "16k-ranks": ((8, 256, 8), 100, 8192)}
INDEX = "hyperdcp-index-0123456789ab.safetensors"


def plan_and_results(mesh, ntensors, hidden):
    R, S, T = mesh
    W = R * S * T
    specs, _, per_rank = layout(R, S, T, ntensors, hidden)
    gp = plan_global([LocalPlan(specs, ["step"], *p) for p in per_rank])
    size = {"BF16": 2, "F32": 4}
    isz = np.array([size[s.dtype] for s in specs], np.int64)
    results = []
    rng = np.random.default_rng(0)
    order = np.lexsort((gp.u_slot, gp.u_writer))  # unique chunks by writer, in assignment order
    cuts = np.searchsorted(gp.u_writer[order], np.arange(W + 1))
    for r in range(W):
        u = order[cuts[r]:cuts[r + 1]]
        nb = gp.u_lengths[u].prod(axis=1) * isz[gp.u_tidx[u]]
        end = np.cumsum(nb) + 4096
        sums = ["%016x" % x for x in rng.integers(0, 2**63, len(u)).tolist()]
        results.append(wire.pack({"files": [[f"r{r:05d}-0123456789ab-00.safetensors",
                                             int(end[-1]) if len(end) else 4096]],
                                  "checksums": sums},
                                 {"file": np.zeros(len(u), np.int64), "begin": end - nb, "end": end}))
    return specs, gp, results


def torch_metadata(meta: Metadata):
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.metadata import Metadata as TorchMetadata

    tdt = {"BF16": torch.bfloat16, "F32": torch.float32}
    ix = meta.chunk_index()
    sdm, storage = {}, {}
    for t, name in enumerate(ix.names):
        a, b, nd = int(ix.first[t]), int(ix.first[t + 1]), int(ix.ndim[t])
        offs, lens = ix.offsets[a:b, :nd].tolist(), ix.lengths[a:b, :nd].tolist()
        chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in zip(offs, lens)]
        sdm[name] = TensorStorageMetadata(TensorProperties(dtype=tdt[ix.dtype_names[int(ix.dtype[t])]]),
                                          torch.Size(ix.shape[t, :nd].tolist()), chunks)
        for k, (o, i) in enumerate(zip(offs, range(a, b))):
            storage[MetadataIndex(name, torch.Size(o), k)] = _StorageInfo(
                meta.files[int(ix.file[i])].name, int(ix.begin[i]), int(ix.end[i] - ix.begin[i]))
    return TorchMetadata(state_dict_metadata=sdm, storage_data=storage)


def clocks() -> np.ndarray:
    """(wall, CPU) seconds: on a shared machine the CPU time is what the step costs on an idle core."""
    return np.array([time.perf_counter(), time.process_time()])


def fmt(t: np.ndarray) -> str:
    return f"{t[0]:.3f}s wall / {t[1]:.3f}s CPU"


def run(name: str, with_json: bool, with_torch: bool, repeat: int) -> None:
    mesh, ntensors, hidden = LAYOUTS[name]
    t0 = time.perf_counter()
    specs, gp, results = plan_and_results(mesh, ntensors, hidden)
    W = int(np.prod(mesh))
    print(f"{name}: mesh {tuple(mesh)} = {W:,} ranks, {ntensors:,} tensors, {len(gp.u_writer):,} chunks "
          f"(setup {time.perf_counter() - t0:.1f}s)")
    enc, dec = [], []
    for _ in range(repeat):
        gc.collect()
        t0 = clocks()
        meta = build_metadata(gp, results, {"step": 1}, SaveOptions())
        record, index = meta.encode(INDEX)
        t1 = clocks()
        got = Metadata.from_json(record, "bench/hyperdcp.json", index=index)
        t2 = clocks()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    assert index is not None and got.num_chunks == len(gp.u_writer)
    e, d = np.median(enc, axis=0), np.median(dec, axis=0)
    print(f"  hyperdcp format 2: build+encode {e[0]:.3f}s wall / {e[1]:.3f}s CPU, decode+validate {d[0]:.3f}s wall / "
          f"{d[1]:.3f}s CPU (medians of {repeat}); record {len(record) / 1e6:.2f} MB + index {len(index) / 1e6:.2f} MB "
          f"= {(len(record) + len(index)) / 1e6:.2f} MB")
    if with_json:
        t0 = clocks()
        raw = meta.to_json()
        t1 = clocks()
        Metadata.from_json(raw, "bench/hyperdcp.json")
        t2 = clocks()
        print(f"  hyperdcp format 1 (all JSON): encode {fmt(t1 - t0)}, decode+validate {fmt(t2 - t1)}, "
              f"{len(raw) / 1e6:.2f} MB")
    if with_torch:
        t0 = clocks()
        tm = torch_metadata(got)
        t1 = clocks()
        blob = pickle.dumps(tm, protocol=pickle.HIGHEST_PROTOCOL)
        t2 = clocks()
        pickle.loads(blob)
        t3 = clocks()
        print(f"  torch .metadata (pickle): build {fmt(t1 - t0)}, dumps {fmt(t2 - t1)}, loads {fmt(t3 - t2)}, "
              f"{len(blob) / 1e6:.2f} MB")
        lo, bd = t3 - t2, t2 - t0
        print(f"  ratio torch loads / hyperdcp decode+validate: {lo[0] / d[0]:.0f}x wall, {lo[1] / d[1]:.0f}x CPU; "
              f"torch build+dumps / hyperdcp build+encode: {bd[0] / e[0]:.0f}x wall, {bd[1] / e[1]:.0f}x CPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(LAYOUTS), help="run one layout")
    ap.add_argument("--json", action="store_true", help="also time the format-1 (all-JSON) record")
    ap.add_argument("--no-torch", action="store_true", help="skip torch's pickled Metadata")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for name in [args.only] if args.only else list(LAYOUTS):
        run(name, args.json, not args.no_torch, args.repeat)


if __name__ == "__main__":
    main()
