"""Offline verification of a checkpoint: every checksum of every chunk, read by parallel threads.

    report = verify_checkpoint("ckpt/step-100", threads=8)
    report.ok, report.bad_chunks, report.bytes_checked / report.seconds

Checks, in order: the metadata (self-checksum and full validation), each data file (present, a regular
file, not a link, the recorded size, a safetensors header that matches the metadata) and each checksum
block of each chunk. Problems are collected rather than raised, so one run lists all of them. Reads are
streamed in blocks: memory stays bounded whatever sizes the metadata declares.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import xxhash

from .errors import CheckpointError
from .format.metadata import METADATA_FILE, Metadata
from .storage.commit import load_metadata
from .storage.reader import DataFiles
from .storage.threads import run_all

#: bytes read per pread while verifying (whole checksum blocks are assembled from these)
_READ_BYTES = 8 << 20


@dataclass
class BadChunk:
    file: str
    tensor: str
    box: str
    block: int  # first bad checksum block in the chunk, -1 when the chunk could not be read
    byte_offset: int  # absolute offset in the file of that block
    reason: str

    def __str__(self) -> str:
        where = f"block {self.block} at byte {self.byte_offset}" if self.block >= 0 else "unreadable"
        return f"{self.file}: tensor {self.tensor!r} chunk {self.box}: {where}: {self.reason}"


@dataclass
class VerifyReport:
    path: str
    files: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    bad_chunks: list[BadChunk] = field(default_factory=list)
    file_errors: list[str] = field(default_factory=list)  # metadata or whole-file problems

    @property
    def ok(self) -> bool:
        return not self.bad_chunks and not self.file_errors

    @property
    def gb_per_s(self) -> float:
        return self.bytes_checked / 1e9 / self.seconds if self.seconds > 0 else 0.0


def _check_chunk(files: DataFiles, meta: Metadata, fqn: str, i: int) -> tuple[int, BadChunk | None]:
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

    Raises CheckpointError only when there is no checkpoint to verify at all (not found, incomplete).
    """
    path = os.fspath(path)
    rep = VerifyReport(path)
    t0 = time.perf_counter()
    try:
        meta = load_metadata(path)
    except CheckpointError as e:
        from .errors import FormatError

        if isinstance(e, FormatError):
            rep.file_errors.append(f"{os.path.join(path, METADATA_FILE)}: {e}")
            rep.seconds = time.perf_counter() - t0
            return rep
        raise
    files = DataFiles(path, meta)
    rep.files = len(meta.files)
    bad_files: set[int] = set()
    for fidx in range(len(meta.files)):
        try:
            files.fd(fidx)
        except CheckpointError as e:
            rep.file_errors.append(str(e))
            bad_files.add(fidx)
    jobs = [(fqn, i) for fqn, t in meta.tensors.items() for i in range(len(t.chunks)) if int(t.chunks.file[i]) not in bad_files]
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
