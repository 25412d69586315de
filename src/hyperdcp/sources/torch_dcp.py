"""torch.distributed.checkpoint (torch DCP) checkpoints as a source: opt-in (``source="torch-dcp"``), never
probed automatically, because reading one means unpickling its ``.metadata``.

Two layouts torch writes:

* ``FileSystemWriter`` (``dcp.save``/``dcp.async_save``'s default): a pickled ``.metadata`` and ``*.distcp``
  data files, each a sequence of ``torch.save`` records (zip archives), one per tensor chunk or value;
* torch's safetensors serialization (``HuggingFaceStorageWriter``, also with ``save_distributed``):
  ``*.safetensors`` files whose header's ``DCP_SHARDING_INFO`` gives each chunk's offsets
  (:mod:`.torch_dcp_safetensors`; nothing is unpickled there).

The ``.metadata`` is read by :mod:`.torch_dcp_pickle` (an allow-list of torch's metadata records, inert
stand-ins, every other global refused by name); each chunk's record is located from its zip directory
(:mod:`.torch_zip`) and its ``data.pkl`` parsed by the same restricted unpickler, so a chunk becomes an
ordinary byte range ``[begin, end)`` of its data file and loads read only the bytes they need. Values
(``BytesStorageMetadata``) are decoded when they are plain (None, bool, int, float, str, bytes and
containers); others, and tensors stored in a layout hyperdcp cannot address (non-C-contiguous
strides), are listed in :attr:`TorchDcpSource.unreadable` by key and fail a load only when asked for.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ..core import dtypes
from ..errors import CheckpointNotFoundError, FormatError, UnsupportedStorageError
from ..format import values as values_codec
from ..format.metadata import FILE_NAME_RE, ChunkTable, FileMeta, Metadata, TensorMeta, max_metadata_bytes
from ..storage.safe_open import open_regular, pread_exact
from ..storage.threads import run_all
from ..storage.urls import is_remote
from . import torch_dcp_pickle as tp
from .base import ChunkReader, Source
from .torch_zip import read_record

METADATA_NAME = ".metadata"
#: threads locating records when a checkpoint is opened
OPEN_THREADS = 8
_TENSOR = object()


class TorchDcpSource(Source):
    """A torch DCP checkpoint directory: its data files, and chunks located inside their records."""

    kind = "torch-dcp"
    verifiable = False

    def __init__(self, root: str, metadata: Metadata, unreadable: dict[str, str] | None = None,
                 layout: str = "torch_save"):
        self.root, self.metadata, self.layout = root, metadata, layout
        #: key -> why hyperdcp does not read it (a pickled object of a class it does not construct, ...)
        self.unreadable = dict(unreadable or {})
        #: (key, chunk) -> the zip CRC-32 of a chunk that is a whole stored storage (on the opening rank only)
        self.crc: dict[tuple[str, int], int] = {}

    @classmethod
    def probe(cls, path: str) -> str | None:
        p = os.fspath(path)
        if is_remote(p):
            return "torch DCP checkpoints are read from local paths only"
        if os.path.isfile(os.path.join(p, METADATA_NAME)):
            return None
        from .torch_dcp_safetensors import is_dcp_safetensors_dir

        return None if is_dcp_safetensors_dir(p) else f"no {METADATA_NAME}"

    @classmethod
    def open(cls, path: str) -> "TorchDcpSource":
        root = os.fspath(path)
        if is_remote(root):
            raise UnsupportedStorageError(f"{root!r}: torch DCP checkpoints are read from local paths only; download "
                                          "it first (or convert it with hyperdcp convert torch-dcp-to-hyperdcp)")
        if not os.path.isdir(root):
            raise CheckpointNotFoundError(f"no torch DCP checkpoint at {root!r}: the directory does not exist")
        mpath = os.path.join(root, METADATA_NAME)
        if not os.path.lexists(mpath):
            from .torch_dcp_safetensors import is_dcp_safetensors_dir, read_safetensors_dir

            if is_dcp_safetensors_dir(root):
                return cls(root, read_safetensors_dir(root), layout="safetensors")
            raise CheckpointNotFoundError(
                f"{root!r} is not a torch DCP checkpoint: it has no {METADATA_NAME} (the save did not finish, or the "
                "checkpoint is of another kind: load it without source='torch-dcp')")
        fd, size = open_regular(mpath, "torch DCP metadata file")
        try:
            if size > max_metadata_bytes():
                raise FormatError(f"{mpath}: {size} bytes exceeds the {max_metadata_bytes()}-byte metadata limit "
                                  "(HYPERDCP_MAX_METADATA_BYTES raises it)")
            raw = pread_exact(fd, size, 0, mpath)
        finally:
            os.close(fd)
        meta, unreadable, crc = _from_pickle(root, tp.load_metadata(raw, mpath))
        out = cls(root, meta, unreadable)
        out.crc = crc
        return out

    def reader(self) -> ChunkReader:
        return ChunkReader(self.root, self.metadata, check_headers=False)

    def payload(self) -> bytes:
        m = self.metadata
        tensors = []
        for k, t in m.tensors.items():
            c = t.chunks
            tensors.append([k, t.dtype, list(t.shape), c.offsets.tolist(), c.lengths.tolist(), c.file.tolist(),
                            c.begin.tolist(), c.end.tolist()])
        doc = {"root": self.root, "layout": self.layout, "files": [[f.name, f.nbytes] for f in m.files],
               "tensors": tensors, "values": {k: values_codec.encode(v, k) for k, v in m.values.items()},
               "unreadable": self.unreadable, "user": m.user}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_payload(cls, raw: bytes) -> "TorchDcpSource":
        doc = json.loads(raw.decode())
        tensors = {}
        for k, dt, shape, offs, lens, fi, b, e in doc["tensors"]:
            nd = len(shape)
            tensors[k] = TensorMeta(dt, tuple(shape), ChunkTable(
                np.array(offs, np.int64).reshape(len(b), nd), np.array(lens, np.int64).reshape(len(b), nd),
                np.array(fi, np.int64), np.array(b, np.int64), np.array(e, np.int64), [""] * len(b)))
        values = {k: values_codec.decode(v, f"value {k!r}") for k, v in doc["values"].items()}
        meta = make_metadata([FileMeta(n, s) for n, s in doc["files"]], tensors, values, doc["user"])
        return cls(doc["root"], meta, doc["unreadable"], doc["layout"])


def make_metadata(files: list[FileMeta], tensors: dict[str, TensorMeta], values: dict[str, Any],
                  user: dict) -> Metadata:
    """The :class:`Metadata` of a torch DCP source (no checksums, world size unknown: 1)."""
    return Metadata(world_size=1, files=files, tensors=tensors, values=values, format_version=0,
                    library_version="torch-dcp", created_unix=0.0, user=user)


def check_file_name(root: str, name: Any, key: str) -> str:
    """A data file named by the metadata must be a plain name inside the checkpoint directory."""
    if type(name) is not str or not FILE_NAME_RE.fullmatch(name) or name in (".", ".."):
        raise FormatError(f"{os.path.join(root, METADATA_NAME)}: {key!r} is stored in {str(name)[:100]!r}, which is "
                          "not a plain file name inside the checkpoint directory; the metadata is damaged or crafted")
    return name


# -- the pickled layout ------------------------------------------------------------------------------
def _from_pickle(root: str, md: tp.Metadata) -> tuple[Metadata, dict[str, str], dict[tuple[str, int], int]]:
    where = os.path.join(root, METADATA_NAME)
    storage = md.get("storage_data")
    if not isinstance(storage, dict):
        raise FormatError(f"{where}: has no storage_data (written by a storage writer other than FileSystemWriter?)")
    by_index = {k.key(): v for k, v in storage.items() if isinstance(k, tp.MetadataIndex)}
    files: dict[str, int] = {}
    jobs: list[tuple] = []  # (fqn, chunk no, file name, offset, length, dtype, sizes) or (fqn, None, ...)
    shapes: dict[str, tuple[str, tuple[int, ...], int]] = {}
    value_keys: list[str] = []
    for fqn, entry in md.state_dict_metadata.items():
        if type(fqn) is not str or not fqn:
            raise FormatError(f"{where}: a key of state_dict_metadata is {fqn!r}, not a non-empty string")
        if isinstance(entry, tp.BytesStorageMetadata):
            info = by_index.get((fqn, None))
            value_keys.append(fqn)
            jobs.append((fqn, None, *_storage(root, fqn, info, files), None, None))
            continue
        if not isinstance(entry, tp.TensorStorageMetadata):
            raise FormatError(f"{where}: entry {fqn!r} is a {type(entry).__name__}, not tensor or bytes metadata")
        props, size, chunks = entry.get("properties"), entry.get("size"), entry.get("chunks")
        dt = props.get("dtype") if isinstance(props, tp.TensorProperties) else None
        if not isinstance(dt, tp.DType):
            raise FormatError(f"{where}: tensor {fqn!r} has no dtype hyperdcp knows ({dt!r})")
        if not isinstance(size, tuple) or not isinstance(chunks, list) or len(size) > 64:
            raise FormatError(f"{where}: tensor {fqn!r} has a malformed size or chunk list")
        shapes[fqn] = (str(dt), size, len(chunks))
        for i, ch in enumerate(chunks):
            offs, sizes = ch.get("offsets") if isinstance(ch, tp.ChunkStorageMetadata) else None, ch.get("sizes")
            if (not isinstance(offs, tuple) or not isinstance(sizes, tuple) or len(offs) != len(size)
                    or len(sizes) != len(size)
                    or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offs, sizes, size))):
                raise FormatError(f"{where}: tensor {fqn!r} chunk {i} (offsets {offs}, sizes {sizes}) does not fit "
                                  f"its shape {tuple(size)}")
            info = by_index.get((fqn, offs))
            jobs.append((fqn, i, *_storage(root, fqn, info, files), offs, sizes))
    names = sorted(files)
    for n in names:
        files[n] = _file_size(root, n)
    fidx = {n: i for i, n in enumerate(names)}
    fds: dict[str, int] = {}
    try:
        for n in names:
            fds[n], _ = open_regular(os.path.join(root, n), "torch DCP data file")
        results = run_all(lambda j: _locate(root, fds, files, shapes, j), jobs, OPEN_THREADS)
    finally:
        for fd in fds.values():
            os.close(fd)
    located: dict[str, list] = {}
    flat_values: dict[str, Any] = {}
    unreadable: dict[str, str] = {}
    for job, res in zip(jobs, results):
        fqn = job[0]
        if isinstance(res, _Unreadable):
            unreadable.setdefault(fqn, res.why)
        elif job[1] is None:
            flat_values[fqn] = res
        else:
            located.setdefault(fqn, []).append((job[5], job[6], fidx[job[2]], *res))
    tensors: dict[str, TensorMeta] = {}
    crc: dict[tuple[str, int], int] = {}
    for fqn, (dt, size, _n) in shapes.items():
        if fqn in unreadable:
            continue
        rows = located.get(fqn, [])
        crc.update({(fqn, i): r[5] for i, r in enumerate(rows) if r[5] is not None})
        nd = len(size)
        _check_cover(where, fqn, size, [r[1] for r in rows])
        tensors[fqn] = TensorMeta(dt, tuple(size), ChunkTable(
            np.array([r[0] for r in rows], np.int64).reshape(len(rows), nd),
            np.array([r[1] for r in rows], np.int64).reshape(len(rows), nd),
            np.array([r[2] for r in rows], np.int64), np.array([r[3] for r in rows], np.int64),
            np.array([r[4] for r in rows], np.int64), [""] * len(rows)))
    planner = md.get("planner_data") if isinstance(md.get("planner_data"), dict) else {}
    values, bad = nest_values(flat_values, set(shapes), unreadable, planner)
    unreadable.update(bad)
    user = {"torch_dcp_version": str(md.get("version") or "")}
    return make_metadata([FileMeta(n, files[n]) for n in names], tensors, values, user), unreadable, crc


def _storage(root: str, fqn: str, info: Any, files: dict[str, int]) -> tuple[str, int, int]:
    where = os.path.join(root, METADATA_NAME)
    if not isinstance(info, tp.StorageInfo):
        raise FormatError(f"{where}: {fqn!r} has no storage entry; the metadata is incomplete")
    name = check_file_name(root, info.get("relative_path"), fqn)
    off, n = info.get("offset"), info.get("length")
    if type(off) is not int or type(n) is not int or off < 0 or n < 0:
        raise FormatError(f"{where}: {fqn!r} has storage offset {off!r} / length {n!r}")
    if info.get("transform_descriptors"):
        raise FormatError(f"{where}: {fqn!r} was written through stream transforms {info.transform_descriptors!r} "
                          "(torch DCP extensions such as compression), which hyperdcp does not read; load it with "
                          "torch.distributed.checkpoint")
    files[name] = 0
    return name, off, n


def _file_size(root: str, name: str) -> int:
    fd, size = open_regular(os.path.join(root, name), "torch DCP data file")
    os.close(fd)
    return size


class _Unreadable:
    def __init__(self, why: str):
        self.why = why


def _locate(root: str, fds: dict[str, int], sizes: dict[str, int], shapes: dict, job: tuple) -> Any:
    """Locate one record: a tensor chunk's ``(begin, end)`` in its file, or a value decoded."""
    fqn, chunk, name, base, length, offs, csizes = job
    path = os.path.join(root, name)
    if base + length > sizes[name]:
        raise FormatError(f"{path}: {fqn!r} is recorded at bytes {base}..{base + length} but the file has "
                          f"{sizes[name]} bytes; the data file is truncated")
    where = f"{path} (record of {fqn!r} at byte {base})"
    fd = fds[name]

    def pread(n: int, off: int) -> bytes:
        return pread_exact(fd, n, base + off, path)

    rec = read_record(pread, length, where)
    if "byteorder" in rec.entries and rec.data("byteorder", pread, where) != b"little":
        return _Unreadable(f"stored big-endian ({where}); load it with torch.distributed.checkpoint")
    pkl = rec.data("data.pkl", pread, where)
    if chunk is None:
        try:
            value = tp.load_record_pickle(pkl, where, tensors=False)
        except tp.Refused as e:
            return _Unreadable(f"a pickled {e.global_name} object, which hyperdcp does not unpickle")
        if not values_codec.is_plain(value):
            return _Unreadable(f"a {type(value).__name__} value, not a plain value hyperdcp stores")
        return value
    st = tp.load_record_pickle(pkl, where, tensors=True)
    if not isinstance(st, tp.StoredTensor):
        raise FormatError(f"{where}: holds a {type(st).__name__}, not a tensor")
    dt = shapes[fqn][0]
    item = dtypes.itemsize(dt)
    if st.storage.dtype != dt or st.size != tuple(csizes):
        raise FormatError(f"{where}: holds a {st.storage.dtype} tensor of shape {st.size}, but the metadata "
                          f"records {dt} {tuple(csizes)} for chunk {chunk}; the checkpoint is damaged")
    key = f"data/{st.storage.key}"
    if key not in rec.entries:
        raise FormatError(f"{where}: its storage {key!r} is missing from the record")
    soff, sbytes = rec.entries[key]
    numel = int(np.prod(csizes, dtype=np.int64)) if csizes else 1
    if sbytes != st.storage.numel * item or (st.storage_offset + numel) * item > sbytes and numel:
        raise FormatError(f"{where}: storage of {sbytes} bytes does not hold {numel} elements of {dt} at element "
                          f"{st.storage_offset}; the record is damaged")
    if numel > 1 and not _c_contiguous(st.size, st.stride):
        return _Unreadable(f"stored with strides {st.stride} (not row-major) in {where}; load it with "
                           "torch.distributed.checkpoint")
    begin = base + soff + st.storage_offset * item
    whole = st.storage_offset == 0 and numel * item == sbytes
    return begin, begin + numel * item, rec.crcs.get(key) if whole else None


