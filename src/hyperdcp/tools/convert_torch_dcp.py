"""Conversions between torch.distributed.checkpoint (torch DCP) and hyperdcp, streaming.

* :func:`torch_dcp_to_hyperdcp` copies every chunk's byte range out of its ``torch.save`` record into
  hyperdcp data files (one per torch data file, chunks in file order so the source is read sequentially),
  in pieces of ``buffer_bytes`` on ``threads`` threads -- memory is about ``threads x buffer_bytes``,
  whatever the checkpoint's size -- checksummed as written, then committed like any save. Each stored
  storage's zip CRC-32 is checked on the way when a chunk spans its whole storage (they always do when
  torch wrote them).
* :func:`hyperdcp_to_torch_dcp` writes what ``dcp.load`` reads (``FileSystemWriter``'s layout): one
  ``torch.save`` record per chunk in ``__0_0.distcp`` and a pickled ``.metadata`` of torch's own classes.
  One chunk is in memory at a time. Needs torch.

    torch_dcp_to_hyperdcp("runs/titan/step-1000", "ckpt/step-1000")
    hyperdcp_to_torch_dcp("ckpt/step-1000", "back/step-1000")
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
import time
import uuid
import zlib
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..core.boxes import Box
from ..errors import CheckpointExistsError, CorruptionError, StorageError
from ..format.metadata import DEFAULT_BLOCK_BYTES, ChunkTable, FileMeta, Metadata, TensorMeta
from ..loading.reads import read_box
from ..planning.load_plan import TensorIndex
from ..results import ConvertResult
from ..sources.base import open_source
from ..sources.torch_dcp import TorchDcpSource
from ..sources.torch_dcp_pickle import DTYPES
from ..storage.checksum import block_digests
from ..storage.data_file import ChunkToWrite, build_header, chunk_name
from ..storage.safe_open import open_regular
from ..storage.threads import run_all
from ._units import Progress
from .convert import _pread_into, _pwrite_all

#: hyperdcp dtype code -> torch's attribute name
TORCH_DTYPE: dict[str, str] = {}
for _name, _code in DTYPES.items():
    TORCH_DTYPE.setdefault(_code, _name)


def torch_dcp_to_hyperdcp(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False,
                          threads: int = 4, buffer_bytes: int = 16 << 20, checksum_block_bytes: int | None = None,
                          check_crc: bool = True, quiet: bool = True,
                          storage_options: dict | None = None) -> ConvertResult:
    """Convert the torch DCP checkpoint at ``src`` into a hyperdcp checkpoint at ``dst``, streaming.

    ``dst``: a directory (positional writes on ``threads`` threads into a temporary directory, then the
    atomic swap of a save), or an ``s3://`` URL or one of a scheme registered with
    :func:`~hyperdcp.storage.register_storage` (each data file one sequential upload through the
    destination's Storage, read ahead on ``threads`` threads, the commit record last; ``storage_options`` as
    for :func:`hyperdcp.save`). Entries hyperdcp cannot read (pickled objects, non-row-major tensors) are left
    out and listed in ``skipped_values`` of the result. ``check_crc``: compare each whole storage with the
    CRC-32 of its zip entry (about 1 s/GB of CPU; the only check torch's data has).
    """
    from ..storage.commit import SaveTarget
    from ..storage.urls import is_remote, save_path

    t0 = time.perf_counter()
    src, dst = os.fspath(src), save_path(os.fspath(dst))  # a directory, or a URL hyperdcp saves to
    source = TorchDcpSource.open(src)
    meta = source.metadata
    if not is_remote(dst) and os.path.realpath(dst) == os.path.realpath(source.root):
        raise StorageError(f"cannot convert {src!r} into its own directory; choose another destination")
    B = checksum_block_bytes or DEFAULT_BLOCK_BYTES
    piece = max(B, buffer_bytes // B * B)
    by_file: dict[int, list[tuple[str, int]]] = {}
    for name, t in meta.tensors.items():
        c = t.chunks
        for i in range(len(c)):
            if int(c.end[i]) > int(c.begin[i]):  # an empty chunk has no bytes to store
                by_file.setdefault(int(c.file[i]), []).append((name, i))
    if is_remote(dst):
        out_files, placed, where = _upload(source, by_file, dst, overwrite, threads, piece, B, check_crc, quiet,
                                           storage_options)
        return ConvertResult(src, where, len(meta.tensors), meta.tensor_bytes, [f.name for f in out_files],
                             time.perf_counter() - t0, skipped_values=sorted(source.unreadable),
                             tensor_names=list(meta.tensors))
    target = SaveTarget(dst, overwrite=overwrite)
    out_files: list[FileMeta] = []
    placed: dict[tuple[str, int], tuple[int, int, str]] = {}  # (name, chunk) -> (out file, begin, checksums)
    fds: list[tuple[int, int, str, str]] = []  # (src fd, out fd, out path, src path)
    try:
        tmp = target.prepare()
        jobs = []
        try:
            for k, (fi, chunks) in enumerate(sorted(by_file.items())):
                header, starts, total = _file_layout(meta, chunks)
                out_name, spath = f"td{k:05d}.safetensors", os.path.join(source.root, meta.files[fi].name)
                sfd, _ = open_regular(spath, "torch DCP data file")
                fds.append((sfd, -1, "", spath))
                path = os.path.join(tmp, out_name)
                try:
                    ofd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
                except OSError as e:
                    raise StorageError(f"cannot create data file {path}: {e.strerror or e}") from e
                fds[-1] = (sfd, ofd, path, spath)
                _pwrite_all(ofd, memoryview(header), 0, path)
                os.ftruncate(ofd, total)
                for (name, i), s in zip(chunks, starts):
                    jobs.append((len(fds) - 1, len(out_files), len(header) + s, name, i))
                out_files.append(FileMeta(out_name, total))
            progress = Progress(sum(_nbytes(meta.tensors[j[3]], j[4]) for j in jobs), "torch-dcp -> hyperdcp", quiet)
            local = threading.local()

            def copy(job) -> None:
                k, out_fi, out_begin, name, i = job
                sfd, ofd, path, spath = fds[k]
                if not hasattr(local, "buf"):
                    local.buf = np.empty(piece, np.uint8)
                size, begin = _nbytes(meta.tensors[name], i), int(meta.tensors[name].chunks.begin[i])
                digests, done, crc = [], 0, 0
                while done < size:
                    n = min(piece, size - done)
                    mv = memoryview(local.buf)[:n]
                    _pread_into(sfd, mv, begin + done, spath)
                    if check_crc:
                        crc = zlib.crc32(mv, crc)
                    digests.append(block_digests(mv, B))
                    _pwrite_all(ofd, mv, out_begin + done, path)
                    done += n
                    progress.update(n)
                if check_crc:
                    _check_crc(source, name, i, crc, spath)
                placed[(name, i)] = (out_fi, out_begin, "".join(digests))

            try:
                jobs.sort(key=lambda j: -_nbytes(meta.tensors[j[3]], j[4]))  # big first: balances threads
                run_all(copy, jobs, threads)
            finally:
                progress.close()
            for _, ofd, path, _ in fds:
                try:
                    os.fsync(ofd)
                except OSError as e:
                    raise StorageError(f"fsync of {path} failed: {e.strerror or e}") from e
        finally:
            for sfd, ofd, _, _ in fds:
                os.close(sfd)
                if ofd >= 0:
                    os.close(ofd)
        tensors = {name: _out_tensor(name, t, placed) for name, t in meta.tensors.items()}
        out = Metadata(world_size=1, files=out_files, tensors=tensors, values=dict(meta.values),
                       checksum_block_bytes=B, user={"converted_from": "torch-dcp"})
        target.commit(out.to_json())
    except BaseException:
        target.abort()
        raise
    finally:
        target.release()
    return ConvertResult(src, os.path.abspath(dst), len(meta.tensors), meta.tensor_bytes,
                         [f.name for f in out_files], time.perf_counter() - t0,
                         skipped_values=sorted(source.unreadable), tensor_names=list(meta.tensors))


def _upload(source: TorchDcpSource, by_file: dict[int, list[tuple[str, int]]], dst: str, overwrite: bool, threads: int,
            piece: int, B: int, check_crc: bool, quiet: bool, storage_options: dict | None):
    """torch DCP -> a URL: one sequential stream per data file through ``dst``'s Storage (objects named with
    the save's token, the commit record last). Returns (files, placed chunks, the checkpoint's URL)."""
    from ..format.safetensors import data_file_name, save_token
    from ..storage.urls import storage_for
    from .convert import _commit, _stream_file

    meta = source.metadata
    storage = storage_for(dst, storage_options)
    out_files: list[FileMeta] = []
    placed: dict[tuple[str, int], tuple[int, int, str]] = {}
    staging = storage.begin_save(overwrite=overwrite)
    progress = Progress(sum(_nbytes(meta.tensors[n], i) for cs in by_file.values() for n, i in cs),
                        "torch-dcp -> hyperdcp", quiet)
    try:
        token = save_token(os.path.basename(staging.location.rstrip("/")))  # as a save names its objects
        for k, (fi, chunks) in enumerate(sorted(by_file.items())):
            header, starts, total = _file_layout(meta, chunks)
            out_name, spath = data_file_name(0, k, token), os.path.join(source.root, meta.files[fi].name)
            pieces = [(name, i, off, min(piece, _nbytes(meta.tensors[name], i) - off))
                      for name, i in chunks for off in range(0, _nbytes(meta.tensors[name], i), piece)]
            digests: dict[tuple[str, int], list[str]] = {nc: [] for nc in chunks}
            crcs: dict[tuple[str, int], int] = {nc: 0 for nc in chunks}
            sfd, _ = open_regular(spath, "torch DCP data file")
            try:
                def read(p: tuple, buf: np.ndarray, sfd: int = sfd, spath: str = spath) -> tuple[int, tuple]:
                    name, i, off, n = p
                    mv = memoryview(buf)[:n]
                    _pread_into(sfd, mv, int(meta.tensors[name].chunks.begin[i]) + off, spath)
                    return n, (block_digests(mv, B), mv)

                def done(p: tuple, n: int, extra: tuple, digests=digests, crcs=crcs) -> None:  # in file order
                    sums, mv = extra
                    digests[(p[0], p[1])].append(sums)
                    if check_crc:
                        crcs[(p[0], p[1])] = zlib.crc32(mv, crcs[(p[0], p[1])])
                    progress.update(n)

                _stream_file(staging, out_name, header, pieces, read, done, threads, piece)
            finally:
                os.close(sfd)
            for (name, i), s in zip(chunks, starts):
                if check_crc:
                    _check_crc(source, name, i, crcs[(name, i)], spath)
                placed[(name, i)] = (k, len(header) + s, "".join(digests[(name, i)]))
            out_files.append(FileMeta(out_name, total))
        tensors = {name: _out_tensor(name, t, placed) for name, t in meta.tensors.items()}
        out = Metadata(world_size=1, files=out_files, tensors=tensors, values=dict(meta.values),
                       checksum_block_bytes=B, user={"converted_from": "torch-dcp"})
        _commit(staging, out, token)
    except BaseException:
        staging.abort()
        raise
    finally:
        progress.close()
        staging.release()
    return out_files, placed, storage.url


def _file_layout(meta: Metadata, chunks: list[tuple[str, int]]) -> tuple[bytes, list[int], int]:
    """Sort ``chunks`` (of one torch data file) by their place in it; the hyperdcp data file's header, each
    chunk's start after it, and the file's size."""
    chunks.sort(key=lambda nc: int(meta.tensors[nc[0]].chunks.begin[nc[1]]))
    stubs = []
    for name, i in chunks:
        t, box = meta.tensors[name], meta.tensors[name].chunks.box(i)
        stubs.append(ChunkToWrite(chunk_name(name, box.offsets, box.lengths == tuple(t.shape)), t.dtype,
                                  box.lengths, SimpleNamespace(size=_nbytes(t, i))))
    header, starts = build_header(stubs)
    return header, starts, len(header) + sum(s.data.size for s in stubs)


def _check_crc(source: TorchDcpSource, name: str, i: int, crc: int, spath: str) -> None:
    """Chunk ``i`` of ``name`` against the CRC-32 torch's zip writer recorded (when it covers the chunk)."""
    want = source.crc.get((name, i))
    if want is not None and want != crc:
        raise CorruptionError(f"{spath}: the bytes of {name!r} chunk {i} do not match the CRC-32 torch "
                              "recorded for them; the data file is damaged")


