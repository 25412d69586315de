"""HuggingFace safetensors interop: read HF checkpoints as hyperdcp sources, convert both ways.

An HF source is a directory with ``model.safetensors.index.json`` (sharded), a directory with one
``model.safetensors`` (or other ``*.safetensors`` files), or a single ``.safetensors`` file. Its headers
are parsed strictly (:func:`~hyperdcp.storage.data_file.read_header`) into an in-memory
:class:`HFMetadata`: one chunk per tensor covering it whole, the shard files as data files, and no
checksums (HF files carry none, so loads skip verification for this source only). The ordinary load
path then reads just the bytes each rank needs.

Conversions stream: hf -> dcp copies each tensor in bounded pieces (checksummed as written), dcp -> hf
assembles one tensor at a time through the verified reader, several tensors in flight under a byte
budget, each written at its precomputed offset in its shard.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import struct
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np

from .core import dtypes
from .core.boxes import Box, full_box
from .core.shards import LocalShard, ShardedTensor
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    FormatError,
    IncompleteCheckpointError,
    MismatchError,
    StorageError,
)
from .format.metadata import METADATA_FILE, ChunkTable, FileMeta, Metadata, TensorMeta
from .storage.checksum import block_digests
from .storage.data_file import MAX_HEADER_BYTES, ChunkToWrite, build_header, read_header
from .storage.threads import run_all

INDEX_SUFFIX = ".safetensors.index.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 100_000_000
FLOAT_CODES = ("F16", "BF16", "F32", "F64")
_DTYPE_ALIASES = {"bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "f16": "F16", "float16": "F16", "half": "F16",
                  "fp32": "F32", "f32": "F32", "float32": "F32", "float": "F32", "fp64": "F64", "f64": "F64",
                  "float64": "F64", "double": "F64"}


@dataclass
class HFMetadata(Metadata):
    """A :class:`Metadata` view of HuggingFace safetensors files (built in memory, never written)."""

    #: directory holding the files
    root: str = ""
    #: HF files carry no hyperdcp checksums: loads of this source skip verification
    has_checksums: bool = False
    #: the index file the shard list came from, if any
    index_file: str | None = None


# -- discovery ---------------------------------------------------------------------------------
def is_hf_source(path: str | os.PathLike) -> bool:
    """True when ``path`` is a ``.safetensors`` file, or a directory without ``hyperdcp.json`` that
    holds safetensors files or an HF index (an incomplete hyperdcp checkpoint is caught later)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path.endswith(".safetensors")
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, METADATA_FILE)):
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.endswith(".safetensors") or n.endswith(INDEX_SUFFIX) for n in names)


def _check_plain_name(root: str, name: Any, where: str) -> str:
    """A file name from an index must be a plain name of a regular, non-link file inside ``root``."""
    if (type(name) is not str or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name or os.path.isabs(name) or name != os.path.basename(name)):
        raise FormatError(
            f"{where}: shard file name {name!r} is not a plain file name inside the checkpoint directory "
            "(no paths, '..' or absolute names); fix or regenerate the index"
        )
    return name


def _open_regular(path: str) -> tuple[int, int]:
    """Open through the checkpoint's one path: no links followed, non-blocking (a FIFO cannot hang), regular
    files only."""
    from .storage.safe_open import open_regular

    try:
        return open_regular(path, "safetensors file", missing=FileNotFoundError)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"safetensors file {path} does not exist; the HF checkpoint is incomplete") from None
    except FormatError as e:
        if "symbolic link" in str(e):
            raise FormatError(
                f"{path} is a symbolic link; hyperdcp never follows links inside a checkpoint (copy the files, "
                "e.g. snapshot_download(local_dir=...), or pass the link's target file)"
            ) from None
        raise


