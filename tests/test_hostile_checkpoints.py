"""Hostile checkpoints, second campaign (issue 11): every trial ends in a correct result or a clear
CheckpointError naming the file, tensor or rank -- never wrong values, a hang, a raw exception, or a
file read outside the checkpoint.

The long campaigns: ``python -m tests.faults.fuzz_campaign`` and ``python -m tests.faults.corruption_campaign``
(docs/RELIABILITY.md, "Second campaign: hostile checkpoints").
"""

from __future__ import annotations

import json
import os
import signal
import threading

import numpy as np
import pytest

import hyperdcp
from hyperdcp.storage.data_file import read_header
from tests.dist import run_ranks
from tests.faults.fuzz_campaign import sign

META = "hyperdcp.json"
RANK0 = "hyperdcp.rank-00000.json"


def spawns(test):
    """Marks a test that runs spawned ranks (bounded by run_ranks' own timeout, not the alarm)."""
    test.spawns = True
    return test


@pytest.fixture(autouse=True)
def deadline(request):
    """A hang fails the test instead of blocking the suite (spawned-rank tests have run_ranks' timeout)."""
    if getattr(request.function, "spawns", False):
        yield
        return

    def hang(signum, frame):
        raise AssertionError("hung (10 s deadline)")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def doc_of(path) -> dict:
    doc = json.loads(open(os.path.join(path, META), "rb").read())
    del doc["metadata_checksum"]
    return doc


def write_signed(path, doc: dict, name: str = META) -> None:
    with open(os.path.join(path, name), "wb") as f:
        f.write(sign(doc))


def signed_raw(body: bytes) -> bytes:
    """Any bytes ending in '}' made into a correctly self-checksummed file."""
    import xxhash

    body = body[:-1] + b',"metadata_checksum":"' + b"0" * 16 + b'"}\n'
    return body[:-19] + b"%016x" % xxhash.xxh3_64_intdigest(body) + b'"}\n'


# -- item 1: box and byte arithmetic cannot overflow ---------------------------------------------------
def test_chunk_box_whose_end_overflows_int64_is_refused(tmp_path):
    """[8, 4] F32 whose real chunk covers rows 0-3, plus a re-signed extra chunk at offset 2^62 of length
    2^62+4 (its end wraps around int64) pointing at 64 real bytes of a second file: refused, not loaded
    with rows 4-7 left as they were, and never picked as the latest checkpoint."""
    root = tmp_path / "ckpts"
    good = root / "step-1"
    state = {"w": np.ones((4, 4), np.float32), "pad": np.full(16, 7.0, np.float32), "x": np.zeros(16, np.float32)}
    hyperdcp.save(state, str(good), files_per_rank=3)
    bad = root / "step-2"
    hyperdcp.save(state, str(bad), files_per_rank=3)
    doc = doc_of(bad)
    w, pad = doc["tensors"]["w"], doc["tensors"].pop("pad")
    assert w["chunks"]["file"] != pad["chunks"]["file"]  # the two tensors sit in two data files
    w["shape"] = [8, 4]
    c, p = w["chunks"], pad["chunks"]
    c["offsets"].append([2**62, 0])
    c["lengths"].append([2**62 + 4, 4])
    for k in ("file", "begin", "end", "checksums"):
        c[k].append(p[k][0])
    write_signed(bad, doc)

    with pytest.raises(hyperdcp.FormatError, match=r"tensor 'w'.*outside its shape"):
        hyperdcp.read_metadata(str(bad))
    out = {"w": np.full((8, 4), -1, np.float32), "x": np.zeros(16, np.float32)}
    with pytest.raises(hyperdcp.FormatError, match="'w'"):
        hyperdcp.load(out, str(bad), strict=False)
    assert (out["w"] == -1).all()
    assert hyperdcp.latest_checkpoint(str(root)) == str(good)
    assert not hyperdcp.verify_checkpoint(str(bad)).ok


def test_tensor_whose_byte_size_overflows_int64_is_refused(tmp_path):
    """Shape [2^61+2] F64 (2^64+16 bytes, i.e. 16 modulo 2^64) with one 16-byte chunk: refused."""
    path = tmp_path / "c"
    hyperdcp.save({"x": np.array([1.0, 2.0])}, str(path))
    doc = doc_of(path)
    doc["tensors"]["x"]["shape"] = [2**61 + 2]
    doc["tensors"]["x"]["chunks"]["lengths"] = [[2**61 + 2]]
    write_signed(path, doc)
    with pytest.raises(hyperdcp.FormatError, match=r"tensor 'x' declares an absurd size"):
        hyperdcp.read_metadata(str(path))
    with pytest.raises(hyperdcp.FormatError, match="'x'"):
        hyperdcp.load({"x": np.zeros(2)}, str(path), strict=False)


