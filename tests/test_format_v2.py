"""Format version 2 (issue 13): the commit record names a binary chunk index; every reader reads both.

Scenarios: a model of 1,200 tensors saved in one process (format 2 by default at that size) and one of
a few tensors (still format 1), both loaded back exactly; a 2-rank DTensor save loaded on another layout,
with and without read-once; the index travelling with the record from rank 0 (the other ranks never
touch the storage); the tools; a no-collectives save finalized; an object-store-like storage.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import hyperdcp
from hyperdcp.coordination.local import LocalCoordinator
from hyperdcp.format.metadata import METADATA_FILE, Metadata
from hyperdcp.format.record_v2 import is_index_file
from hyperdcp.options import SaveOptions
from hyperdcp.saving.flow import persist
from hyperdcp.saving.no_collectives import finalize, persist_alone
from hyperdcp.saving.stage import stage
from hyperdcp.sources import open_source
from hyperdcp.sources.base import source_from_bytes
from hyperdcp.storage.memory import MemoryStorage
from hyperdcp.tools.diff import diff_sources
from hyperdcp.tools.inspect import describe


def _model(n: int) -> dict:
    rng = np.random.default_rng(n)
    sd = {f"layers.{i}.w": rng.standard_normal((3, 2 + i % 3)).astype(np.float32) for i in range(n)}
    sd.update({"emb": rng.integers(0, 1 << 40, (5, 4, 3)), "scalar": np.float32(1.5),
               "empty": np.zeros((0, 4), np.int32),
               "step": 12, "cfg": {"lr": 3e-4}})
    return sd


def _zeros(sd: dict) -> dict:
    return {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else None) for k, v in sd.items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _record(path: str) -> dict:
    return json.loads(open(os.path.join(path, METADATA_FILE), "rb").read())


def _chunk_tables(meta: Metadata) -> dict:
    return {k: (t.dtype, t.shape, t.chunks.offsets.tolist(), t.chunks.lengths.tolist(), t.chunks.file.tolist(),
                t.chunks.begin.tolist(), t.chunks.end.tolist(), list(t.chunks.checksums))
            for k, t in meta.tensors.items()}


def test_a_large_model_is_saved_as_format_2_and_loads_back_exactly(tmp_path, monkeypatch):
    monkeypatch.delenv("HYPERDCP_INDEX_MIN_CHUNKS", raising=False)  # the default: format 2 from 1,024 chunks
    sd = _model(1200)
    path = str(tmp_path / "big")
    hyperdcp.save(sd, path)
    rec = _record(path)
    index = rec["index"]["name"]
    assert rec["format_version"] == 2 and "tensors" not in rec and is_index_file(index)
    assert rec["files"][-1] == {"name": index, "bytes": os.path.getsize(os.path.join(path, index))}
    assert sorted(os.listdir(path)) == sorted([METADATA_FILE] + [f["name"] for f in rec["files"]])
    meta = hyperdcp.read_metadata(path)
    assert meta.format_version == 2 and meta.num_chunks == 1201 and index not in [f.name for f in meta.files]
    ix = meta.chunk_index()
    assert ix.checksums.dtype == np.uint64 and ix.begin.dtype == np.int64 and len(ix.names) == 1202
    back = _zeros(sd)
    hyperdcp.load(back, path)
    _same(back, sd)
    # the object view equals the same metadata encoded and parsed as format 1
    assert _chunk_tables(Metadata.from_json(meta.to_json())) == _chunk_tables(meta)
    assert sorted(meta.tensors) == sorted(k for k, v in sd.items() if isinstance(v, np.ndarray))


def test_a_small_model_stays_format_1_and_both_read_alike(tmp_path, monkeypatch):
    monkeypatch.delenv("HYPERDCP_INDEX_MIN_CHUNKS", raising=False)
    sd = _model(4)
    hyperdcp.save(sd, str(tmp_path / "v1"))
    monkeypatch.setenv("HYPERDCP_INDEX_MIN_CHUNKS", "0")
    hyperdcp.save(sd, str(tmp_path / "v2"))
    r1, r2 = _record(str(tmp_path / "v1")), _record(str(tmp_path / "v2"))
    assert r1["format_version"] == 1 and "index" not in r1 and r2["format_version"] == 2
    m1, m2 = hyperdcp.read_metadata(str(tmp_path / "v1")), hyperdcp.read_metadata(str(tmp_path / "v2"))
    # dtype, shape, boxes, checksums (byte offsets differ: each save's data file headers carry its own token)
    strip = lambda t: {k: v[:4] + v[7:] for k, v in t.items()}  # noqa: E731
    assert strip(_chunk_tables(m1)) == strip(_chunk_tables(m2)) and m1.values == m2.values
    for p in ("v1", "v2"):
        back = _zeros(sd)
        hyperdcp.load(back, str(tmp_path / p))
        _same(back, sd)
    assert diff_sources(str(tmp_path / "v1"), str(tmp_path / "v2")).equal
    info = describe(str(tmp_path / "v2"))
    assert info["format_version"] == 2 and len(info["tensors"]) == len(m2.tensors)
    rep = hyperdcp.verify_checkpoint(str(tmp_path / "v2"))
    assert rep.ok and rep.chunks == m2.num_chunks and rep.files == len(m2.files)
    data = os.path.join(str(tmp_path / "v2"), m2.files[0].name)
    raw = bytearray(open(data, "rb").read())
    raw[int(m2.tensors["emb"].chunks.begin[0]) + 3] ^= 0xFF
    open(data, "wb").write(bytes(raw))
    rep = hyperdcp.verify_checkpoint(str(tmp_path / "v2"))
    assert not rep.ok and [b.tensor for b in rep.bad_chunks] == ["emb"]
    hyperdcp.save(_model(5), str(tmp_path / "v2"), overwrite=True)  # a format-2 checkpoint is ours to replace
    assert ([n for n in os.listdir(tmp_path / "v2") if is_index_file(n)]
            == [_record(str(tmp_path / "v2"))["index"]["name"]])
    back = _zeros(_model(5))
    hyperdcp.load(back, str(tmp_path / "v2"))
    _same(back, _model(5))


def test_the_index_travels_with_the_record_so_other_ranks_never_read_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERDCP_INDEX_MIN_CHUNKS", "0")
    sd = _model(6)
    path = str(tmp_path / "ck")
    hyperdcp.save(sd, path)
    src = open_source(path)  # rank 0: reads the record and the index
    sent = src.to_bytes()
    index = _record(path)["index"]["name"]
    os.rename(os.path.join(path, index), os.path.join(str(tmp_path), index))  # no other rank could read it now
    other = source_from_bytes(sent)
    assert _chunk_tables(other.metadata) == _chunk_tables(src.metadata)
    with pytest.raises(hyperdcp.FormatError, match=index):  # a rank reading alone needs the file
        hyperdcp.read_metadata(path)
    with pytest.raises(hyperdcp.FormatError, match="chunk index"):  # a damaged message is refused the same way
        source_from_bytes(sent[:-9])


def test_a_no_collectives_save_finalizes_as_format_2(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERDCP_INDEX_MIN_CHUNKS", "0")
    sd = _model(5)
    path = str(tmp_path / "nc")
    coord, opts = LocalCoordinator(), SaveOptions()
    staged = stage(sd, coord)
    every = np.arange(len(staged.chunks), dtype=np.int64)
    persist_alone(path, 0, 2, staged, every, staged.encoded_values(), opts, save_id="s1")
    persist_alone(path, 1, 2, staged, every[:0], staged.encoded_values(), opts, save_id="s1")
    unmerged = _zeros(sd)
    hyperdcp.load(unmerged, path)  # the rank files, merged in memory
    _same(unmerged, sd)
    finalize(path)
    finalize(path)  # again: the same record and index
    assert _record(path)["format_version"] == 2
    back = _zeros(sd)
    hyperdcp.load(back, path)
    _same(back, sd)


def test_a_storage_without_rename_keeps_the_index_of_the_committed_save_only(monkeypatch):
    monkeypatch.setenv("HYPERDCP_INDEX_MIN_CHUNKS", "0")
    st, coord = MemoryStorage("mem://v2"), LocalCoordinator()
    first, second = _model(3), _model(7)
    persist(coord, stage(first, coord), "mem://v2", SaveOptions(), None, storage=st)
    old = [n for n in st.list() if is_index_file(n)]
    persist(coord, stage(second, coord), "mem://v2", SaveOptions(overwrite=True), None, storage=st)
    new = [n for n in st.list() if is_index_file(n)]
    assert len(old) == len(new) == 1 and old != new  # a per-save name; the replaced save's index is gone
    meta = Metadata.from_json(st.read_all(METADATA_FILE, 1 << 20), index=lambda n, k: st.read_all(n, k))
    assert sorted(meta.tensors) == sorted(k for k, v in second.items() if isinstance(v, np.ndarray)) and \
        meta.values["step"] == 12
    t = meta.tensors["emb"]
    buf = bytearray(int(t.chunks.end[0] - t.chunks.begin[0]))
    st.read_into(meta.files[int(t.chunks.file[0])].name, int(t.chunks.begin[0]), buf)
    assert np.array_equal(np.frombuffer(buf, np.int64).reshape(t.shape), second["emb"])


def _dtensor_round_trip(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from tests.layouts import check_state, make_state

    mesh = init_device_mesh("cpu", (2,))
    hyperdcp.save(make_state(mesh, lambda name, nd: [Shard(0)]), path)
    rec = json.loads(open(os.path.join(path, METADATA_FILE), "rb").read())
    for read_once in (True, False):
        cols = make_state(mesh, lambda name, nd: [Shard(nd - 1)], zeros=True)
        hyperdcp.load(cols, path, read_once=read_once)
        check_state(cols)
    return rec["format_version"]


def test_two_ranks_save_format_2_and_load_it_on_another_layout(tmp_path):
    pytest.importorskip("torch")
    from tests.dist import run_ranks

    out = run_ranks(2, _dtensor_round_trip, str(tmp_path / "dt"), timeout=120, env={"HYPERDCP_INDEX_MIN_CHUNKS": "0"})
    assert out == [2, 2]


def test_a_missing_data_file_of_a_format_2_checkpoint_is_damage_not_a_replaced_save(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERDCP_INDEX_MIN_CHUNKS", "0")
    sd = _model(2)
    path = str(tmp_path / "ck")
    hyperdcp.save(sd, path)
    name = hyperdcp.read_metadata(path).files[0].name
    os.unlink(os.path.join(path, name))
    with pytest.raises(hyperdcp.CorruptionError, match=f"{name} is missing; the checkpoint is damaged"):
        hyperdcp.load(_zeros(sd), path)


def test_convert_reads_and_writes_format_2(tmp_path, monkeypatch):
    from safetensors.numpy import load_file, save_file

    from hyperdcp.tools.convert import dcp_to_hf, hf_to_dcp

    monkeypatch.setenv("HYPERDCP_INDEX_MIN_CHUNKS", "0")
    tensors = {k: v for k, v in _model(4).items() if isinstance(v, np.ndarray) and v.size}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf_to_dcp(str(tmp_path / "model.safetensors"), str(tmp_path / "ck"))
    assert _record(str(tmp_path / "ck"))["format_version"] == 2
    back = _zeros(tensors)
    hyperdcp.load(back, str(tmp_path / "ck"))
    _same(back, tensors)
    dcp_to_hf(str(tmp_path / "ck"), str(tmp_path / "hf"))
    out = {}
    for f in sorted(os.listdir(tmp_path / "hf")):
        if f.endswith(".safetensors"):
            out.update(load_file(str(tmp_path / "hf" / f)))
    _same(out, tensors)


def test_a_format_2_checkpoint_loads_from_a_url(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.setenv("HYPERDCP_INDEX_MIN_CHUNKS", "0")
    sd = _model(3)
    path = str(tmp_path / "ck")
    hyperdcp.save(sd, path)
    mem = fsspec.filesystem("memory")
    for e in os.listdir(path):
        mem.pipe_file(f"/idx13-v2/ck/{e}", open(os.path.join(path, e), "rb").read())
    try:
        url = "memory://idx13-v2/ck"
        assert _chunk_tables(hyperdcp.read_metadata(url)) == _chunk_tables(hyperdcp.read_metadata(path))
        back = _zeros(sd)
        hyperdcp.load(back, url)
        _same(back, sd)
        mem.rm(f"/idx13-v2/ck/{_record(path)['index']['name']}")
        with pytest.raises(hyperdcp.FormatError, match="chunk index .* is missing"):
            hyperdcp.read_metadata(url)
    finally:
        mem.rm("/idx13-v2", recursive=True)