def _read_index(root: str, name: str) -> dict[str, str]:
    path = os.path.join(root, name)
    fd, size = _open_regular(path)
    try:
        if size > MAX_INDEX_BYTES:
            raise FormatError(f"{path}: index of {size} bytes exceeds the {MAX_INDEX_BYTES}-byte limit")
        from .storage.safe_open import pread_exact

        raw = pread_exact(fd, size, 0, f"index file {path}")
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError, MemoryError) as e:
        raise FormatError(f"{path}: not valid JSON ({type(e).__name__}); regenerate the index") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(type(k) is str and k for k in wm):
        raise FormatError(f"{path}: needs a \"weight_map\" object mapping tensor names to shard files")
    for v in wm.values():
        _check_plain_name(root, v, path)
    return wm


def hf_files(path: str | os.PathLike) -> tuple[str, list[str], dict[str, str] | None, str | None]:
    """``(root, shard file names, weight map or None, index file name or None)`` of an HF source."""
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise FormatError(f"{path!r} is not a .safetensors file; pass a safetensors file or an HF model directory")
        if os.path.islink(path):
            path = os.path.realpath(path)  # the user named this file: resolve it once, explicitly
        return os.path.dirname(os.path.abspath(path)), [os.path.basename(path)], None, None
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path!r}: the path does not exist; check the path")
    names = sorted(os.listdir(path))
    if METADATA_FILE in names:
        raise FormatError(f"{path!r} is a hyperdcp checkpoint, not a HuggingFace directory")
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    if len(indexes) > 1:
        if INDEX_FILE not in indexes:
            raise FormatError(f"{path!r} holds several index files {indexes}; pass the shard file you want or keep one index")
        indexes = [INDEX_FILE]
    if indexes:
        wm = _read_index(path, indexes[0])
        return path, sorted(set(wm.values())), wm, indexes[0]
    if SINGLE_FILE in names:
        return path, [SINGLE_FILE], None, None
    files = [n for n in names if n.endswith(".safetensors")]
    if not files:
        raise CheckpointNotFoundError(
            f"no checkpoint at {path!r}: it has neither {METADATA_FILE} (hyperdcp) nor safetensors files (HuggingFace)"
        )
    return path, files, None, None


def read_hf_metadata(path: str | os.PathLike) -> HFMetadata:
    """Parse and validate the headers of an HF source into an :class:`HFMetadata`."""
    root, names, wm, index = hf_files(path)
    files: list[FileMeta] = []
    tensors: dict[str, TensorMeta] = {}
    where_of: dict[str, str] = {}
    hf_meta: dict = {}
    for fi, name in enumerate(names):
        fpath = os.path.join(root, name)
        fd, size = _open_regular(fpath)
        try:
            entries, _ = read_header(fd, size, fpath)
            from .storage.safe_open import pread_exact

            (n,) = struct.unpack("<Q", pread_exact(fd, 8, 0, fpath))
            head = json.loads(pread_exact(fd, n, 8, fpath).decode("utf-8"))
        finally:
            os.close(fd)
        meta = head.get("__metadata__") or {}
        if isinstance(meta, dict) and meta.get("format") == "hyperdcp":
            raise IncompleteCheckpointError(
                f"{fpath} is a hyperdcp data file but {root!r} has no {METADATA_FILE}: an incomplete hyperdcp "
                "checkpoint (the save did not finish); load an earlier checkpoint"
            )
        if not hf_meta and isinstance(meta, dict):
            hf_meta = {str(k): v for k, v in meta.items()}
        files.append(FileMeta(name, size))
        for tname, (code, shape, begin, end) in entries.items():
            if not tname:
                raise FormatError(f"{fpath} holds a tensor with the empty name ''; hyperdcp names every tensor by a "
                                  "non-empty key: rename it (e.g. with safetensors) before loading or converting")
            if tname in tensors:
                raise FormatError(f"tensor {tname!r} is stored both in {where_of[tname]} and in {name} under {root!r}")
            where_of[tname] = name
            tensors[tname] = _whole_tensor(code, shape, fi, begin, end)
    if wm is not None:
        for tname, fname in wm.items():
            if where_of.get(tname) != fname:
                raise FormatError(
                    f"{os.path.join(root, index)}: maps tensor {tname!r} to {fname}, but "
                    + (f"it is stored in {where_of[tname]}" if tname in where_of else f"{fname} does not hold it")
                    + "; the index and the shards disagree"
                )
    return HFMetadata(world_size=1, files=files, tensors=tensors, values={}, format_version=0,
                      library_version="huggingface-safetensors", created_unix=0.0, user={"hf_metadata": hf_meta},
                      root=root, index_file=index)