# -- item 2 and 12: rank metadata files are checksummed and opened like every other file ------------------
def save_no_collectives(path, state) -> None:
    hyperdcp.async_save(state, str(path), coordination="none").result(timeout=60)


def test_edited_rank_file_is_refused_by_load_and_verify(tmp_path):
    path = tmp_path / "nc"
    save_no_collectives(path, {"w": np.arange(6.0), "step": 3})
    raw = open(path / RANK0, "rb").read()
    assert b'"step":["int","3"]' in raw
    open(path / RANK0, "wb").write(raw.replace(b'"step":["int","3"]', b'"step":["int","4"]'))
    out = {"w": np.zeros(6), "step": None}
    with pytest.raises(hyperdcp.FormatError, match=r"hyperdcp.rank-00000.json.*checksum"):
        hyperdcp.load(out, str(path))
    assert out["step"] is None
    rep = hyperdcp.verify_checkpoint(str(path))
    assert not rep.ok and "hyperdcp.rank-00000.json" in " ".join(rep.file_errors)


def test_rank_file_linking_outside_the_checkpoint_is_not_followed(tmp_path):
    path = tmp_path / "nc"
    save_no_collectives(path, {"w": np.arange(6.0)})
    secret = tmp_path / "secret.txt"
    secret.write_text('{"format": "hyperdcp-rank", "password": "hunter2"}')
    os.unlink(path / RANK0)
    os.symlink(secret, path / RANK0)
    with pytest.raises(hyperdcp.FormatError, match="symbolic link") as e:
        hyperdcp.load({"w": np.zeros(6)}, str(path))
    assert "hunter2" not in str(e.value) and RANK0 in str(e.value)
    os.unlink(path / RANK0)
    os.symlink("/dev/zero", path / RANK0)  # a character device: would be read without bound
    with pytest.raises(hyperdcp.FormatError, match="symbolic link"):
        hyperdcp.read_metadata(str(path))


