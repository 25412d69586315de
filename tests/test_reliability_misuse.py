"""Bad input and misuse (issue 5): each is a clear CheckpointError that says what to do; nothing is
written, nothing is lost. Also disk full and a read-only target."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import numpy as np
import pytest

import hyperdcp
from hyperdcp.storage.local_commit import SaveTarget
from tests.faults.fuzz_campaign import sign


def _state():
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.int64), "step": 5}


def _zeros():
    return {"w": np.zeros((3, 4), np.float32), "b": np.zeros(4, np.int64), "step": None}


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "step-1")
    hyperdcp.save(_state(), path)
    return path


def _snapshot(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[p] = open(p, "rb").read()
    return out


def test_shape_mismatch(ckpt):
    sd = _zeros()
    sd["w"] = np.zeros((4, 3), np.float32)
    with pytest.raises(hyperdcp.MismatchError, match=r"'w'.*shape \[3, 4\].*load into a tensor of the saved shape"):
        hyperdcp.load(sd, ckpt)
    assert not sd["b"].any(), "a failed load must not have written anything"


def test_dtype_mismatch(ckpt):
    sd = _zeros()
    sd["w"] = np.zeros((3, 4), np.float64)
    with pytest.raises(hyperdcp.MismatchError, match="allow_cast=True"):
        hyperdcp.load(sd, ckpt)
    hyperdcp.load(sd, ckpt, allow_cast=True)
    assert (sd["w"] == _state()["w"]).all()


def test_missing_and_unexpected_keys(ckpt):
    sd = _zeros()
    sd["extra"] = np.zeros(2)
    with pytest.raises(hyperdcp.MismatchError, match=r"\['extra'\].*strict=False"):
        hyperdcp.load(sd, ckpt)
    res = hyperdcp.load(sd, ckpt, strict=False)
    assert res.missing_keys == ["extra"] and (sd["w"] == _state()["w"]).all()
    sub = {"w": np.zeros((3, 4), np.float32)}  # keys of the checkpoint not asked for: reported, not an error
    res = hyperdcp.load(sub, ckpt)
    assert res.unused_keys == ["b", "step"]


def test_value_type_that_cannot_be_stored(tmp_path):
    path = str(tmp_path / "ck")
    with pytest.raises(hyperdcp.StateDictError, match="never pickles"):
        hyperdcp.save({"w": np.zeros(2), "fn": object()}, path)
    assert not os.path.exists(path) and all("tmp" not in e for e in os.listdir(tmp_path))


def test_newer_format_version(ckpt):
    raw = open(os.path.join(ckpt, "hyperdcp.json"), "rb").read()
    doc = json.loads(raw)
    del doc["metadata_checksum"]
    doc["format_version"] = 99
    open(os.path.join(ckpt, "hyperdcp.json"), "wb").write(sign(doc))
    with pytest.raises(hyperdcp.UnsupportedVersionError, match="upgrade hyperdcp"):
        hyperdcp.load(_zeros(), ckpt)


def test_two_saves_racing_for_one_path(tmp_path, ckpt):
    holder = SaveTarget(ckpt, overwrite=True)
    holder.prepare()  # another save holds the lock and is writing
    try:
        before = _snapshot(ckpt)
        with pytest.raises(hyperdcp.CheckpointExistsError, match="in progress"):
            hyperdcp.save(_state(), ckpt, overwrite=True)
        assert _snapshot(ckpt) == before
    finally:
        holder.abort()
    hyperdcp.save(_state(), ckpt, overwrite=True)  # free again


def test_save_over_existing_checkpoint_and_into_a_file(tmp_path, ckpt):
    with pytest.raises(hyperdcp.CheckpointExistsError, match="overwrite=True"):
        hyperdcp.save(_state(), ckpt)
    f = tmp_path / "afile"
    f.write_bytes(b"keep me")
    with pytest.raises(hyperdcp.StorageError, match="existing file"):
        hyperdcp.save(_state(), str(f))
    assert f.read_bytes() == b"keep me"


def test_load_from_empty_or_missing_path(tmp_path):
    with pytest.raises(hyperdcp.CheckpointNotFoundError, match="does not exist"):
        hyperdcp.load(_zeros(), str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(hyperdcp.IncompleteCheckpointError, match="load an earlier checkpoint"):
        hyperdcp.load(_zeros(), str(tmp_path / "empty"))
    (tmp_path / ".gone.hyperdcp-tmp-0123456789ab").mkdir()  # what an interrupted save leaves
    with pytest.raises(hyperdcp.IncompleteCheckpointError, match="interrupted"):
        hyperdcp.load(_zeros(), str(tmp_path / "gone"))
    assert hyperdcp.latest_checkpoint(str(tmp_path)) is None


def test_latest_checkpoint_skips_incomplete(tmp_path):
    root = tmp_path
    for s in (1, 20, 3):
        hyperdcp.save(_state(), str(root / f"step-{s}"))
    (root / "step-30").mkdir()  # interrupted: no metadata
    (root / ".step-40.hyperdcp-tmp-00aa").mkdir()
    hyperdcp.save(_state(), str(root / "step-25"))
    os.unlink(root / "step-25" / "hyperdcp.json")
    assert hyperdcp.latest_checkpoint(str(root)) == str(root / "step-20")
    assert [os.path.basename(p) for p in hyperdcp.list_checkpoints(str(root))] == ["step-1", "step-3", "step-20"]


def _mount_tmpfs(path, opts):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def _check_disk_full(root):
    prev = os.path.join(root, "step-1")
    hyperdcp.save({"w": np.arange(1000, dtype=np.float32)}, prev)
    big = {"w": np.random.default_rng(0).standard_normal(600_000).astype(np.float32)}  # 2.4 MB
    with pytest.raises(hyperdcp.StorageError, match="free space|No space"):
        hyperdcp.save(big, os.path.join(root, "step-2"))
    assert not os.path.exists(os.path.join(root, "step-2"))
    assert [e for e in os.listdir(root) if "tmp" in e] == []  # the partial save was removed
    back = {"w": np.zeros(1000, np.float32)}
    hyperdcp.load(back, prev)
    assert (back["w"] == np.arange(1000)).all()
    assert hyperdcp.latest_checkpoint(root) == prev
    with pytest.raises(hyperdcp.CheckpointNotFoundError):
        hyperdcp.load(big, os.path.join(root, "step-2"))


def test_disk_full_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "size=1m"):
        pytest.skip("cannot mount a tmpfs here (not root); test_disk_full_injected covers it")
    try:
        _check_disk_full(str(mnt))
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_disk_full_injected(tmp_path, monkeypatch):
    real_write, budget = os.write, [200_000]

    def write(fd, data):
        n = len(data)
        if budget[0] < n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget[0] -= n
        return real_write(fd, data)

    hyperdcp.save({"w": np.arange(1000, dtype=np.float32)}, str(tmp_path / "step-1"))
    monkeypatch.setattr(os, "write", write)
    big = {"w": np.ones(600_000, np.float32)}
    with pytest.raises(hyperdcp.StorageError, match="free space"):
        hyperdcp.save(big, str(tmp_path / "step-2"))
    monkeypatch.undo()
    assert hyperdcp.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-1")
    assert [e for e in os.listdir(tmp_path) if "tmp" in e] == []


def test_read_only_target(tmp_path, monkeypatch):
    mnt = tmp_path / "ro"
    if os.geteuid() == 0 and _mount_tmpfs(mnt, "size=1m,ro"):
        try:
            with pytest.raises(hyperdcp.StorageError, match="not writable"):
                hyperdcp.save(_state(), str(mnt / "step-1"))
        finally:
            subprocess.run(["umount", "-l", str(mnt)])
        return
    mnt.mkdir()
    mnt.chmod(0o555)
    with pytest.raises(hyperdcp.StorageError, match="not writable"):
        hyperdcp.save(_state(), str(mnt / "step-1"))


def test_read_only_target_fails_before_any_work(tmp_path, monkeypatch):
    created = []  # tripwires on the standard library: every file or directory the save would create
    real_open, real_mkdir = os.open, os.mkdir

    def tripwire_open(path, flags, *a, **k):
        if flags & os.O_CREAT:
            created.append(path)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", tripwire_open)
    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: created.append(path) or real_mkdir(path, *a, **k))
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    with pytest.raises(hyperdcp.StorageError, match="read-only"):
        hyperdcp.save(_state(), str(tmp_path / "step-1"))
    monkeypatch.undo()
    assert created == [] and os.listdir(tmp_path) == []  # no lock, no temporary directory, no data file
