"""Hostile chunk index files (format 2): each damage is refused with a FormatError naming the index file
and what is wrong, before any data file is opened.

Every case starts from a real format-2 checkpoint (three tensors, one chunk each, in one data file),
damages the index, and -- except where the damage is to the bytes the record checksums --
re-signs the record with the damaged index's size and xxh3-64, so the index's own validation is what
must catch it.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

import hyperdcp
from hyperdcp.format.metadata import METADATA_FILE, sign_json

INDEX_META = {"format": "hyperdcp-chunk-index", "version": "2"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hostile_index") / "ck")
    old = os.environ.get("HYPERDCP_INDEX_MIN_CHUNKS")
    os.environ["HYPERDCP_INDEX_MIN_CHUNKS"] = "0"
    try:
        hyperdcp.save({"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                       "b": np.arange(6, dtype=np.float32).reshape(2, 3),
                       "c": np.arange(4, dtype=np.int64), "step": 3}, path)
    finally:
        if old is None:
            del os.environ["HYPERDCP_INDEX_MIN_CHUNKS"]
        else:
            os.environ["HYPERDCP_INDEX_MIN_CHUNKS"] = old
    return path


def _copy(pristine, tmp_path) -> tuple[str, dict, str]:
    path = str(tmp_path / "ck")
    shutil.copytree(pristine, path)
    doc = json.loads(open(os.path.join(path, METADATA_FILE), "rb").read())
    return path, doc, doc["index"]["name"]


def _write_index(path: str, doc: dict, raw: bytes, resign: bool = True) -> None:
    import xxhash

    name = doc["index"]["name"]
    open(os.path.join(path, name), "wb").write(raw)
    if resign:
        doc.pop("metadata_checksum", None)
        doc["index"]["bytes"] = doc["files"][-1]["bytes"] = len(raw)
        doc["index"]["xxh3_64"] = "%016x" % xxhash.xxh3_64_intdigest(raw)
        open(os.path.join(path, METADATA_FILE), "wb").write(sign_json(doc))


def _arrays(path: str, name: str) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in st_load(open(os.path.join(path, name), "rb").read()).items()}


def _refused(path: str, name: str, match: str) -> None:
    with pytest.raises(hyperdcp.FormatError, match=match) as e:
        hyperdcp.read_metadata(path)
    assert name in str(e.value)


def test_truncated_index(pristine, tmp_path):
    path, doc, name = _copy(pristine, tmp_path)
    raw = open(os.path.join(path, name), "rb").read()
    _write_index(path, doc, raw[:-8], resign=False)  # the record still says the old size
    _refused(path, name, "bytes but the record says")
    _write_index(path, doc, raw[:-8])  # re-signed: the index itself is short
    _refused(path, name, "data_offsets outside|truncated")
    _write_index(path, doc, raw[:5])
    _refused(path, name, "truncated")


def test_wrong_checksum(pristine, tmp_path):
    path, doc, name = _copy(pristine, tmp_path)
    raw = bytearray(open(os.path.join(path, name), "rb").read())
    raw[-3] ^= 1  # a byte of the last checksum: same size, other contents
    _write_index(path, doc, bytes(raw), resign=False)
    _refused(path, name, "does not match the checksum")


def test_missing_index(pristine, tmp_path):
    path, doc, name = _copy(pristine, tmp_path)
    os.unlink(os.path.join(path, name))
    _refused(path, name, "missing")


@pytest.mark.parametrize("array,bad,match", [
    ("chunk.begin", lambda a: a.astype(np.int32), "dtype 'I32', expected I64"),
    ("chunk.checksums", lambda a: a.astype(np.int64), "dtype 'I64', expected U64"),
    ("chunk.offsets", lambda a: a.reshape(-1), "must have a shape of 2"),
    ("chunk.file", lambda a: a[:-1], r"chunk.file has shape \[2\], expected \[3\]"),
    ("tensor.shape", lambda a: a[:, :1], r"chunk.offsets has shape \[3, 2\], expected \[3, 1\]"),
])
def test_wrong_dtype_or_shape_of_an_array(pristine, tmp_path, array, bad, match):
    path, doc, name = _copy(pristine, tmp_path)
    arrs = _arrays(path, name)
    arrs[array] = np.ascontiguousarray(bad(arrs[array]))
    _write_index(path, doc, st_save(arrs, metadata=INDEX_META))
    _refused(path, name, match)


def _edit(pristine, tmp_path, fn) -> tuple[str, str]:
    path, doc, name = _copy(pristine, tmp_path)
    arrs = _arrays(path, name)
    fn(arrs)
    _write_index(path, doc, st_save(arrs, metadata=INDEX_META))
    return path, name


def _chunk_of(arrs, tensor: int, k: int = 0) -> int:
    return int(np.concatenate([[0], np.cumsum(arrs["tensor.chunks"])])[tensor]) + k


def test_offsets_out_of_bounds(pristine, tmp_path):
    def fn(a):
        a["chunk.offsets"][_chunk_of(a, 0), 0] = 1  # tensor "a" (2 x 3) held whole: offset 1 runs past row 2
    _refused(*_edit(pristine, tmp_path, fn), "chunk 0 of tensor 'a' has a box outside")


def test_huge_lengths(pristine, tmp_path):
    def fn(a):
        i = _chunk_of(a, 2)
        a["chunk.lengths"][i, 0] = 2**62
        a["chunk.end"][i] = a["chunk.begin"][i] + 8
    _refused(*_edit(pristine, tmp_path, fn), "tensor 'c' has a box outside")

    def shape(a):
        a["tensor.shape"][2] = [2**40, 2**40]  # 2^80 elements: refused before any product overflows
        a["tensor.ndim"][2] = 2
    _refused(*_edit(pristine, tmp_path / "s", shape), "absurd size|invalid shape|rank")


def test_overlapping_chunks(pristine, tmp_path):
    def fn(a):
        i, j = _chunk_of(a, 0), _chunk_of(a, 1)  # "a" and "b": same size, same data file
        a["chunk.begin"][j], a["chunk.end"][j] = a["chunk.begin"][i] + 4, a["chunk.end"][i] + 4
    _refused(*_edit(pristine, tmp_path, fn), "overlaps another chunk")


def test_chunk_past_the_end_of_its_file(pristine, tmp_path):
    def fn(a):
        i = _chunk_of(a, 2)
        a["chunk.begin"][i] += 1 << 50
        a["chunk.end"][i] += 1 << 50
    _refused(*_edit(pristine, tmp_path, fn), "past the end of its data file")


def test_file_index_out_of_range(pristine, tmp_path):
    def fn(a):
        a["chunk.file"][_chunk_of(a, 1)] = 1  # the checkpoint has one data file (the index is not one)
    _refused(*_edit(pristine, tmp_path, fn), "names file index 1, outside the record's 1 data files")


def test_byte_range_not_matching_the_box(pristine, tmp_path):
    def fn(a):
        a["chunk.end"][_chunk_of(a, 0)] -= 4
    _refused(*_edit(pristine, tmp_path, fn), "does not match its box and dtype")


def test_boxes_that_do_not_tile_the_tensor(pristine, tmp_path):
    def dup(a):  # "a" as two chunks with the same box (its first row), at distinct bytes
        a["tensor.chunks"][0] = 2
        for k in ("chunk.offsets", "chunk.lengths", "chunk.file", "chunk.begin", "chunk.end", "chunk.checksums"):
            a[k] = np.concatenate([a[k][:1], a[k][:1], a[k][1:]])
        a["chunk.lengths"][0:2, 0] = 1
        b0 = a["chunk.begin"][0]
        a["chunk.end"][0], a["chunk.begin"][1], a["chunk.end"][1] = b0 + 12, b0 + 12, b0 + 24
    _refused(*_edit(pristine, tmp_path, dup), "chunk 1 of tensor 'a' repeats another chunk's box")

    def half(a):
        i = _chunk_of(a, 0)
        a["chunk.lengths"][i, 0] = 1
        a["chunk.end"][i] = a["chunk.begin"][i] + 12
    _refused(*_edit(pristine, tmp_path / "h", half), "do not tile tensor 'a'")


def test_checksum_count_and_counts(pristine, tmp_path):
    _refused(*_edit(pristine, tmp_path, lambda a: a.update({"chunk.checksums": a["chunk.checksums"][:-1]})),
             "block checksums but the chunks need")
    _refused(*_edit(pristine, tmp_path / "n", lambda a: a["tensor.chunks"].__setitem__(0, 5)),
             "chunk counts do not add up")
    _refused(*_edit(pristine, tmp_path / "d", lambda a: a["tensor.dtype"].__setitem__(0, 7)),
             "dtype outside the record's dtype list")


def test_extra_or_missing_arrays_and_foreign_metadata(pristine, tmp_path):
    _refused(*_edit(pristine, tmp_path, lambda a: a.update({"chunk.extra": np.zeros(1, np.int64)})), "not exactly")
    _refused(*_edit(pristine, tmp_path / "m", lambda a: a.pop("chunk.end")), "not exactly")
    path, doc, name = _copy(pristine, tmp_path / "f")
    _write_index(path, doc, st_save(_arrays(path, name), metadata={"format": "pt"}))
    _refused(path, name, "__metadata__")
    path, doc, name = _copy(pristine, tmp_path / "j")
    _write_index(path, doc, b"\x10" + b"\0" * 7 + b"not json, sixteen")
    _refused(path, name, "not valid JSON")


def test_record_fields_about_the_index(pristine, tmp_path):
    path, doc, name = _copy(pristine, tmp_path)
    del doc["metadata_checksum"]
    doc["index"]["tensors"] = ["a", "a", "c"]
    open(os.path.join(path, METADATA_FILE), "wb").write(sign_json(doc))
    with pytest.raises(hyperdcp.FormatError, match="distinct non-empty tensor names"):
        hyperdcp.read_metadata(path)
    doc["index"]["tensors"] = ["a", "b", "c"]
    doc["index"]["name"] = "../outside.safetensors"
    open(os.path.join(path, METADATA_FILE), "wb").write(sign_json(doc))
    with pytest.raises(hyperdcp.FormatError, match="not a chunk index file name"):
        hyperdcp.read_metadata(path)


def test_a_repeated_box_standing_in_for_a_missing_grid_cell_is_refused_in_both_formats():
    """A 2 x 2 grid whose cell (1, 1) is missing and whose cell (0, 0) is stored twice, at distinct bytes:
    every interval of the grid is present and the box count is right, so only distinctness catches it."""
    from hyperdcp.format.metadata import ChunkTable, FileMeta, Metadata, TensorMeta
    from hyperdcp.format.record_v2 import encode_v2

    chunks = ChunkTable(np.array([[0, 0], [0, 1], [1, 0], [0, 0]]), np.ones((4, 2), np.int64), np.zeros(4, np.int64),
                        np.array([100, 104, 108, 112]), np.array([104, 108, 112, 116]), ["0" * 16] * 4)
    meta = Metadata(world_size=1, files=[FileMeta("r00000-00.safetensors", 1000)],
                    tensors={"w": TensorMeta("F32", (2, 2), chunks)}, values={})
    with pytest.raises(hyperdcp.FormatError, match="do not tile tensor 'w'"):
        Metadata.from_json(meta.to_json())
    record, index = encode_v2(meta, "hyperdcp-index-abc.safetensors")
    with pytest.raises(hyperdcp.FormatError, match="chunk 3 of tensor 'w' repeats another chunk's box"):
        Metadata.from_json(record, "ck/hyperdcp.json", index=index)
