"""What a source holds, as a JSON-serialisable report (metadata and headers only; no data is read).

    rep = describe("ckpt/step-100")     # or an HF file/directory/hub snapshot, or a URL
    rep["kind"], rep["totals"]["tensor_bytes"]
"""

from __future__ import annotations

from typing import Any

from ..sources.base import open_source

#: the report's name for each source kind
KIND_NAMES = {"hyperdcp": "hyperdcp", "huggingface": "huggingface-safetensors", "torch-dcp": "torch-dcp"}


def describe(path: str, source: str = "auto") -> dict[str, Any]:
    """The inspect report of the source at ``path`` as a JSON-serialisable dict (what ``hyperdcp inspect
    --json`` prints).

    Args:
        path: anything :func:`~hyperdcp.open_source` opens.
        source: its kind (``"auto"``, ``"hyperdcp"``, ``"huggingface"``, ``"torch-dcp"``; see open_source).

    Returns:
        a dict with the source's kind, its tensors (shape, dtype, chunks, bytes), values and totals.

    Raises:
        CheckpointError: from :func:`~hyperdcp.open_source` when ``path`` holds no checkpoint.

    Example::

        report = describe("ckpt/step-100"); report["tensors"]["w"]["shape"]
    """
    kind = source
    source = open_source(path, kind=kind)
    meta = source.metadata
    is_hf = source.kind != "hyperdcp"
    tensors = []
    for name in sorted(meta.tensors):
        t = meta.tensors[name]
        fids = sorted(set(int(f) for f in t.chunks.file.tolist()))
        tensors.append({"name": name, "dtype": t.dtype, "shape": list(t.shape), "chunks": len(t.chunks),
                        "bytes": t.nbytes, "files": [meta.files[i].name for i in fids]})
    return {
        "path": path,
        "kind": KIND_NAMES.get(source.kind, source.kind),
        "format_version": None if is_hf else meta.format_version,
        "library_version": None if is_hf else meta.library_version,
        "world_size": None if is_hf else meta.world_size,
        "created_unix": None if is_hf else meta.created_unix,
        "tensors": tensors,
        "values": sorted(meta.values),
        "totals": {"tensors": len(meta.tensors), "values": len(meta.values), "chunks": meta.num_chunks,
                   "tensor_bytes": meta.tensor_bytes, "files": len(meta.files), "file_bytes": meta.data_file_bytes},
        "user": meta.user,
        **({"unreadable": dict(sorted(source.unreadable.items()))} if hasattr(source, "unreadable") else {}),
    }
