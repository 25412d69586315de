"""The Storage interface (issue 12): one way to read and write a checkpoint's files.

A save writes every byte through ``Storage.begin_save`` / ``writer_at`` / ``create`` and commits the
record last; a load reads through ``size`` / ``read_into`` / ``read_all``. ``storage_for`` picks the
storage from the path (a directory, a ``file://`` URL, or an fsspec URL, here fsspec's in-memory file
system: a real file system, not a mock)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import hyperdcp
from hyperdcp.coordination.base import LocalCoordinator
from hyperdcp.core import dtypes
from hyperdcp.format import rank_files
from hyperdcp.format.checksums import block_digests, n_blocks
from hyperdcp.format.metadata import METADATA_FILE, Metadata
from hyperdcp.format.safetensors import read_header
from hyperdcp.options import SaveOptions
from hyperdcp.saving import persist, stage
from hyperdcp.saving.no_collectives import finalize, merge_at, persist_alone
from hyperdcp.storage.base import Storage
from hyperdcp.storage.fsspec import FsspecStorage
from hyperdcp.storage.local import LocalStorage
from hyperdcp.storage.urls import storage_for


def _state() -> dict:
    return {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.arange(5, dtype=np.int64), "step": 7}


class CountingStorage(LocalStorage):
    """A LocalStorage that records what goes through its writers (a real subclass, every byte still lands)."""

    def __init__(self, path):
        super().__init__(path)
        self.written: dict[str, int] = {}
        self.records: list[bytes] = []

    def _count(self, files):
        storage, create = self, files.create

        def counted(name, what="data file"):
            w = create(name, what)
            write = w.write

            def counting(data):
                storage.written[name] = storage.written.get(name, 0) + memoryview(data).nbytes
                write(data)

            w.write = counting
            return w

        files.create = counted
        return files

    def begin_save(self, *, overwrite):
        staging = self._count(super().begin_save(overwrite=overwrite))
        commit = staging.commit
        staging.commit = lambda record: (self.records.append(record), commit(record))[1]
        return staging

    def writer_at(self, location):
        return self._count(super().writer_at(location))


def test_every_byte_of_a_save_goes_through_the_storage(tmp_path):
    path = str(tmp_path / "step-1")
    storage = CountingStorage(path)
    coord = LocalCoordinator()
    result = persist(coord, stage(_state(), coord), path, SaveOptions(files_per_rank=2), None, storage=storage)
    on_disk = {e: os.path.getsize(os.path.join(path, e)) for e in os.listdir(path)}
    assert on_disk.pop(METADATA_FILE) == len(storage.records[0])  # the record, written by commit, last
    assert storage.written == on_disk  # every data byte went through the storage's writers
    assert sorted(on_disk) == sorted(result.files_written) and len(on_disk) == 2
    sd = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(5, np.int64), "step": None}
    hyperdcp.load(sd, path)
    assert np.array_equal(sd["w"], _state()["w"]) and np.array_equal(sd["b"], _state()["b"]) and sd["step"] == 7


def test_local_storage_reads_what_the_metadata_describes(tmp_path):
    path = str(tmp_path / "ck")
    hyperdcp.save(_state(), path)
    st = storage_for(path)
    assert isinstance(st, LocalStorage) and st.supports_writes and st.atomic_replace
    meta = Metadata.from_json(st.read_all(METADATA_FILE, 1 << 20, "metadata file"))
    assert st.list() == sorted([METADATA_FILE] + [f.name for f in meta.files])
    f = meta.files[0]
    assert st.size(f.name) == f.nbytes
    entries, _ = read_header(lambda n, off: _read(st, f.name, off, min(n, f.nbytes - off)), f.nbytes, f.name)
    c = meta.tensors["w"].chunks
    out = bytearray(int(c.end[0] - c.begin[0]))
    reads, nbytes = st.reads, st.bytes_read
    st.read_into(f.name, int(c.begin[0]), out)
    assert np.array_equal(np.frombuffer(out, np.float32).reshape(4, 3), _state()["w"])
    assert entries["w"][2:] == (int(c.begin[0]), int(c.end[0]))
    assert block_digests(out, meta.checksum_block_bytes) == c.checksums[0]
    assert (st.reads - reads, st.bytes_read - nbytes) == (1, len(out))  # every read counted, exactly
    with pytest.raises(hyperdcp.CorruptionError, match="unexpected end of file"):
        st.read_into(f.name, f.nbytes - 4, bytearray(8))
    with pytest.raises(hyperdcp.FormatError, match="limit"):
        st.read_all(METADATA_FILE, 16, "metadata file")
    st.close()


def _read(st: Storage, name: str, off: int, n: int) -> bytes:
    out = bytearray(n)
    st.read_into(name, off, out)
    return bytes(out)


def test_local_storage_never_follows_a_link(tmp_path):
    path = tmp_path / "ck"
    hyperdcp.save(_state(), str(path))
    (tmp_path / "secret").write_bytes(b"x" * 64)
    os.symlink(tmp_path / "secret", path / "r00000-00.safetensors")
    st = LocalStorage(str(path))
    with pytest.raises(hyperdcp.FormatError, match="symbolic link"):
        st.size("r00000-00.safetensors")
    with pytest.raises(hyperdcp.FormatError, match="symbolic link"):
        st.read_all("r00000-00.safetensors", 1 << 20)
    st.close()


def test_staged_save_commits_atomically_or_leaves_the_old_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    hyperdcp.save(_state(), path)
    before = {e: open(os.path.join(path, e), "rb").read() for e in os.listdir(path)}
    st = LocalStorage(path)
    with pytest.raises(hyperdcp.CheckpointExistsError, match="overwrite=True"):
        st.begin_save(overwrite=False)
    staging = st.begin_save(overwrite=True)
    try:
        with pytest.raises(hyperdcp.CheckpointExistsError, match="in progress"):  # the lock is held
            LocalStorage(path).begin_save(overwrite=True)
        with pytest.raises(RuntimeError):
            with st.writer_at(staging.location).create("r00000-00.safetensors") as w:
                w.write(b"partial")
                raise RuntimeError("a writer failed")
    finally:
        staging.abort()
        staging.release()
    assert {e: open(os.path.join(path, e), "rb").read() for e in os.listdir(path)} == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary directory, no lock file left


def test_storage_for_picks_the_storage_from_the_path(tmp_path):
    assert isinstance(storage_for(str(tmp_path)), LocalStorage)
    local = storage_for(f"file://{tmp_path}")
    assert isinstance(local, LocalStorage) and local.root == str(tmp_path)
    remote = storage_for("memory://ckpts/step-1")
    assert isinstance(remote, FsspecStorage) and not remote.supports_writes
    with pytest.raises(hyperdcp.UnsupportedStorageError, match="save to a local"):
        remote.begin_save(overwrite=False)


def test_fsspec_storage_reads_ranges_from_a_url(tmp_path):
    import fsspec

    path = str(tmp_path / "ck")
    hyperdcp.save(_state(), path)
    mem = fsspec.filesystem("memory")
    for e in os.listdir(path):
        mem.pipe_file(f"/p1-storage-test/ck/{e}", open(os.path.join(path, e), "rb").read())
    try:
        st = FsspecStorage("memory://p1-storage-test/ck", max_request_bytes=7)
        local = LocalStorage(path)
        assert st.list() == local.list()
        meta = Metadata.from_json(st.read_all(METADATA_FILE, 1 << 20, "metadata file"))
        f = meta.files[0]
        assert st.size(f.name) == f.nbytes
        got = bytearray(f.nbytes - 8)
        st.read_into(f.name, 8, got)
        assert bytes(got) == _read(local, f.name, 8, f.nbytes - 8)
        assert st.requests == -(-len(got) // 7)  # ranged requests of at most max_request_bytes
        with pytest.raises(hyperdcp.CorruptionError, match="truncated"):
            st.read_into(f.name, f.nbytes - 2, bytearray(4))
        with pytest.raises(hyperdcp.CheckpointNotFoundError, match="missing"):
            st.size("r99999-00.safetensors")
        local.close()
    finally:
        mem.rm("/p1-storage-test", recursive=True)


def test_no_collectives_save_is_complete_once_every_rank_file_is_there(tmp_path):
    """Two ranks save alone (rank 0 writes every chunk, rank 1 none); the rank files merge only when both
    are present; finalize turns the directory into an ordinary checkpoint."""
    path = str(tmp_path / "nc")
    coord, opts = LocalCoordinator(), SaveOptions()
    staged = stage(_state(), coord)
    every = np.arange(len(staged.chunks), dtype=np.int64)
    persist_alone(path, 0, 2, staged, every, staged.encoded_values(), opts, save_id="save-1")
    st = LocalStorage(path)
    with pytest.raises(hyperdcp.IncompleteCheckpointError, match=r"rank\(s\) \[1\]"):
        merge_at(st)
    persist_alone(path, 1, 2, staged, every[:0], staged.encoded_values(), opts, save_id="save-1")
    names = [n for n in st.list() if rank_files.is_rank_file(n)]
    assert names == [rank_files.rank_file_name(0), rank_files.rank_file_name(1)]
    raw = {n: st.read_all(n, 1 << 20) for n in names}
    meta = rank_files.merge(raw, path)  # the pure codec, from the bytes
    assert meta.world_size == 2 and sorted(meta.tensors) == ["b", "w"] and meta.values == {"step": 7}
    edited = dict(raw, **{names[1]: raw[names[1]].replace(b'"save-1"', b'"save-2"')})
    with pytest.raises(hyperdcp.FormatError, match="metadata_checksum"):
        rank_files.merge(edited, path)
    with pytest.raises(hyperdcp.IncompleteCheckpointError, match="no rank files"):
        rank_files.merge({}, path)
    assert METADATA_FILE not in st.list()
    finalize(path)
    assert Metadata.from_json(st.read_all(METADATA_FILE, 1 << 20)).to_json() == meta.to_json()
    sd = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(5, np.int64), "step": None}
    hyperdcp.load(sd, path)
    assert np.array_equal(sd["w"], _state()["w"]) and np.array_equal(sd["b"], _state()["b"]) and sd["step"] == 7
    st.close()


def test_block_counts():
    assert n_blocks(0, 4) == 1 and n_blocks(8, 4) == 2 and n_blocks(9, 4) == 3


def _memory_tensor(st, meta: Metadata, fqn: str) -> np.ndarray:
    """Tensor ``fqn`` of the checkpoint in ``st``, read back chunk by chunk and verified against its checksums."""
    t = meta.tensors[fqn]
    out = np.zeros(t.shape, dtypes.to_numpy(t.dtype))
    c = t.chunks
    for i in range(len(c)):
        buf = bytearray(int(c.end[i] - c.begin[i]))
        st.read_into(meta.files[int(c.file[i])].name, int(c.begin[i]), buf)
        assert block_digests(buf, meta.checksum_block_bytes) == c.checksums[i]
        box = c.box(i)
        out[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))] = np.frombuffer(
            buf, out.dtype).reshape(box.lengths)
    return out


def test_a_save_to_storage_without_rename_commits_the_record_last(tmp_path):
    """MemoryStorage commits like an object store: per-save file names, record last, old files removed after."""
    from tests.faults.storage import DiskGoneAfterWriting

    st, coord = DiskGoneAfterWriting("mem://ck"), LocalCoordinator()
    first = _state()
    assert persist(coord, stage(first, coord), "mem://ck", SaveOptions(), None, storage=st).path == "mem://ck"
    meta1 = Metadata.from_json(st.read_all(METADATA_FILE, 1 << 20))
    assert st.list() == sorted([METADATA_FILE] + [f.name for f in meta1.files])
    with pytest.raises(hyperdcp.CheckpointExistsError, match="overwrite=True"):
        persist(coord, stage(first, coord), "mem://ck", SaveOptions(), None, storage=st)

    st.failing = "disk gone after writing"  # every data file is stored, then the write step fails
    with pytest.raises(RuntimeError, match="disk gone"):
        persist(coord, stage(first, coord), "mem://ck", SaveOptions(overwrite=True), None, storage=st)
    st.failing = None
    assert st.list() == sorted([METADATA_FILE] + [f.name for f in meta1.files])  # the failed save left nothing

    second = {"w": first["w"] * 2, "b": first["b"] + 1, "step": 8}
    persist(coord, stage(second, coord), "mem://ck", SaveOptions(overwrite=True), None, storage=st)
    meta2 = Metadata.from_json(st.read_all(METADATA_FILE, 1 << 20))
    assert {f.name for f in meta2.files}.isdisjoint(f.name for f in meta1.files)  # a new token per save
    assert st.list() == sorted([METADATA_FILE] + [f.name for f in meta2.files])  # the replaced save's files are gone
    assert np.array_equal(_memory_tensor(st, meta2, "w"), second["w"])
    assert np.array_equal(_memory_tensor(st, meta2, "b"), second["b"]) and meta2.values == {"step": 8}


def test_a_registered_url_scheme_is_served_by_its_own_storage(tmp_path):
    """register_storage: a Storage of the user's own for a URL scheme, reached by save, load, read_metadata and
    storage_for (async saves too: tests/test_reliability_leaks.py); named by import path, validated at once."""
    from hyperdcp.storage import register_storage, unregister_storage
    from tests.faults.storage import StallingLocalStorage

    url, state = f"stalling://{tmp_path / 'c'}", _state()
    with pytest.raises(hyperdcp.UnsupportedStorageError):
        hyperdcp.save(state, url)  # not registered: a URL hyperdcp cannot save to
    with pytest.raises(ValueError, match="served by hyperdcp"):
        register_storage("s3", "tests.faults.storage:StallingLocalStorage")
    with pytest.raises(ValueError, match="module:attribute"):
        register_storage("stalling", "tests.faults.storage.StallingLocalStorage")
    with pytest.raises(ValueError, match="import path"):
        register_storage("stalling", lambda url, opts: None)
    with pytest.raises(ImportError):
        register_storage("stalling", "tests.faults.no_such_module:Storage")
    register_storage("stalling", StallingLocalStorage)  # recorded as tests.faults.storage:StallingLocalStorage
    try:
        assert isinstance(storage_for(url), StallingLocalStorage)
        assert hyperdcp.save(state, url, storage_options={"stall_seconds": 0}).path == str(tmp_path / "c")
        got = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(5, np.int64), "step": 0}
        hyperdcp.load(got, url)
        assert np.array_equal(got["w"], state["w"]) and np.array_equal(got["b"], state["b"]) and got["step"] == 7
        assert sorted(hyperdcp.read_metadata(url).tensors) == ["b", "w"]
    finally:
        unregister_storage("stalling")
    with pytest.raises(hyperdcp.UnsupportedStorageError):
        hyperdcp.save(state, url, overwrite=True)
    got = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(5, np.int64), "step": 0}
    hyperdcp.load(got, str(tmp_path / "c"))  # the same directory, as a plain path
    assert np.array_equal(got["w"], state["w"])
