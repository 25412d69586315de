"""Conversions between HuggingFace safetensors and hyperdcp, streaming.

hf -> hyperdcp copies each tensor in bounded pieces (checksummed as written), appended in order through
the destination's :class:`~hyperdcp.storage.base.Storage` (a local directory, ``s3://``), and commits like
any save; hyperdcp (or any source) -> hf (a local directory) assembles one tensor at a time through the
verified reader, several tensors in flight under a byte budget, each written at its precomputed offset in
its shard. Both read through :func:`hyperdcp.sources.open_source`, so hub snapshots are accepted as
sources.

    hf_to_hyperdcp("hf-model/", "ckpt/step-0")
    hyperdcp_to_hf("ckpt/step-100", "export/", include=["model."], strip_prefix="model.")
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np

from ..core import dtypes
from ..core.boxes import full_box
from ..errors import CheckpointExistsError, FormatError, MismatchError, StorageError, UnsupportedStorageError
from ..format.metadata import METADATA_FILE, ChunkTable, FileMeta, Metadata, TensorMeta
from ..format.record_v2 import index_file_name
from ..format.safetensors import data_file_name, save_token
from ..loading.reads import read_box
from ..results import ConvertResult
from ..sources.base import open_source, rename_keys
from ..sources.huggingface import INDEX_FILE, INDEX_SUFFIX, SINGLE_FILE, HuggingFaceSource
from ..storage.base import SaveFiles, SaveStaging
from ..storage.checksum import block_digests
from ..storage.data_file import MAX_HEADER_BYTES, ChunkToWrite, build_header
from ..storage.local import LocalStorage
from ..storage.threads import run_all
from ..storage.urls import is_remote, save_path, storage_for
from ._units import FLOAT_CODES, ByteBudget, Progress, parse_dtype, parse_size


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


# -- HF -> hyperdcp ----------------------------------------------------------------------------
def _stream_file(files: SaveFiles, name: str, header: bytes, pieces: Sequence, read: Callable, done: Callable,
                 threads: int, piece_bytes: int) -> None:
    """Write data file ``name`` through ``files``: ``header``, then every piece in order.

    ``read(piece, buf) -> (n, extra)`` fills ``buf[:n]`` with the piece on one of ``threads`` threads, up to
    ``threads`` pieces ahead of the writer, which appends them in file order and calls ``done(piece, n,
    extra)`` after each (before the piece's buffer is reused: ``extra`` may hold a view of it): the file is one
    sequential stream whatever the storage (a local file, an object upload) and memory stays at ``threads``
    buffers of ``piece_bytes``.
    """
    window = max(1, threads)
    with files.create(name, "data file") as w, ThreadPoolExecutor(window, thread_name_prefix="hyperdcp-convert") as ex:
        w.write(header)
        free: list[np.ndarray] = []
        pending: collections.deque = collections.deque()

        def write_oldest() -> None:
            fut, piece, buf = pending.popleft()
            n, extra = fut.result()
            w.write(memoryview(buf)[:n])
            done(piece, n, extra)
            free.append(buf)

        try:
            for piece in pieces:
                if len(pending) >= window:
                    write_oldest()
                buf = free.pop() if free else np.empty(piece_bytes, np.uint8)
                pending.append((ex.submit(read, piece, buf), piece, buf))
            while pending:
                write_oldest()
        except BaseException:
            for fut, _, _ in pending:
                fut.cancel()
            raise


def _commit(staging: SaveStaging, out: Metadata, token: str) -> None:
    """Commit a converted checkpoint as a save does: format 2 for large ones (the chunk index first), the
    commit record last."""
    index_name = index_file_name(token)
    record, index = out.encode(index_name)
    if index is not None:
        with staging.create(index_name, "chunk index") as w:
            w.write(index)
    staging.commit(record)


def hf_to_dcp(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False, threads: int = 4,
              buffer_bytes: int = 16 << 20, checksum_block_bytes: int | None = None, quiet: bool = True,
              storage_options: dict | None = None) -> ConvertResult:
    """Convert an HF safetensors file/directory into a hyperdcp checkpoint at ``dst``, streaming.

    Each source shard becomes one data file, written through ``dst``'s
    :class:`~hyperdcp.storage.base.Storage` like any save (a local directory: a temporary directory,
    fsyncs and an atomic swap; ``s3://``: objects under a per-save token, the commit record last):
    tensors are read in pieces of ``buffer_bytes`` by ``threads`` threads (memory: about threads x
    buffer_bytes), checksummed, appended in order, then committed.

    Args:
        src: a ``.safetensors`` file, a model directory (with or without an index) or a hub snapshot.
        dst: the checkpoint to create: a directory, an ``s3://`` URL, or a URL of a scheme registered
            with :func:`~hyperdcp.storage.register_storage`.
        overwrite: replace an existing checkpoint at ``dst`` (atomically, as a save does).
        threads, buffer_bytes: copy parallelism and piece size.
        checksum_block_bytes: checksum block size (default: the format's).
        quiet: no progress bar.
        storage_options: the storage's options for a URL ``dst`` (as for :func:`hyperdcp.save`).

    Returns:
        a :class:`~hyperdcp.ConvertResult` (tensors, bytes, files written, seconds).

    Raises:
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is False; FormatError: a damaged source
        file; StorageError: ``dst`` is ``src``'s own directory, or a write failed;
        UnsupportedStorageError: ``dst`` is a URL hyperdcp cannot save to.

    Example::

        hf_to_hyperdcp("models/llama", "ckpt/step-0")
        hf_to_hyperdcp("models/llama", "s3://bucket/ckpt/step-0")
    """
    from ..format.metadata import DEFAULT_BLOCK_BYTES

    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    dst = save_path(dst)  # a local directory, or a URL hyperdcp saves to (others: UnsupportedStorageError)
    source = HuggingFaceSource.open(src)
    meta = source.metadata
    if not is_remote(dst) and os.path.realpath(dst) == os.path.realpath(source.root):
        raise StorageError(f"cannot convert {src!r} into its own directory; choose another destination")
    storage = storage_for(dst, storage_options)
    B = checksum_block_bytes or DEFAULT_BLOCK_BYTES
    piece_bytes = max(B, buffer_bytes // B * B)
    out_files: list[FileMeta] = []
    tensors: dict[str, TensorMeta] = {}
    reader = source.reader()
    staging = None
    try:
        staging = storage.begin_save(overwrite=overwrite)
        token = save_token(os.path.basename(staging.location.rstrip("/")))  # as a save names its files
        by_file: dict[int, list[str]] = {}
        for name, t in meta.tensors.items():
            if t.nbytes:
                by_file.setdefault(int(t.chunks.file[0]), []).append(name)
            else:  # an empty tensor has no chunk in the hyperdcp format
                nd = len(t.shape)
                z = np.zeros(0, np.int64)
                tensors[name] = TensorMeta(t.dtype, t.shape, ChunkTable(np.zeros((0, nd), np.int64),
                                                                        np.zeros((0, nd), np.int64), z, z, z, []))
        progress = Progress(sum(t.nbytes for t in meta.tensors.values()), "hf -> hyperdcp", quiet)
        digests: dict[str, list[str]] = {}  # tensor -> the block checksums of its pieces, in order

        def read(piece: tuple, buf: np.ndarray) -> tuple[int, str]:  # a copy thread: read and checksum a piece
            fi, name, off, n = piece
            mv = memoryview(buf)[:n]
            reader.read_into(fi, int(meta.tensors[name].chunks.begin[0]) + off, mv, f"tensor {name!r}")
            return n, block_digests(mv, B)

        def done(piece: tuple, n: int, sums: str) -> None:  # the writer, in file order
            digests[piece[1]].append(sums)
            progress.update(n)

        try:
            for k, (fi, names) in enumerate(sorted(by_file.items())):
                names.sort(key=lambda n: int(meta.tensors[n].chunks.begin[0]))
                out_name = data_file_name(0, k, token)
                stubs = [ChunkToWrite(n, meta.tensors[n].dtype, meta.tensors[n].shape,
                                      SimpleNamespace(size=meta.tensors[n].nbytes)) for n in names]
                header, starts = build_header(stubs)
                total = len(header) + sum(st.data.size for st in stubs)
                pieces = [(fi, n, off, min(piece_bytes, meta.tensors[n].nbytes - off))
                          for n in names for off in range(0, meta.tensors[n].nbytes, piece_bytes)]
                digests.update({n: [] for n in names})
                _stream_file(staging, out_name, header, pieces, read, done, threads, piece_bytes)
                for n, s0 in zip(names, starts):
                    t = meta.tensors[n]
                    ch, begin = t.chunks, len(header) + s0
                    tensors[n] = TensorMeta(t.dtype, t.shape, ChunkTable(
                        ch.offsets.copy(), ch.lengths.copy(), np.array([k], np.int64), np.array([begin], np.int64),
                        np.array([begin + t.nbytes], np.int64), ["".join(digests[n])]))
                out_files.append(FileMeta(out_name, total))
        finally:
            progress.close()
        ordered = {n: tensors[n] for n in meta.tensors}
        user = {"converted_from": "huggingface-safetensors", **({"hf_metadata": meta.user["hf_metadata"]}
                                                                   if meta.user.get("hf_metadata") else {})}
        out = Metadata(world_size=1, files=out_files, tensors=ordered, values={}, checksum_block_bytes=B, user=user)
        _commit(staging, out, token)
    except BaseException:
        if staging is not None:
            staging.abort()
        raise
    finally:
        if staging is not None:
            staging.release()
        reader.close()
    where = storage.root if isinstance(storage, LocalStorage) else storage.url
    return ConvertResult(src, where, len(meta.tensors), meta.tensor_bytes, [f.name for f in out_files],
                         time.perf_counter() - t0)


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

    Args:
        src: anything :func:`~hyperdcp.open_source` opens.
        dst: the output directory (``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards
            plus ``model.safetensors.index.json``).
        max_shard_size: bytes per shard (an int or ``"5GB"``, ``"500MiB"``).
        dtype, values_file, include, exclude, strip_prefix: as above.
        overwrite: replace existing safetensors files in ``dst``.
        threads, budget_bytes, quiet: parallelism, memory in flight, no progress bar.

    Returns:
        a :class:`~hyperdcp.ConvertResult` (tensors, bytes, the shard names, skipped values, seconds).

    Raises:
        CheckpointExistsError: ``dst`` holds safetensors files and ``overwrite`` is False;
        MismatchError: ``include``/``exclude`` select no tensor, or ``strip_prefix`` leaves a key empty;
        FormatError: a tensor name safetensors cannot hold; StorageError: a write failed.

    Example::

        hyperdcp_to_hf("ckpt/step-100", "export/", include=["model."], strip_prefix="model.")
    """
    from ..format import values as values_codec
    from ..planning.load_plan import TensorIndex

    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    if is_remote(dst):
        raise UnsupportedStorageError(
            f"cannot export to {dst!r}: hyperdcp-to-hf writes HF files into a local (or mounted) directory; export "
            "there and upload the directory, or keep a hyperdcp checkpoint at the URL (hf-to-hyperdcp writes to s3://)")
    source = open_source(src)
    src_meta = source.metadata
    meta, origin = select_keys(src_meta, include, exclude, strip_prefix, where=repr(src))
    _check_utf8_names(meta, src)
    cast = parse_dtype(dtype) if dtype else None
    limit = parse_size(max_shard_size)
    out_code = {n: (cast if cast and t.dtype in FLOAT_CODES else t.dtype) for n, t in meta.tensors.items()}
    if "__metadata__" in meta.tensors:
        raise FormatError(f"{src!r}: a tensor is named '__metadata__', which safetensors reserves; rename it first")
    out_bytes = {n: t.nbytes // dtypes.itemsize(t.dtype) * dtypes.itemsize(out_code[n])
                 for n, t in meta.tensors.items()}
    shards = plan_shards(out_bytes, limit)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    if os.path.realpath(dst) == os.path.realpath(source.root):
        raise StorageError(f"cannot convert {src!r} into its own directory; choose another destination")
    _prepare_hf_dir(dst, overwrite)
    hf_meta = meta.user.get("hf_metadata") if isinstance(meta.user.get("hf_metadata"), dict) else None
    hf_meta = {str(k): str(v) for k, v in (hf_meta or {"format": "pt"}).items()}
    files = source.reader()  # data is read under the stored names
    index = TensorIndex(src_meta)
    token = secrets.token_hex(4)
    partial = [os.path.join(dst, f".{nm}.{token}.partial") for nm in names]
    fds: list[int] = []
    jobs = []
    try:
        for si, shard in enumerate(shards):
            # like the safetensors library: larger alignment first, then name, so every tensor stays aligned
            shard.sort(key=lambda nm: (-dtypes.itemsize(out_code[nm]), nm))
            header, starts = _hf_header([(nm, out_code[nm], meta.tensors[nm].shape, out_bytes[nm]) for nm in shard],
                                        hf_meta)
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
                buf = read_box(files, src_meta, origin[nm], full_box(t.shape), verify=source.verifiable, index=index)
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
            _write_small(values_file,
                         json.dumps({"format": "hyperdcp-values", "values": enc}, indent=1).encode() + b"\n")
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
    existing = [n for n in os.listdir(dst)
                if n.endswith(".safetensors") or n.endswith(INDEX_SUFFIX) or n == METADATA_FILE]
    if existing and not overwrite:
        raise CheckpointExistsError(
            f"{dst!r} already holds {existing[:3]}; "
            "pass --overwrite (overwrite=True) to replace them or choose an empty directory"
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
