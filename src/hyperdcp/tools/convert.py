"""Conversions between HuggingFace safetensors and hyperdcp, streaming.

hf -> hyperdcp copies each tensor in bounded pieces (checksummed as written) and commits like any save;
hyperdcp (or any source) -> hf assembles one tensor at a time through the verified reader, several
tensors in flight under a byte budget, each written at its precomputed offset in its shard. Both read
through :func:`hyperdcp.sources.open_source`, so hub snapshots are accepted as sources.

    hf_to_hyperdcp("hf-model/", "ckpt/step-0")
    hyperdcp_to_hf("ckpt/step-100", "export/", include=["model."], strip_prefix="model.")
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import threading
import time
from types import SimpleNamespace
from typing import Sequence

import numpy as np

from ..core import dtypes
from ..core.boxes import full_box
from ..errors import CheckpointExistsError, FormatError, MismatchError, StorageError
from ..format.metadata import METADATA_FILE, ChunkTable, FileMeta, Metadata, TensorMeta
from ..format.record_v2 import index_file_name
from ..loading.reads import read_box
from ..results import ConvertResult
from ..sources.base import open_source, rename_keys
from ..sources.huggingface import INDEX_FILE, INDEX_SUFFIX, SINGLE_FILE, HuggingFaceSource
from ..storage.checksum import block_digests
from ..storage.data_file import MAX_HEADER_BYTES, ChunkToWrite, build_header
from ..storage.threads import run_all
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
def hf_to_dcp(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False, threads: int = 4,
              buffer_bytes: int = 16 << 20, checksum_block_bytes: int | None = None, quiet: bool = True) -> ConvertResult:
    """Convert an HF safetensors file/directory into a hyperdcp checkpoint at ``dst``, streaming.

    Each source shard becomes one data file; tensors are copied in pieces of ``buffer_bytes`` by
    ``threads`` threads (memory: about threads x buffer_bytes), checksummed as written, then committed
    atomically like any save.

    Args:
        src: a ``.safetensors`` file, a model directory (with or without an index) or a hub snapshot.
        dst: the checkpoint directory to create.
        overwrite: replace an existing checkpoint at ``dst`` (atomically, as a save does).
        threads, buffer_bytes: copy parallelism and piece size.
        checksum_block_bytes: checksum block size (default: the format's).
        quiet: no progress bar.

    Returns:
        a :class:`~hyperdcp.ConvertResult` (tensors, bytes, files written, seconds).

    Raises:
        CheckpointExistsError: ``dst`` exists and ``overwrite`` is False; FormatError: a damaged source
        file; StorageError: ``dst`` is ``src``'s own directory, or a write failed.

    Example::

        hf_to_hyperdcp("models/llama", "ckpt/step-0")
    """
    from ..format.metadata import DEFAULT_BLOCK_BYTES
    from ..storage.commit import SaveTarget

    t0 = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    from ..storage.urls import local_save_path

    dst = local_save_path(dst)  # URLs: UnsupportedStorageError (convert locally, then upload or hyperdcp.save)
    source = HuggingFaceSource.open(src)
    meta = source.metadata
    if os.path.realpath(dst) == os.path.realpath(source.root):
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
                src_fd, _ = source.open_file(meta.files[fi].name)
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
                    _pread_into(src_fd, mv, begin + done, source.file_path(meta.files[meta.tensors[name].chunks.file[0]].name))
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
        index_name = index_file_name(secrets.token_hex(6))
        record, index = out.encode(index_name)  # format 2 for large models: the index first, the record last
        if index is not None:
            _write_small(os.path.join(tmp, index_name), index)
        target.commit(record)
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
    source = open_source(src)
    src_meta = source.metadata
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