def _whole_tensor(code: str, shape: tuple[int, ...], fi: int, begin: int, end: int) -> TensorMeta:
    nd, n = len(shape), 1  # one chunk, even for an empty tensor: it mirrors the file's header entry
    table = ChunkTable(
        offsets=np.zeros((n, nd), np.int64),
        lengths=np.array([list(shape)] * n, dtype=np.int64).reshape(n, nd),
        file=np.full(n, fi, np.int64),
        begin=np.full(n, begin, np.int64),
        end=np.full(n, end, np.int64),
        checksums=[""] * n,
    )
    return TensorMeta(code, tuple(shape), table)


def _encode_view(m: HFMetadata) -> bytes:
    tensors = [[k, t.dtype, list(t.shape), int(t.chunks.file[0]), int(t.chunks.begin[0]), int(t.chunks.end[0])]
               for k, t in m.tensors.items()]
    doc = {"root": m.root, "index": m.index_file, "files": [[f.name, f.nbytes] for f in m.files],
           "tensors": tensors, "user": m.user}
    return json.dumps(doc).encode()


def _decode_view(raw: bytes) -> HFMetadata:
    doc = json.loads(raw.decode())
    tensors = {k: _whole_tensor(c, tuple(s), fi, b, e) for k, c, s, fi, b, e in doc["tensors"]}
    return HFMetadata(world_size=1, files=[FileMeta(n, b) for n, b in doc["files"]], tensors=tensors, values={},
                      format_version=0, library_version="huggingface-safetensors", created_unix=0.0,
                      user=doc["user"], root=doc["root"], index_file=doc["index"])


def fetch_metadata(coord, path: str) -> HFMetadata:
    """Rank 0 parses the HF headers and sends the view to every rank (errors raise everywhere)."""
    from .coordination.base import broadcast_checked

    raw = broadcast_checked(coord, f"reading the safetensors headers of {path!r}",
                            lambda: _encode_view(read_hf_metadata(path)), 0)
    return _decode_view(raw)


def open_metadata(path: str | os.PathLike) -> Metadata:
    """The metadata of any source: a hyperdcp checkpoint or an HF safetensors file/directory."""
    from .storage.commit import load_metadata

    return read_hf_metadata(path) if is_hf_source(path) else load_metadata(os.fspath(path))


def data_root(meta: Metadata, path: str) -> str:
    return getattr(meta, "root", "") or os.fspath(path)


def rename_keys(meta: Metadata, key_map: Callable[[str], str | None]) -> Metadata:
    """A copy of ``meta`` with every key renamed through ``key_map`` (None drops the key)."""
    def renamed(d: dict) -> dict:
        out: dict = {}
        for old, v in d.items():
            new = key_map(old)
            if new is None:
                continue
            if type(new) is not str or not new:
                raise MismatchError(f"key_map returned {new!r} for {old!r}; it must return a non-empty str or None")
            if new in out or new in seen:
                raise MismatchError(f"key_map maps two checkpoint keys to {new!r} (one of them {old!r}); make it one-to-one")
            out[new] = v
            seen.add(new)
        return out

    seen: set[str] = set()
    return replace(meta, tensors=renamed(meta.tensors), values=renamed(meta.values))


