"""The on-disk format as pure codecs (issue 12): no I/O, bytes in and objects out."""

from __future__ import annotations

import numpy as np
import pytest

import hyperdcp
from hyperdcp.format.metadata import Metadata
from hyperdcp.format.safetensors import ChunkToWrite, build_header, chunk_name, read_header


def test_data_file_header_codec_round_trips_from_bytes():
    a = np.arange(6, dtype=np.float32)
    b = np.arange(4, dtype=np.int64)
    chunks = [ChunkToWrite(chunk_name("w", (0, 3), False), "F32", (2, 3), a.view(np.uint8)),
              ChunkToWrite(chunk_name("b", (0,), True), "I64", (4,), b.view(np.uint8))]
    header, starts = build_header(chunks)
    blob = header + a.tobytes() + b.tobytes()
    meta: dict = {}
    entries, data_start = read_header(lambda n, off: blob[off:off + n], len(blob), "test file", meta)
    assert meta == {"format": "hyperdcp"} and data_start == len(header) and len(header) % 8 == 0
    assert entries == {"w@0,3": ("F32", (2, 3), len(header), len(header) + 24),
                       "b": ("I64", (4,), len(header) + 24, len(header) + 56)}
    assert starts == [0, 24]
    with pytest.raises(hyperdcp.FormatError, match="test file"):
        read_header(lambda n, off: blob[off:off + n], len(blob) - 1, "test file")  # a range past the end


def test_metadata_renamed_maps_and_drops_keys(tmp_path):
    path = str(tmp_path / "ck")
    hyperdcp.save({"model.w": np.ones(3, np.float32), "model.b": np.zeros(2, np.float32), "step": 3}, path)
    meta = hyperdcp.read_metadata(path)
    out = meta.renamed(lambda k: None if k == "model.b" else k.replace("model.", ""))
    assert sorted(out.tensors) == ["w"] and out.values == {"step": 3}
    assert out.tensors["w"] is meta.tensors["model.w"] and sorted(meta.tensors) == ["model.b", "model.w"]
    assert Metadata.from_json(out.to_json()).keys() == ["step", "w"]
    with pytest.raises(hyperdcp.MismatchError, match="one-to-one"):
        meta.renamed(lambda k: "same")
    with pytest.raises(hyperdcp.MismatchError, match="non-empty str"):
        meta.renamed(lambda k: "")