def _c_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    want = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


def _check_cover(where: str, fqn: str, size: tuple, lengths: list) -> None:
    total = int(np.prod(size, dtype=np.int64)) if size else 1
    have = sum(int(np.prod(n, dtype=np.int64)) if len(n) else 1 for n in lengths)
    if total and have < total:
        raise FormatError(f"{where}: the chunks of tensor {fqn!r} cover {have} of its {total} elements; the "
                          "checkpoint is incomplete")


# -- values: torch flattens nested containers, hyperdcp keeps plain subtrees whole --------------------
def nest_values(flat: dict[str, Any], tensors: set[str], unreadable: dict[str, str],
                planner: dict) -> tuple[dict[str, Any], dict[str, str]]:
    """Values under hyperdcp's keys: each maximal subtree without tensors, rebuilt from torch's flat keys
    (``planner_data`` gives each flat key's path: str for dict keys, int for list positions).

    Returns ``(values, unreadable)``: a subtree holding an unreadable value is unreadable itself.
    """
    tree: dict = {}
    for key in list(flat) + list(tensors) + list(unreadable):
        path = planner.get(key)
        if not isinstance(path, (tuple, list)) or not path or not all(type(p) in (str, int) for p in path):
            path = (key,)
        node = tree
        for p in path[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                nxt = node[p] = {}
            node = nxt
        node[path[-1]] = _TENSOR if key in tensors else (_Bad(unreadable[key]) if key in unreadable else flat[key])
    values: dict[str, Any] = {}
    bad: dict[str, str] = {}

    def walk(node: Any, fqn: str) -> None:
        state = _scan(node)
        if fqn and state is None:
            values[fqn] = _build(node)
        elif fqn and isinstance(state, _Bad):
            bad[fqn] = state.why
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{fqn}.{k}" if fqn else str(k))

    walk(tree, "")
    return values, bad


class _Bad:
    def __init__(self, why: str):
        self.why = why


def _scan(node: Any) -> Any:
    """``_TENSOR`` when a tensor is below ``node``, else the first ``_Bad`` below it, else None."""
    if node is _TENSOR or isinstance(node, _Bad):
        return node
    found = None
    if isinstance(node, dict):
        for v in node.values():
            s = _scan(v)
            if s is _TENSOR:
                return s
            found = found or s
    return found


def _build(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if node and all(type(k) is int for k in node) and sorted(node) == list(range(len(node))):
        return [_build(node[i]) for i in range(len(node))]
    return {k: _build(v) for k, v in node.items()}