# -- reading boxes -----------------------------------------------------------------------------
def read_box(files, meta: Metadata, fqn: str, box: Box, verify: bool = True, index=None) -> np.ndarray:
    """The C-ordered bytes (flat uint8) of region ``box`` of tensor ``fqn``, through the verified reader."""
    from .loading import execute_local_reads
    from .options import LoadOptions
    from .planning.load_plan import TensorIndex, group_reads, pieces_for

    t = meta.tensors[fqn]
    buf = np.empty(box.numel * dtypes.itemsize(t.dtype), np.uint8)
    if box.numel == 0:
        return buf
    st = ShardedTensor(fqn, t.dtype, t.shape, [LocalShard(box, buf)])
    index = index or TensorIndex(meta)
    verify = verify and getattr(meta, "has_checksums", True)
    reads = group_reads(meta, pieces_for(st, index.get(fqn), t), verify)
    execute_local_reads(files, meta, reads, LoadOptions(verify_checksums=verify, read_threads=1))
    return buf


# -- helpers -----------------------------------------------------------------------------------
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*$", re.I)


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5*10**9, ``"512MiB"`` -> 512*2**20, plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    num, unit = float(m.group(1)), m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("IB")[:1]]
    size = int(num * base ** power)
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def parse_dtype(text: str) -> str:
    code = _DTYPE_ALIASES.get(text.lower(), text.upper())
    if code not in FLOAT_CODES:
        raise ValueError(f"unsupported --dtype {text!r}; use one of bf16, f16, f32, f64")
    return code


