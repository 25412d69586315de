"""Deprecated: HuggingFace safetensors interop moved.

* the source (discovery, header parsing, hub snapshots): :mod:`hyperdcp.sources.huggingface`, opened
  by :func:`hyperdcp.open_source`;
* the conversions (``hf_to_hyperdcp``, ``hyperdcp_to_hf``, ``select_keys``, ``plan_shards``):
  :mod:`hyperdcp.tools.convert`;
* ``parse_size``, ``parse_dtype``, ``ByteBudget``, ``Progress``: :mod:`hyperdcp.tools._units`;
* ``ConvertResult``: :mod:`hyperdcp.results`.

This module re-exports those names; new code imports them from their new places.
"""

from __future__ import annotations

import os

from .format.metadata import Metadata
from .loading.reads import read_box
from .results import ConvertResult
from .sources.base import open_source, rename_keys
from .sources.huggingface import (
    INDEX_FILE,
    INDEX_SUFFIX,
    MAX_INDEX_BYTES,
    SINGLE_FILE,
    hf_files,
    is_hf_source,
    read_source,
)
from .tools._units import FLOAT_CODES, ByteBudget, Progress, parse_dtype, parse_size
from .tools.convert import dcp_to_hf, hf_to_dcp, hf_to_hyperdcp, hyperdcp_to_hf, plan_shards, select_keys

_GONE = {
    "HFMetadata": "a HuggingFace source is now hyperdcp.sources.huggingface.HuggingFaceSource (its .metadata is a "
                  "plain Metadata); open one with hyperdcp.open_source(path)",
    "fetch_metadata": "use hyperdcp.sources.share_source(coord, path)",
    "data_root": "use hyperdcp.open_source(path).root",
}


def read_hf_metadata(path: str | os.PathLike) -> Metadata:
    """Deprecated: ``hyperdcp.open_source(path, kind="huggingface").metadata``."""
    return read_source(path).metadata


def open_metadata(path: str | os.PathLike) -> Metadata:
    """Deprecated: ``hyperdcp.open_source(path).metadata`` (any kind of source)."""
    return open_source(path).metadata


def __getattr__(name: str):
    if name in _GONE:
        raise AttributeError(f"hyperdcp.hf.{name} was removed: {_GONE[name]}")
    raise AttributeError(f"module 'hyperdcp.hf' has no attribute {name!r}")


__all__ = [
    "ConvertResult", "ByteBudget", "Progress", "FLOAT_CODES", "INDEX_FILE", "INDEX_SUFFIX", "MAX_INDEX_BYTES",
    "SINGLE_FILE", "dcp_to_hf", "hf_files", "hf_to_dcp", "hf_to_hyperdcp", "hyperdcp_to_hf", "is_hf_source",
    "open_metadata", "parse_dtype", "parse_size", "plan_shards", "read_box", "read_hf_metadata", "rename_keys",
    "select_keys",
]
