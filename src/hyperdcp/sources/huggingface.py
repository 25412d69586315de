"""HuggingFace safetensors checkpoints as a source: a single ``.safetensors`` file, a directory with
``model.safetensors.index.json`` (sharded), with ``model.safetensors``, or with other ``*.safetensors``
files, and HuggingFace hub cache snapshots.

Headers are parsed strictly (:func:`~hyperdcp.storage.data_file.read_header`) into a plain
:class:`~hyperdcp.format.metadata.Metadata`: one chunk per tensor covering it whole, the shard files
as data files, no checksums (HF files carry none: ``verifiable`` is False, loads skip verification for
this source only). The ordinary load path then reads just the bytes each rank needs.

Links: a file inside the directory that is a symbolic link is refused, except in a hub cache snapshot
(``<cache>/models--org--name/snapshots/<rev>/``), whose files are links into the same repository
folder's ``blobs/``: a link that resolves inside that ``models--*`` folder is followed (resolved once, on
open, and the resolved file is opened without following links); every other link stays refused.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from ..errors import CheckpointNotFoundError, FormatError, IncompleteCheckpointError
from ..format.metadata import METADATA_FILE, ChunkTable, FileMeta, Metadata, TensorMeta
from ..storage.data_file import read_header
from ..storage.safe_open import open_regular, pread_exact
from ..storage.urls import is_remote
from .base import ChunkReader, Source

INDEX_SUFFIX = ".safetensors.index.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 100_000_000
#: the kinds of HuggingFace hub cache repository folders (``<kind>s--org--name``)
HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


class HuggingFaceSource(Source):
    """HF safetensors files under ``root``; ``links`` maps file names to their resolved hub blobs."""

    kind = "huggingface"
    verifiable = False

    def __init__(self, root: str, metadata: Metadata, index_file: str | None = None,
                 links: dict[str, str] | None = None):
        self.root, self.metadata, self.index_file = root, metadata, index_file
        self.links = links or {}

    @classmethod
    def probe(cls, path: str) -> str | None:
        if is_remote(path):
            return "HuggingFace files are read from local paths only (download them first)"
        path = os.fspath(path)
        if os.path.isfile(path):
            return None if path.endswith(".safetensors") else "not a .safetensors file"
        if not os.path.isdir(path):
            return "the path does not exist"
        if os.path.exists(os.path.join(path, METADATA_FILE)):
            return f"it has {METADATA_FILE}"
        try:
            names = os.listdir(path)
        except OSError as e:
            return f"its directory cannot be listed ({e.strerror or e})"
        if any(n.endswith(".safetensors") or n.endswith(INDEX_SUFFIX) for n in names):
            return None
        return "no *.safetensors file or *.safetensors.index.json in it"

    @classmethod
    def open(cls, path: str) -> "HuggingFaceSource":
        return read_source(path)

    def reader(self) -> ChunkReader:
        links = {i: self.links[f.name] for i, f in enumerate(self.metadata.files) if f.name in self.links}
        return ChunkReader(self.root, self.metadata, check_headers=False, links=links)

    def file_path(self, name: str) -> str:
        """The path to open for file ``name`` (its resolved blob in a hub snapshot)."""
        return self.links.get(name) or os.path.join(self.root, name)

    def open_file(self, name: str) -> tuple[int, int]:
        """``(fd, size)`` of file ``name``, opened without following links (hub blobs already resolved)."""
        return _open_regular(self.file_path(name))

    def payload(self) -> bytes:
        m = self.metadata
        tensors = [[k, t.dtype, list(t.shape), int(t.chunks.file[0]), int(t.chunks.begin[0]), int(t.chunks.end[0])]
                   for k, t in m.tensors.items()]
        doc = {"root": self.root, "index": self.index_file, "files": [[f.name, f.nbytes] for f in m.files],
               "tensors": tensors, "user": m.user, "links": self.links}
        return json.dumps(doc).encode()

    @classmethod
    def from_payload(cls, raw: bytes) -> "HuggingFaceSource":
        doc = json.loads(raw.decode())
        tensors = {k: _whole_tensor(c, tuple(s), fi, b, e) for k, c, s, fi, b, e in doc["tensors"]}
        return cls(doc["root"], _metadata([FileMeta(n, b) for n, b in doc["files"]], tensors, doc["user"]),
                   doc["index"], doc["links"])


def _metadata(files: list[FileMeta], tensors: dict[str, TensorMeta], user: dict) -> Metadata:
    return Metadata(world_size=1, files=files, tensors=tensors, values={}, format_version=0,
                    library_version="huggingface-safetensors", created_unix=0.0, user=user)


def is_hf_source(path: str | os.PathLike) -> bool:
    """True when ``path`` is a ``.safetensors`` file, or a directory without ``hyperdcp.json`` that
    holds safetensors files or an HF index (an incomplete hyperdcp checkpoint is caught on open)."""
    return HuggingFaceSource.probe(os.fspath(path)) is None


# -- discovery ---------------------------------------------------------------------------------
def _check_plain_name(root: str, name: Any, where: str) -> str:
    """A file name from an index must be a plain name of a regular, non-link file inside ``root``."""
    if (type(name) is not str or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name or os.path.isabs(name) or name != os.path.basename(name)):
        raise FormatError(
            f"{where}: shard file name {name!r} is not a plain file name inside the checkpoint directory "
            "(no paths, '..' or absolute names); fix or regenerate the index"
        )
    return name


def hub_repo(root: str) -> str | None:
    """The repository folder (``.../models--org--name``) when ``root`` is a hub cache snapshot, else None."""
    real = os.path.realpath(root)
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith(HUB_REPO_PREFIXES):
        return repo
    return None


def _resolve(root: str, name: str, repo: str | None, links: dict[str, str]) -> str:
    """The path to open for ``root/name``: itself, or in a hub snapshot the blob its link resolves to."""
    path = os.path.join(root, name)
    if repo is None or not os.path.islink(path):
        return path
    target = os.path.realpath(path)
    if os.path.commonpath([target, repo]) != repo:
        raise FormatError(
            f"{path} is a symbolic link to {target!r}, outside its hub cache repository {repo!r}; hyperdcp follows "
            "links of a hub snapshot only into its own repository folder: re-download it (huggingface_hub "
            "snapshot_download) or copy the files"
        )
    links[name] = target
    return target


def _open_regular(path: str) -> tuple[int, int]:
    """Open through the checkpoint's one path: no links followed, non-blocking (a FIFO cannot hang), regular
    files only."""
    try:
        return open_regular(path, "safetensors file", missing=FileNotFoundError)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"safetensors file {path} does not exist; the HF checkpoint is incomplete"
        ) from None
    except FormatError as e:
        if "symbolic link" in str(e):
            raise FormatError(
                f"{path} is a symbolic link; hyperdcp never follows links inside a checkpoint (copy the files, "
                "e.g. snapshot_download(local_dir=...), or pass the link's target file)"
            ) from None
        raise


def _read_index(root: str, name: str, path: str) -> dict[str, str]:
    fd, size = _open_regular(path)
    try:
        if size > MAX_INDEX_BYTES:
            raise FormatError(f"{path}: index of {size} bytes exceeds the {MAX_INDEX_BYTES}-byte limit")
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


def hf_files(path: str | os.PathLike, links: dict[str, str] | None = None
             ) -> tuple[str, list[str], dict[str, str] | None, str | None]:
    """``(root, shard file names, weight map or None, index file name or None)`` of an HF source.

    ``links`` collects the resolved blob of each linked file of a hub snapshot (index included).
    """
    links = {} if links is None else links
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise FormatError(f"{path!r} is not a .safetensors file; pass a safetensors file or an HF model directory")
        root, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
        if os.path.islink(path):
            links[name] = os.path.realpath(path)  # the user named this file: resolve it once, explicitly
        return root, [name], None, None
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path!r}: the path does not exist; check the path")
    names = sorted(os.listdir(path))
    if METADATA_FILE in names:
        raise FormatError(f"{path!r} is a hyperdcp checkpoint, not a HuggingFace directory")
    indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
    if len(indexes) > 1:
        if INDEX_FILE not in indexes:
            raise FormatError(f"{path!r} holds several index files {indexes}; "
                              "pass the shard file you want or keep one index")
        indexes = [INDEX_FILE]
    if indexes:
        index_path = _resolve(path, indexes[0], hub_repo(path), links)
        wm = _read_index(path, indexes[0], index_path)
        return path, sorted(set(wm.values())), wm, indexes[0]
    if SINGLE_FILE in names:
        return path, [SINGLE_FILE], None, None
    files = [n for n in names if n.endswith(".safetensors")]
    if not files:
        raise CheckpointNotFoundError(
            f"no checkpoint at {path!r}: it has neither {METADATA_FILE} (hyperdcp) nor safetensors files (HuggingFace)"
        )
    return path, files, None, None


def read_source(path: str | os.PathLike) -> HuggingFaceSource:
    """Parse and validate the headers of an HF source."""
    links: dict[str, str] = {}
    root, names, wm, index = hf_files(path, links)
    repo = hub_repo(root) if not os.path.isfile(os.fspath(path)) else None
    files: list[FileMeta] = []
    tensors: dict[str, TensorMeta] = {}
    where_of: dict[str, str] = {}
    hf_meta: dict = {}
    for fi, name in enumerate(names):
        fpath = os.path.join(root, name)
        fd, size = _open_regular(links.get(name) or _resolve(root, name, repo, links))
        try:
            entries, _ = read_header(fd, size, fpath)
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
                hint = ("; these are shards written by torch.distributed.checkpoint (DCP_SHARDING_INFO): load them "
                        "with source=\"torch-dcp\"" if isinstance(meta, dict) and "DCP_SHARDING_INFO" in meta else "")
                raise FormatError(f"tensor {tname!r} is stored both in {where_of[tname]} and in {name} under "
                                  f"{root!r}{hint}")
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
    return HuggingFaceSource(root, _metadata(files, tensors, {"hf_metadata": hf_meta}), index, links)


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