# -- item 8: FIFOs never hang a reader ------------------------------------------------------------------
def test_fifo_as_rank_file_hf_index_or_metadata_does_not_hang(tmp_path):
    nc = tmp_path / "ckpts" / "step-1"
    save_no_collectives(nc, {"w": np.arange(6.0)})
    os.unlink(nc / RANK0)
    os.mkfifo(nc / RANK0)
    with pytest.raises(hyperdcp.FormatError, match=r"rank-00000.json is not a regular file \(a FIFO\)"):
        hyperdcp.load({"w": np.zeros(6)}, str(nc))
    assert not hyperdcp.verify_checkpoint(str(nc)).ok
    assert hyperdcp.latest_checkpoint(str(tmp_path / "ckpts")) is None

    hf = tmp_path / "hf"
    hf.mkdir()
    from safetensors.numpy import save_file

    save_file({"a": np.ones(3, np.float32)}, str(hf / "model-00001-of-00001.safetensors"))
    os.mkfifo(hf / "model.safetensors.index.json")
    with pytest.raises(hyperdcp.FormatError, match="not a regular file"):
        hyperdcp.load({"a": np.zeros(3, np.float32)}, str(hf))
    from hyperdcp.hf import hf_to_dcp

    with pytest.raises(hyperdcp.FormatError, match="not a regular file"):
        hf_to_dcp(str(hf), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# -- item 11: sizes and shapes of metadata documents are bounded -----------------------------------------
def test_oversized_metadata_is_refused_before_reading(tmp_path, monkeypatch):
    root = tmp_path / "ckpts"
    path = root / "step-1"
    hyperdcp.save({"w": np.arange(4.0)}, str(path))
    monkeypatch.setenv("HYPERDCP_MAX_METADATA_BYTES", "4096")
    with open(path / META, "r+b") as f:
        f.truncate(1 << 30)  # sparse: the test allocates nothing, a reader that reads it would
    with pytest.raises(hyperdcp.FormatError, match=r"hyperdcp.json has 1073741824 bytes, more than the 4096-byte"):
        hyperdcp.read_metadata(str(path))
    assert not hyperdcp.verify_checkpoint(str(path)).ok
    assert hyperdcp.latest_checkpoint(str(root)) is None


@pytest.mark.parametrize("body", [
    b"[1]",
    b'{"deep":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"format":"hyperdcp-rank","version":1,"save_id":"s","rank":0,"world_size":1000000000,'
    b'"checksum_block_bytes":64,"files":[],"tensors":{},"all_tensors":[],"values":{},"user":{}}',
    b'{"format":"hyperdcp-rank","version":1,"save_id":"s","rank":0,"world_size":0,'
    b'"checksum_block_bytes":64,"files":[],"tensors":{},"all_tensors":[],"values":{},"user":{}}',
    b'{"format":"hyperdcp-rank","version":1,"save_id":"s","rank":0,"world_size":NaN,'
    b'"checksum_block_bytes":64,"files":[],"tensors":{},"all_tensors":[],"values":{},"user":{}}',
    b'{"format":"hyperdcp-rank","version":1,"save_id":"s","rank":0,"world_size":1,'
    b'"checksum_block_bytes":64,"files":[["r.safetensors",8]],"tensors":{"w":{"dtype":"F32","shape":[2],'
    b'"offsets":[[0]],"lengths":[[2]],"file":[5],"begin":[0],"end":[8],"checksums":["0"]}},'
    b'"all_tensors":[],"values":{},"user":{}}',
], ids=["list", "deep", "world-1e9", "world-0", "nan", "file-index"])
def test_hostile_rank_file_documents_give_checkpoint_errors(tmp_path, body):
    path = tmp_path / "nc"
    path.mkdir()
    (path / RANK0).write_bytes(signed_raw(body))
    with pytest.raises(hyperdcp.CheckpointError, match="rank"):
        hyperdcp.read_metadata(str(path))
    with pytest.raises(hyperdcp.CheckpointError):
        hyperdcp.load({"w": np.zeros(2, np.float32)}, str(path))


def test_deeply_nested_hf_index_is_a_format_error(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(hyperdcp.FormatError, match="index.json: not valid JSON"):
        hyperdcp.load({"a": np.zeros(3, np.float32)}, str(tmp_path))


# -- raw OS errors: EIO while reading a header ------------------------------------------------------------
def test_eio_reading_a_header_is_a_storage_error_naming_the_file():
    """/proc/self/mem at offset 0 (never mapped) fails every read with a real EIO."""
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as raw:
            os.pread(fd, 8, 0)
        assert raw.value.errno == 5  # EIO, not a simulation
        with pytest.raises(hyperdcp.StorageError, match=r"reading data file r00000-00.safetensors failed.*errno 5"):
            read_header(fd, 4096, "data file r00000-00.safetensors")
    finally:
        os.close(fd)


# -- item 5: whatever save accepts, load accepts; the rest is refused before anything is written ---------
def test_empty_key_and_65_dims_are_refused_before_writing(tmp_path):
    torch = pytest.importorskip("torch")
    with pytest.raises(hyperdcp.StateDictError, match="empty key"):
        hyperdcp.save({"": np.arange(3.0)}, str(tmp_path / "a"))
    with pytest.raises(hyperdcp.StateDictError, match="'deep' has 65 dimensions"):
        hyperdcp.save({"deep": torch.zeros([1] * 65)}, str(tmp_path / "b"))
    assert sorted(os.listdir(tmp_path)) == []


def test_64_dim_tensor_round_trips(tmp_path):
    x = np.arange(8, dtype=np.float32).reshape((2, 2, 2) + (1,) * 61)
    hyperdcp.save({"x": x, "half": x.astype(np.float16)}, str(tmp_path / "c"))
    out = {"x": np.zeros_like(x), "half": np.zeros(x.shape, np.float32)}
    hyperdcp.load(out, str(tmp_path / "c"), allow_cast=True)
    assert out["x"].tobytes() == x.tobytes() and np.array_equal(out["half"], x)


def test_hf_file_with_empty_tensor_name_is_refused_by_convert_and_load(tmp_path):
    from safetensors.numpy import save_file

    from hyperdcp.hf import hf_to_dcp

    src = tmp_path / "model.safetensors"
    save_file({"": np.ones(3, np.float32), "b": np.ones(2, np.float32)}, str(src))
    with pytest.raises(hyperdcp.FormatError, match="empty name"):
        hf_to_dcp(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(hyperdcp.FormatError, match="empty name"):
        hyperdcp.load({"b": np.zeros(2, np.float32)}, str(src), strict=False)


# -- item 4: an overwrite racing a reader -------------------------------------------------------------------
@pytest.mark.parametrize("verify", [True, False], ids=["checksums", "no-checksums"])
def test_load_racing_overwrites_reads_one_version_or_says_it_was_replaced(tmp_path, verify):
    """Each save writes version k into every tensor (several data files); a load returns one version
    whole, or a StorageError saying the checkpoint was replaced -- never a false corruption, never a mix."""
    path = str(tmp_path / "c")
    keys = [f"t{i}" for i in range(8)]

    def state(k):
        return {key: np.full(256, k, np.int64) for key in keys}

    hyperdcp.save(state(0), path, files_per_rank=8)
    stop = threading.Event()
    saved = []

    def writer():
        k = 1
        while not stop.is_set():
            hyperdcp.save(state(k), path, files_per_rank=8, overwrite=True)
            saved.append(k)
            k += 1

    th = threading.Thread(target=writer)
    th.start()
    ok = replaced = 0
    try:
        while len(saved) < 30:
            out = state(-1)
            try:
                hyperdcp.load(out, path, verify_checksums=verify)
            except hyperdcp.StorageError as e:
                assert "replaced by another save" in str(e), e
                replaced += 1
                continue
            versions = {int(v[0]) for v in out.values()} | {int(x) for v in out.values() for x in np.unique(v)}
            assert len(versions) == 1, f"a load mixed versions {sorted(versions)}"
            ok += 1
    finally:
        stop.set()
        th.join()
    assert ok > 0


# -- item 3: every rank names the same checkpoint --------------------------------------------------------------
def _paths_across_ranks(rank, world, root):
    import hyperdcp

    a, b = f"{root}/A", f"{root}/B"
    out = {}
    # save: rank 0 to A, rank 1 to B -> refused on both ranks, neither path holds a checkpoint
    try:
        hyperdcp.save({"w": np.full(4, rank, np.float32)}, a if rank == 0 else b)
        out["save"] = "ok"
    except hyperdcp.MismatchError as e:
        out["save"] = str(e)
    # load: A and B exist with the same structure; rank 0 asks for A, rank 1 for B
    hyperdcp.save({"w": np.full(4, 1.0, np.float32)}, f"{root}/A2")
    hyperdcp.save({"w": np.full(4, 2.0, np.float32)}, f"{root}/B2")
    mine = {"w": np.zeros(4, np.float32)}
    try:
        hyperdcp.load(mine, f"{root}/A2" if rank == 0 else f"{root}/B2")
        out["load"] = "ok"
    except hyperdcp.CheckpointError as e:
        out["load"] = f"{type(e).__name__}: {e}"
    out["untouched"] = bool((mine["w"] == 0).all())
    # latest_checkpoint: rank 0 resolves, every rank gets its answer (here each rank sees another root)
    own = f"{root}/runs{rank}"
    hyperdcp.save({"w": np.zeros(2, np.float32)}, f"{own}/step-{5 + rank}", coordinator=_local())
    out["latest"] = hyperdcp.latest_checkpoint(own)
    out["local"] = hyperdcp.latest_checkpoint(own, shared=False)
    out["64 dims"] = _save_64_dims(rank, world, f"{root}/d64")  # item 5, in the same spawned run
    return out


def _local():
    from hyperdcp.coordination.base import LocalCoordinator

    return LocalCoordinator()


@spawns
def test_ranks_passing_different_paths_fail_on_every_rank(tmp_path):
    res = run_ranks(2, _paths_across_ranks, str(tmp_path), timeout=60)
    for r in (0, 1):
        assert "different checkpoint paths to save" in res[r]["save"], res[r]
        assert res[r]["load"] != "ok" and "rank 1 passed checkpoint path" in res[r]["load"], res[r]
        assert res[r]["untouched"]
        assert res[r]["latest"] == f"{tmp_path}/runs0/step-5"
    assert res[1]["local"] == f"{tmp_path}/runs1/step-6"
    assert not os.path.exists(tmp_path / "A" / META) and not os.path.exists(tmp_path / "B" / META)
    # item 5, sharded: a 64-dim DTensor saved split on its last dimension loaded on another layout
    assert res[0]["64 dims"] and res[1]["64 dims"]
    out = {"x": np.zeros((2,) + (1,) * 62 + (8,), np.float32)}
    hyperdcp.load(out, str(tmp_path / "d64"))  # one process: two chunks into one strided destination
    assert out["x"].tobytes() == np.arange(16, dtype=np.float32).tobytes()


# -- item 5, sharded: a 64-dim DTensor split on its last dimension --------------------------------------------
def _save_64_dims(rank, world, path):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import hyperdcp

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(16, dtype=torch.float32).reshape((2,) + (1,) * 62 + (8,))
    hyperdcp.save({"x": distribute_tensor(full, mesh, [Shard(63)])}, path)
    back = distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])  # another layout: strided pieces
    hyperdcp.load({"x": back}, path)
    return bool(torch.equal(back.full_tensor(), full))