def _nbytes(t: TensorMeta, i: int) -> int:
    return int(t.chunks.end[i]) - int(t.chunks.begin[i])


def _out_tensor(name: str, t: TensorMeta, placed: dict) -> TensorMeta:
    c = t.chunks
    rows = [i for i in range(len(c)) if (name, i) in placed]
    nd = len(t.shape)
    return TensorMeta(t.dtype, t.shape, ChunkTable(
        c.offsets[rows].reshape(len(rows), nd).copy(), c.lengths[rows].reshape(len(rows), nd).copy(),
        np.array([placed[(name, i)][0] for i in rows], np.int64),
        np.array([placed[(name, i)][1] for i in rows], np.int64),
        np.array([placed[(name, i)][1] + _nbytes(t, i) for i in rows], np.int64),
        [placed[(name, i)][2] for i in rows]))


# -- hyperdcp (or any source) -> torch DCP --------------------------------------------------------------
def dcp_flatten(fqn: str, value: Any) -> list[tuple[str, tuple, Any]]:
    """``(flat key, path, leaf)`` of a plain value as torch DCP's ``flatten_state_dict`` splits it: dicts
    always, lists only when they hold dicts or lists that are split themselves; other values whole."""
    out: list[tuple[str, tuple, Any]] = []
    base = tuple(fqn.split("."))

    def terminal(v: Any) -> bool:
        if isinstance(v, dict):
            return False
        if isinstance(v, list):
            return all(not isinstance(x, (dict, list)) or terminal(x) for x in v)
        return True

    def walk(path: tuple, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(path + (str(k),), x)
        elif terminal(v):
            out.append((".".join(map(str, path)), path, v))
        else:
            for i, x in enumerate(v):
                walk(path + (i,), x)

    walk(base, value)
    return out


def hyperdcp_to_torch_dcp(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False,
                          quiet: bool = True) -> ConvertResult:
    """Write the checkpoint at ``src`` (hyperdcp, HuggingFace) as a torch DCP checkpoint ``dcp.load`` reads.

    Tensors keep their chunks (one ``torch.save`` record each); values are stored as torch stores them.
    Entries stored per rank have no torch DCP equivalent: they are left out and listed in ``skipped_values``.
    """
    import torch
    import torch.distributed.checkpoint.metadata as tm
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    source = open_source(src)
    meta = source.metadata
    tmp = _prepare_dcp_dir(dst, overwrite)
    files = source.reader()
    index = TensorIndex(meta)  # one box index per tensor, built once
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple] = {}
    data_name = "__0_0.distcp"
    progress = Progress(meta.tensor_bytes, "hyperdcp -> torch-dcp", quiet)
    try:
        with open(os.path.join(tmp, data_name), "wb") as out:
            for name, t in meta.tensors.items():
                dt = getattr(torch, TORCH_DTYPE[t.dtype])
                c = t.chunks
                boxes = [c.box(i) for i in range(len(c))] or [Box((0,) * len(t.shape), tuple(t.shape))]
                chunks = []
                for i, box in enumerate(boxes):
                    raw = read_box(files, meta, name, box, verify=source.verifiable, index=index)
                    tensor = torch.frombuffer(bytearray(raw), dtype=dt) if raw.size else torch.empty(0, dtype=dt)
                    start = out.tell()
                    torch.save(tensor.reshape(box.lengths), out)
                    storage[tm.MetadataIndex(name, torch.Size(box.offsets), i)] = _StorageInfo(
                        data_name, start, out.tell() - start)
                    chunks.append(tm.ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.lengths)))
                    progress.update(raw.size)
                sdm[name] = tm.TensorStorageMetadata(tm.TensorProperties(dtype=dt), torch.Size(t.shape), chunks)
                planner[name] = tuple(name.split("."))
            for fqn, value in meta.values.items():
                for key, path, leaf in dcp_flatten(fqn, value):
                    start = out.tell()
                    torch.save(leaf, out)
                    storage[tm.MetadataIndex(key)] = _StorageInfo(data_name, start, out.tell() - start)
                    sdm[key] = tm.BytesStorageMetadata()
                    planner[key] = path
            out.flush()
            os.fsync(out.fileno())
        md = tm.Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                         storage_meta=tm.StorageMeta(checkpoint_id=dst, save_id=str(uuid.uuid4())), version="1.0.0")
        with open(os.path.join(tmp, ".metadata"), "wb") as f:
            pickle.dump(md, f)
            f.flush()
            os.fsync(f.fileno())
        _swap_in(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        files.close()
        progress.close()
    skipped = sorted(set(meta.per_rank_values) | set(meta.per_rank_tensors))
    return ConvertResult(src, os.path.abspath(dst), len(meta.tensors), meta.tensor_bytes, [data_name],
                         time.perf_counter() - t0, skipped_values=skipped, tensor_names=list(meta.tensors))


def _prepare_dcp_dir(dst: str, overwrite: bool) -> str:
    """A fresh directory beside ``dst`` to write into; ``dst`` must be absent, empty, or (``overwrite``) a torch DCP
    checkpoint of only ``.metadata`` and ``*.distcp`` files."""
    if os.path.lexists(dst):
        names = os.listdir(dst) if os.path.isdir(dst) and not os.path.islink(dst) else None
        if names is None:
            raise CheckpointExistsError(f"{dst!r} exists and is not a directory; choose another destination")
        if names and not overwrite:
            raise CheckpointExistsError(f"{dst!r} exists and is not empty; "
                                        "pass overwrite=True (--overwrite) to replace "
                                        "a torch DCP checkpoint there, or choose another destination")
        if names and not (".metadata" in names and all(n == ".metadata" or n.endswith(".distcp") for n in names)):
            raise CheckpointExistsError(f"{dst!r} holds files other than a torch DCP checkpoint's; it is never "
                                        "replaced: choose another destination")
    tmp = f"{dst.rstrip(os.sep)}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    return tmp


def _swap_in(tmp: str, dst: str) -> None:
    old = None
    if os.path.lexists(dst):
        old = f"{dst.rstrip(os.sep)}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
    os.rename(tmp, dst)
    if old:
        shutil.rmtree(old, ignore_errors=True)
