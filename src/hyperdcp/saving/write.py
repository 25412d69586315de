"""Writing one rank's share of a save: its assigned chunks, as safetensors data files, through a SaveFiles.

Call order (every writing rank, after the committer staged the save)::

    files = storage.writer_at(location)              # or the committer's SaveStaging itself
    result = write_assigned(files, rank, staged, assignment, opts, token, per_rank)
    -> result travels to the committer, which joins every rank's into the metadata (flow.build_metadata)

No ``os`` calls here: every byte goes through :meth:`SaveFiles.create` writers, durable once closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..coordination import wire  # core/wire.py once it exists (P3)
from ..format.checksums import block_digests
from ..format.safetensors import ChunkToWrite, build_header, chunk_name, data_file_name
from ..options import SaveOptions
from ..storage.base import SaveFiles
from ..storage.threads import run_all
from .stage import StagedState


@dataclass
class WrittenFile:
    """One data file as written: its size, and each chunk's absolute byte range and block checksums."""

    name: str
    nbytes: int
    begin: list[int]  # absolute offsets in the file, per chunk
    end: list[int]
    checksums: list[str]


def write_data_file(files: SaveFiles, name: str, chunks: Sequence[ChunkToWrite], block_bytes: int) -> WrittenFile:
    """Write, checksum and make durable one data file; checksums are computed from the bytes as written."""
    header, starts = build_header(chunks)
    sums = []
    with files.create(name, "data file") as w:
        w.write_borrowed(header)
        for c in chunks:
            mv = memoryview(c.data).cast("B")
            sums.append(block_digests(mv, block_bytes))
            w.write_borrowed(mv)  # the staged chunks stay as they are until this file is closed
    h = len(header)
    begin = [h + s for s in starts]
    end = [b + c.data.size for b, c in zip(begin, chunks)]
    total = h + sum(c.data.size for c in chunks)
    return WrittenFile(name, total, begin, end, sums)


def write_assigned(files: SaveFiles, rank: int, staged: StagedState, assignment: np.ndarray, opts: SaveOptions,
                   token: str = "", per_rank: dict[str, np.ndarray] | None = None) -> bytes:
    """Write this rank's assigned chunks into 1..files_per_rank data files in ``files``; return the result message.

    ``token`` (unique per save, the same on every rank) goes into the file names: see data_file_name.
    A chunk of a tensor in ``per_rank`` (fqn -> holders) is written as this rank's row of the stacked
    tensor (see :func:`~hyperdcp.planning.save_plan.plan_global`)."""
    todo = [staged.chunks[i] for i in assignment.tolist()]
    if not todo:
        empty = np.zeros(0, np.int64)
        return wire.pack({"files": [], "checksums": []}, {"file": empty, "begin": empty, "end": empty})
    sizes = np.array([sh.data.size for _, sh in todo], dtype=np.int64)
    nfiles = max(1, min(opts.files_per_rank, len(todo)))
    cut = np.searchsorted(np.cumsum(sizes), np.arange(1, nfiles) * sizes.sum() / nfiles)
    groups = [g for g in np.split(np.arange(len(todo)), cut) if len(g)]
    jobs = []
    for fi, g in enumerate(groups):
        name = data_file_name(rank, fi, token)
        chunks = []
        for i in g.tolist():
            st, sh = todo[i]
            holders = per_rank.get(st.fqn) if per_rank else None
            if holders is not None:
                row = int(np.searchsorted(holders, rank))
                chunks.append(ChunkToWrite(chunk_name(st.fqn, (row,) + tuple(sh.box.offsets), False), st.dtype,
                                           (1,) + tuple(sh.box.lengths), sh.data))
                continue
            whole = sh.box.lengths == tuple(st.shape)
            chunks.append(ChunkToWrite(chunk_name(st.fqn, sh.box.offsets, whole), st.dtype, sh.box.lengths, sh.data))
        jobs.append((name, chunks))
    written = run_all(lambda j: write_data_file(files, j[0], j[1], opts.checksum_block_bytes), jobs, len(jobs))
    fidx = np.concatenate([np.full(len(g), fi, np.int64) for fi, g in enumerate(groups)])
    begin = np.concatenate([np.array(w.begin, np.int64) for w in written])
    end = np.concatenate([np.array(w.end, np.int64) for w in written])
    order = np.concatenate(groups)
    inv = np.empty(len(order), np.int64)
    inv[order] = np.arange(len(order))
    sums = [s for w in written for s in w.checksums]
    return wire.pack(
        {"files": [[w.name, w.nbytes] for w in written], "checksums": [sums[i] for i in inv.tolist()]},
        {"file": fidx[inv], "begin": begin[inv], "end": end[inv]},
    )

