"""Offline verification of any source: every checksum of every chunk, read by parallel threads.

    report = verify_checkpoint("ckpt/step-100", threads=8)   # a directory, an HF file/dir, a URL
    report.ok, report.bad_chunks, report.bytes_checked / report.seconds

Call order: :func:`~hyperdcp.sources.open_source` -> ``source.reader()`` -> each file checked once ->
each chunk's blocks read and hashed. Checks, in order: the metadata (self-checksum and full
validation), each data file (present, a regular file, not a link, the recorded size, a safetensors
header that matches the metadata) and each checksum block of each chunk. Problems are collected rather
than raised, so one run lists all of them. Reads are streamed in blocks: memory stays bounded whatever
sizes the metadata declares. Sources without block checksums (HuggingFace safetensors) get the
structure and size checks only, and the report says so (``checksums`` is False).
"""

from __future__ import annotations

import os
import threading
import time

import xxhash

from ..errors import CheckpointError, FormatError
from ..format.metadata import METADATA_FILE, Metadata
from ..results import BadChunk, VerifyReport
from ..sources.base import ChunkReader, open_source
from ..storage.threads import run_all
from ..storage.urls import is_remote, url_join

#: bytes read per pread while verifying (whole checksum blocks are assembled from these)
_READ_BYTES = 8 << 20


def _check_chunk(files: ChunkReader, meta: Metadata, fqn: str, i: int) -> tuple[int, BadChunk | None]:
    t = meta.tensors[fqn]
    c = t.chunks
    fidx, begin, end = int(c.file[i]), int(c.begin[i]), int(c.end[i])
    B = meta.checksum_block_bytes
    sums = c.checksums[i]
    name = meta.files[fidx].name
    nbytes = end - begin
    per = max(1, _READ_BYTES // B) * B if B <= _READ_BYTES else B
    done = 0
    blk = 0
    try:
        if nbytes == 0:
            if "%016x" % xxhash.xxh3_64_intdigest(b"") != sums[:16]:
                return 0, BadChunk(name, fqn, str(c.box(i)), 0, begin, "checksum mismatch")
            return 0, None
        while done < nbytes:
            n = min(per, nbytes - done)
            buf = bytearray(n)
            files.read_into(fidx, begin + done, buf, f"tensor {fqn!r} chunk {c.box(i)}")
            mv = memoryview(buf)
            for k in range(0, n, B):
                if "%016x" % xxhash.xxh3_64_intdigest(mv[k : k + B]) != sums[16 * blk : 16 * blk + 16]:
                    return done + k, BadChunk(name, fqn, str(c.box(i)), blk, begin + done + k, "checksum mismatch")
                blk += 1
            done += n
    except CheckpointError as e:
        return done, BadChunk(name, fqn, str(c.box(i)), -1, begin, str(e))
    return done, None


def verify_checkpoint(path: str | os.PathLike, threads: int = 8) -> VerifyReport:
    """Check every checksum of the checkpoint at ``path``; never raises for damage, only reports it.

    Args:
        path: a hyperdcp checkpoint (directory or fsspec URL), a HuggingFace ``.safetensors`` file, model
            directory or hub snapshot.
        threads: reader threads.

    Returns:
        a :class:`~hyperdcp.results.VerifyReport` listing every problem found.

    Raises CheckpointError only when there is no checkpoint to verify at all (not found, incomplete).
    """
    path = os.fspath(path)
    rep = VerifyReport(path)
    t0 = time.perf_counter()
    try:
        source = open_source(path)
    except FormatError as e:
        from ..sources.huggingface import HuggingFaceSource

        where = "" if HuggingFaceSource.probe(path) is None else (
            url_join(path, METADATA_FILE) if is_remote(path) else os.path.join(path, METADATA_FILE)) + ": "
        rep.file_errors.append(f"{where}{e}")
        rep.seconds = time.perf_counter() - t0
        return rep
    meta = source.metadata
    rep.kind, rep.checksums = source.kind, source.verifiable
    files = source.reader()
    rep.files = len(meta.files)
    bad_files: set[int] = set()
    for fidx in range(len(meta.files)):
        try:
            files.fd(fidx)
        except CheckpointError as e:
            rep.file_errors.append(str(e))
            bad_files.add(fidx)
    jobs = [(fqn, i) for fqn, t in meta.tensors.items() for i in range(len(t.chunks))
            if int(t.chunks.file[i]) not in bad_files] if source.verifiable else []
    # big chunks first so the threads finish together
    jobs.sort(key=lambda j: -int(meta.tensors[j[0]].chunks.end[j[1]] - meta.tensors[j[0]].chunks.begin[j[1]]))
    rep.chunks = sum(len(t.chunks) for t in meta.tensors.values())
    lock = threading.Lock()

    def one(job):
        n, bad = _check_chunk(files, meta, *job)
        with lock:
            rep.bytes_checked += n
            if bad is not None:
                rep.bad_chunks.append(bad)

    try:
        run_all(one, jobs, threads)
    finally:
        files.close()
    rep.bad_chunks.sort(key=lambda b: (b.file, b.byte_offset))
    rep.seconds = time.perf_counter() - t0
    return rep


__all__ = ["verify_checkpoint", "VerifyReport", "BadChunk"]