class ByteBudget:
    """Bounds bytes in flight across threads; one oversized request may always proceed alone."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._cv = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cv:
            while self.used and self.used + n > self.limit:
                self._cv.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()


class Progress:
    """A thread-safe byte counter: a tqdm bar on a terminal (unless quiet), else, when the ``hyperdcp``
    logger is enabled for INFO, a log line every 10% of the work or 10 seconds."""

    def __init__(self, total: int, desc: str, quiet: bool = False):
        from .logs import logger

        self._lock = threading.Lock()
        self._bar = None
        self._total, self._desc, self._done = total, desc, 0
        self._log = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
        elif logger.isEnabledFor(20):  # logging.INFO
            self._log = logger
            self._t0 = self._last_t = time.monotonic()
            self._last_done = 0

    def update(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)
        elif self._log is not None:
            with self._lock:
                self._done += n
                now = time.monotonic()
                if (self._done - self._last_done) * 10 < self._total and now - self._last_t < 10:
                    return
                self._last_done, self._last_t = self._done, now
                done, total, secs = self._done, self._total, now - self._t0
            self._log.info("%s: %.1f%% (%.3f of %.3f GB, %.2f GB/s)", self._desc, 100 * done / max(total, 1),
                           done / 1e9, total / 1e9, done / 1e9 / max(secs, 1e-9))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _pwrite_all(fd: int, mv: memoryview, offset: int, path: str) -> None:
    while len(mv):
        try:
            n = os.pwrite(fd, mv, offset)
        except OSError as e:
            raise StorageError(f"writing {path} failed: {e.strerror or e}; check free space and permissions") from e
        mv, offset = mv[n:], offset + n


def _pread_into(fd: int, mv: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise FormatError(f"{path}: unexpected end of file at byte {offset + done}; the file is truncated")
        done += n


@dataclass
class ConvertResult:
    """What a conversion did."""

    src: str
    dst: str
    tensors: int
    tensor_bytes: int
    files: list[str]
    seconds: float
    skipped_values: list[str] = field(default_factory=list)
    tensor_names: list[str] = field(default_factory=list, repr=False)

    @property
    def gb_per_s(self) -> float:
        return self.tensor_bytes / 1e9 / max(self.seconds, 1e-9)


# -- HF -> hyperdcp ----------------------------------------------------------------------------
def hf_to_dcp(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False, threads: int = 4,
              buffer_bytes: int = 16 << 20, checksum_block_bytes: int | None = None, quiet: bool = True) -> ConvertResult:
    """Convert an HF safetensors file/directory into a hyperdcp checkpoint at ``dst``, streaming.

    Each source shard becomes one data file; tensors are copied in pieces of ``buffer_bytes`` by
    ``threads`` threads (memory: about threads x buffer_bytes), checksummed as written, then committed
    atomically like any save.
    """
    from .format.metadata import DEFAULT_BLOCK_BYTES
    from .storage.commit import SaveTarget

    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    meta = read_hf_metadata(src)
    if os.path.realpath(dst) == os.path.realpath(meta.root):
        raise StorageError(f"cannot convert {src!r} into its own directory; choose another destination")
    B = checksum_block_bytes or DEFAULT_BLOCK_BYTES
    piece = max(B, buffer_bytes // B * B)
    target = SaveTarget(dst, overwrite=overwrite)
    out_files: list[FileMeta] = []
    tensors: dict[str, TensorMeta] = {}
    try:
        tmp = target.prepare()
        by_file: dict[int, list[str]] = {}
        for name, t in meta.tensors.items():
            if t.nbytes:
                by_file.setdefault(int(t.chunks.file[0]), []).append(name)
            else:  # an empty tensor has no chunk in the hyperdcp format
                nd = len(t.shape)
                z = np.zeros(0, np.int64)
                tensors[name] = TensorMeta(t.dtype, t.shape, ChunkTable(np.zeros((0, nd), np.int64),
                                                                        np.zeros((0, nd), np.int64), z, z, z, []))
        jobs = []  # (src fi, out fd, out path, dst begin, name)
        fds: list[tuple[int, int, str]] = []
        try:
            for k, (fi, names) in enumerate(sorted(by_file.items())):
                names.sort(key=lambda n: int(meta.tensors[n].chunks.begin[0]))
                out_name = f"hf{k:05d}.safetensors"
                path = os.path.join(tmp, out_name)
                stubs = [ChunkToWrite(n, meta.tensors[n].dtype, meta.tensors[n].shape,
                                      SimpleNamespace(size=meta.tensors[n].nbytes)) for n in names]
                header, starts = build_header(stubs)
                total = len(header) + sum(s.data.size for s in stubs)
                src_fd, _ = _open_regular(os.path.join(meta.root, meta.files[fi].name))
                fds.append((src_fd, -1, ""))
                try:
                    out_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
                except OSError as e:
                    raise StorageError(f"cannot create data file {path}: {e.strerror or e}") from e
                fds[-1] = (src_fd, out_fd, path)
                _pwrite_all(out_fd, memoryview(header), 0, path)
                os.ftruncate(out_fd, total)
                for n, s in zip(names, starts):
                    jobs.append((len(fds) - 1, len(out_files), len(header) + s, n))
                out_files.append(FileMeta(out_name, total))
            progress = Progress(sum(meta.tensors[j[3]].nbytes for j in jobs), "hf -> hyperdcp", quiet)
            local = threading.local()
            sums: dict[str, str] = {}

            def copy(job) -> None:
                k, out_fi, out_begin, name = job
                src_fd, out_fd, path = fds[k]
                t = meta.tensors[name]
                if not hasattr(local, "buf"):
                    local.buf = np.empty(piece, np.uint8)
                size, begin = t.nbytes, int(t.chunks.begin[0])
                digests, done = [], 0
                while done < size:
                    n = min(piece, size - done)
                    mv = memoryview(local.buf)[:n]
                    _pread_into(src_fd, mv, begin + done, os.path.join(meta.root, meta.files[meta.tensors[name].chunks.file[0]].name))
                    digests.append(block_digests(mv, B))
                    _pwrite_all(out_fd, mv, out_begin + done, path)
                    done += n
                    progress.update(n)
                sums[name] = "".join(digests)
                ch = t.chunks
                tensors[name] = TensorMeta(t.dtype, t.shape, ChunkTable(
                    ch.offsets.copy(), ch.lengths.copy(), np.array([out_fi], np.int64),
                    np.array([out_begin], np.int64), np.array([out_begin + size], np.int64), [sums[name]]))

            try:
                jobs.sort(key=lambda j: -meta.tensors[j[3]].nbytes)  # big first: balances threads
                run_all(copy, jobs, threads)
            finally:
                progress.close()
            for _, out_fd, path in fds:
                try:
                    os.fsync(out_fd)
                except OSError as e:
                    raise StorageError(f"fsync of {path} failed: {e.strerror or e}") from e
        finally:
            for src_fd, out_fd, _ in fds:
                os.close(src_fd)
                if out_fd >= 0:
                    os.close(out_fd)
        ordered = {n: tensors[n] for n in meta.tensors}
        user = {"converted_from": "huggingface-safetensors", **({"hf_metadata": meta.user["hf_metadata"]}
                                                                   if meta.user.get("hf_metadata") else {})}
        out = Metadata(world_size=1, files=out_files, tensors=ordered, values={}, checksum_block_bytes=B, user=user)
        target.commit(out.to_json())
    except BaseException:
        target.abort()
        raise
    finally:
        target.release()
    return ConvertResult(src, os.path.abspath(dst), len(meta.tensors), meta.tensor_bytes,
                         [f.name for f in out_files], time.perf_counter() - t0)


# -- hyperdcp (or any source) -> HF ------------------------------------------------------------
def _hf_header(entries: list[tuple[str, str, tuple[int, ...], int]], user_meta: dict) -> tuple[bytes, list[int]]:
    doc: dict = {"__metadata__": user_meta} if user_meta else {}
    pos, starts = 0, []
    for name, code, shape, n in entries:
        doc[name] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + n]}
        starts.append(pos)
        pos += n
    head = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    head += b" " * (-len(head) % 8)
    if len(head) > MAX_HEADER_BYTES:
        raise FormatError(f"a shard header would be {len(head)} bytes (safetensors allows {MAX_HEADER_BYTES}); "
                          "use a smaller --max-shard-size")
    return struct.pack("<Q", len(head)) + head, starts


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy packing in name order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    cur = 0
    for name in sorted(sizes):
        if shards[-1] and cur + sizes[name] > max_shard_bytes:
            shards.append([])
            cur = 0
        shards[-1].append(name)
        cur += sizes[name]
    return [s for s in shards if s] or [[]]


def select_keys(meta: Metadata, include: Sequence[str] = (), exclude: Sequence[str] = (),
                strip_prefix: str | None = None, where: str = "the checkpoint") -> tuple[Metadata, dict[str, str]]:
    """The keys of ``meta`` that start with one of ``include`` (all when empty) and with none of
    ``exclude``, with ``strip_prefix`` removed from those that start with it (plain string prefixes:
    ``"model."`` selects ``model.w`` but not ``model_ema.w``): the renamed metadata and a map from each
    new tensor name to its name in ``meta`` (read data through ``meta`` and the old names)."""
    include, exclude = tuple(include or ()), tuple(exclude or ())
    if not include and not exclude and not strip_prefix:
        return meta, {k: k for k in meta.tensors}
    origin: dict[str, str] = {}

    def key_map(k: str) -> str | None:
        new = _select(k)
        if new is not None and k in meta.tensors:
            origin[new] = k
        return new

    def _select(k: str) -> str | None:
        if (include and not k.startswith(include)) or (exclude and k.startswith(exclude)):
            return None
        if strip_prefix and k.startswith(strip_prefix):
            if k == strip_prefix:
                raise MismatchError(f"stripping the prefix {strip_prefix!r} from key {k!r} of {where} leaves nothing; "
                                    "exclude that key or strip a shorter prefix")
            return k[len(strip_prefix):]
        return k

    out = rename_keys(meta, key_map)
    if not out.tensors and meta.tensors:
        tops = sorted({k.split(".", 1)[0] + ("." if "." in k else "") for k in meta.keys()})
        raise MismatchError(
            f"no tensor of {where} is selected by include={list(include)} exclude={list(exclude)}; its keys start "
            f"with {tops[:10]}{' ...' if len(tops) > 10 else ''} (prefixes are matched as plain strings)"
        )
    return out, origin


def _check_utf8_names(meta: Metadata, src: str) -> None:
    for k in meta.tensors:
        try:
            k.encode("utf-8")
        except UnicodeEncodeError:
            raise FormatError(
                f"{src!r}: tensor name {k!r} is not valid Unicode (it holds a lone surrogate), which safetensors "
                "cannot store; leave it out with exclude=/--exclude, or rename it with hyperdcp.load(key_map=...)"
            ) from None


def dcp_to_hf(src: str | os.PathLike, dst: str | os.PathLike, *, max_shard_size: int | str = "5GB",
              dtype: str | None = None, values_file: str | None = None, overwrite: bool = False,
              threads: int = 4, budget_bytes: int = 256 << 20, quiet: bool = True, include: Sequence[str] = (),
              exclude: Sequence[str] = (), strip_prefix: str | None = None) -> ConvertResult:
    """Convert a hyperdcp checkpoint (or any source) into HF safetensors shards plus an index.

    Tensor names are kept, unless ``include``/``exclude`` (key prefixes) select some of them and
    ``strip_prefix`` removes a leading prefix: ``include=["model."], strip_prefix="model."`` exports
    exactly the model weights of a ``get_state_dict(model, optimizer)`` checkpoint. Non-tensor values
    are skipped (listed in the result) or written as tagged JSON to ``values_file``. ``dtype`` casts
    floating tensors (bf16/f16/f32/f64). Memory: about the largest tensor plus ``budget_bytes``
    (tensors in flight across ``threads`` threads).
    """
    from .format import values as values_codec
    from .planning.load_plan import TensorIndex
    from .storage.reader import DataFiles

    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    src_meta = open_metadata(src)
    meta, origin = select_keys(src_meta, include, exclude, strip_prefix, where=repr(src))
    _check_utf8_names(meta, src)
    cast = parse_dtype(dtype) if dtype else None
    limit = parse_size(max_shard_size)
    out_code = {n: (cast if cast and t.dtype in FLOAT_CODES else t.dtype) for n, t in meta.tensors.items()}
    if "__metadata__" in meta.tensors:
        raise FormatError(f"{src!r}: a tensor is named '__metadata__', which safetensors reserves; rename it first")
    out_bytes = {n: t.nbytes // dtypes.itemsize(t.dtype) * dtypes.itemsize(out_code[n]) for n, t in meta.tensors.items()}
    shards = plan_shards(out_bytes, limit)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    if os.path.realpath(dst) == os.path.realpath(data_root(meta, src)):
        raise StorageError(f"cannot convert {src!r} into its own directory; choose another destination")
    _prepare_hf_dir(dst, overwrite)
    hf_meta = meta.user.get("hf_metadata") if isinstance(meta.user.get("hf_metadata"), dict) else None
    hf_meta = {str(k): str(v) for k, v in (hf_meta or {"format": "pt"}).items()}
    files = DataFiles(data_root(src_meta, src), src_meta)  # data is read under the stored names
    index = TensorIndex(src_meta)
    token = secrets.token_hex(4)
    partial = [os.path.join(dst, f".{nm}.{token}.partial") for nm in names]
    fds: list[int] = []
    jobs = []
    try:
        for si, shard in enumerate(shards):
            # like the safetensors library: larger alignment first, then name, so every tensor stays aligned
            shard.sort(key=lambda nm: (-dtypes.itemsize(out_code[nm]), nm))
            header, starts = _hf_header([(nm, out_code[nm], meta.tensors[nm].shape, out_bytes[nm]) for nm in shard], hf_meta)
            try:
                fd = os.open(partial[si], os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as e:
                raise StorageError(f"cannot create {partial[si]}: {e.strerror or e}") from e
            fds.append(fd)
            _pwrite_all(fd, memoryview(header), 0, partial[si])
            os.ftruncate(fd, len(header) + sum(out_bytes[nm] for nm in shard))
            jobs.extend((si, len(header) + s, nm) for nm, s in zip(shard, starts))
        total = sum(out_bytes.values())
        progress = Progress(total, "hyperdcp -> hf", quiet)
        budget = ByteBudget(budget_bytes)

        def one(job) -> None:
            si, off, nm = job
            t = meta.tensors[nm]
            need = t.nbytes + (out_bytes[nm] if out_code[nm] != t.dtype else 0)
            budget.acquire(need)
            try:
                buf = read_box(files, src_meta, origin[nm], full_box(t.shape), index=index)
                if out_code[nm] != t.dtype and buf.size:
                    arr = buf.view(dtypes.to_numpy(t.dtype)).astype(dtypes.to_numpy(out_code[nm]))
                    buf = arr.reshape(-1).view(np.uint8)
                _pwrite_all(fds[si], memoryview(buf), off, partial[si])
                progress.update(buf.size)
            finally:
                budget.release(need)

        try:
            run_all(one, jobs, threads)
        finally:
            progress.close()
        for fd, p in zip(fds, partial):
            try:
                os.fsync(fd)
            except OSError as e:
                raise StorageError(f"fsync of {p} failed: {e.strerror or e}") from e
        for p, nm in zip(partial, names):
            os.rename(p, os.path.join(dst, nm))
        if n > 1:
            wm = {nm: names[si] for si, shard in enumerate(shards) for nm in shard}
            doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}
            _write_small(os.path.join(dst, INDEX_FILE), json.dumps(doc, indent=2).encode() + b"\n")
        skipped = sorted(meta.values)
        if values_file and meta.values:
            enc = {k: values_codec.encode(v, k) for k, v in meta.values.items()}
            _write_small(values_file, json.dumps({"format": "hyperdcp-values", "values": enc}, indent=1).encode() + b"\n")
    except BaseException:
        for p in partial:
            if os.path.exists(p):
                os.unlink(p)
        raise
    finally:
        for fd in fds:
            os.close(fd)
        files.close()
    return ConvertResult(src, os.path.abspath(dst), len(meta.tensors), total, names, time.perf_counter() - t0,
                         skipped_values=[] if values_file else skipped, tensor_names=sorted(meta.tensors))


def _prepare_hf_dir(dst: str, overwrite: bool) -> None:
    if os.path.islink(dst):
        raise StorageError(f"cannot write to {dst!r}: it is a symbolic link; hyperdcp never writes through a link: "
                           "pass the directory it points to")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise StorageError(f"cannot write to {dst!r}: it is an existing file; choose a directory path")
    os.makedirs(dst, exist_ok=True)
    existing = [n for n in os.listdir(dst) if n.endswith(".safetensors") or n.endswith(INDEX_SUFFIX) or n == METADATA_FILE]
    if existing and not overwrite:
        raise CheckpointExistsError(
            f"{dst!r} already holds {existing[:3]}; pass --overwrite (overwrite=True) to replace them or choose an empty directory"
        )
    if METADATA_FILE in existing:
        raise CheckpointExistsError(f"{dst!r} is a hyperdcp checkpoint; refusing to write HF files into it")
    for nm in existing:
        os.unlink(os.path.join(dst, nm))


def _write_small(path: str, data: bytes) -> None:
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except OSError as e:
        raise StorageError(f"writing {path} failed: {e.strerror or e}") from e


#: the format is called hyperdcp in the CLI (``convert hf-to-hyperdcp``); the dcp names stay as aliases
hf_to_hyperdcp = hf_to_dcp
hyperdcp_to_hf = dcp_to_hf
