"""torch DCP's safetensors serialization (``HuggingFaceStorageWriter``): a directory of ``*.safetensors`` files
whose ``__metadata__`` holds ``DCP_SHARDING_INFO`` (each entry's ``saved_offsets`` in the whole tensor) when
the save was distributed (``save_distributed=True``: every rank writes its own shards, no index).

Headers are parsed strictly (:func:`~hyperdcp.storage.data_file.read_header`); each header entry becomes
one chunk at its offsets, and a tensor's shape is the bounding box of its chunks (as torch's own reader
computes it). Nothing is unpickled.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..errors import FormatError
from ..format.metadata import ChunkTable, FileMeta, Metadata, TensorMeta
from ..storage.data_file import read_header
from ..storage.safe_open import open_regular

SHARDING_KEY = "DCP_SHARDING_INFO"


def _names(root: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
    except OSError:
        return []


def _header(root: str, name: str) -> tuple[dict, dict, int]:
    path = os.path.join(root, name)
    fd, size = open_regular(path, "safetensors file")
    try:
        meta: dict = {}
        entries, _ = read_header(fd, size, path, meta)
    finally:
        os.close(fd)
    return entries, meta, size


def is_dcp_safetensors_dir(root: str) -> bool:
    """Whether ``root`` holds safetensors files written by torch DCP (their header has DCP_SHARDING_INFO)."""
    names = _names(root)
    if not names:
        return False
    try:
        return SHARDING_KEY in _header(root, names[0])[1]
    except Exception:  # noqa: BLE001 - only decides whether this kind applies
        return False


def read_safetensors_dir(root: str) -> Metadata:
    """The metadata of a torch DCP safetensors directory: one chunk per header entry, at its saved offsets."""
    from .torch_dcp import check_file_name, make_metadata

    files: list[FileMeta] = []
    rows: dict[str, list] = {}
    kinds: dict[str, tuple[str, int]] = {}
    for fi, name in enumerate(_names(root)):
        check_file_name(root, name, name)
        entries, meta, size = _header(root, name)
        path = os.path.join(root, name)
        try:
            info = json.loads(meta[SHARDING_KEY]) if SHARDING_KEY in meta else {}
        except (TypeError, ValueError):
            raise FormatError(f"{path}: its {SHARDING_KEY} metadata is not JSON; the file is damaged") from None
        files.append(FileMeta(name, size))
        for fqn, (code, shape, begin, end) in entries.items():
            offs = (info.get(fqn) or {}).get("saved_offsets", [0] * len(shape)) if isinstance(info, dict) else None
            if (not isinstance(offs, list) or len(offs) != len(shape)
                    or not all(type(o) is int and o >= 0 for o in offs)):
                raise FormatError(f"{path}: tensor {fqn!r} has saved_offsets {offs!r} for shape {list(shape)}")
            if kinds.setdefault(fqn, (code, len(shape))) != (code, len(shape)):
                raise FormatError(f"{path}: chunks of tensor {fqn!r} disagree on dtype or rank across files")
            rows.setdefault(fqn, []).append((offs, list(shape), fi, begin, end))
    tensors: dict[str, TensorMeta] = {}
    for fqn, rs in rows.items():
        code, nd = kinds[fqn]
        shape = tuple(max(o[d] + n[d] for o, n, *_ in rs) for d in range(nd))
        tensors[fqn] = TensorMeta(code, shape, ChunkTable(
            np.array([r[0] for r in rs], np.int64).reshape(len(rs), nd),
            np.array([r[1] for r in rs], np.int64).reshape(len(rs), nd),
            np.array([r[2] for r in rs], np.int64), np.array([r[3] for r in rs], np.int64),
            np.array([r[4] for r in rs], np.int64), [""] * len(rs)))
    return make_metadata(files, tensors, {}, {"torch_dcp_serialization": "safetensors"})
