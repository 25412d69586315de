"""Saving to and loading from s3:// URLs against a real S3 API server (moto's server mode on 127.0.0.1).

The clients reach the server through the standard AWS environment variables only (``s3`` fixture:
AWS_ENDPOINT_URL over plain http, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION). What is on
the server is checked with boto3 directly, so a test never trusts the code it checks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import hyperdcp
from hyperdcp.storage.object_store import ObjectStorage

MiB = 1 << 20


def _state(seed: int = 0, n: int = 3 * MiB) -> dict:
    rng = np.random.default_rng(seed)
    return {"model": {"w": rng.standard_normal(n // 4).astype(np.float32), "b": rng.integers(0, 9, 7)},
            "step": seed, "name": f"run-{seed}"}


def _zeros(like: dict) -> dict:
    return {"model": {k: np.zeros_like(v) for k, v in like["model"].items()}, "step": 0, "name": ""}


def _same(a: dict, b: dict) -> None:
    for k in a["model"]:
        assert a["model"][k].dtype == b["model"][k].dtype and np.array_equal(a["model"][k], b["model"][k]), k
    assert (a["step"], a["name"]) == (b["step"], b["name"])


def _keys(s3, prefix: str = "") -> list[str]:
    resp = s3.boto().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def test_save_load_round_trip_with_multipart_and_ranged_reads(s3):
    """A 12 MiB tensor goes up as a parallel multipart upload (5 MiB parts) and comes back bit-exact from
    ranged GETs; the objects on the server are exactly the record and the data file it lists."""
    url = f"s3://{s3.bucket}/run/step-1"
    sd = _state(1, n=12 * MiB)
    res = hyperdcp.save(sd, url, storage_options={"part_bytes": 5 * MiB, "single_put_bytes": 0})
    assert res.path == url and res.metadata.data_file_bytes == res.bytes_written
    record = json.loads(s3.boto().get_object(Bucket=s3.bucket, Key="run/step-1/hyperdcp.json")["Body"].read())
    assert _keys(s3) == sorted(["run/step-1/hyperdcp.json"] + [f"run/step-1/{f['name']}" for f in record["files"]])
    head = s3.boto().head_object(Bucket=s3.bucket, Key=f"run/step-1/{record['files'][0]['name']}")
    # 12 MiB + header: a 5 MiB part, then the 7 MiB tail (a PUT has no -N)
    assert head["ETag"].strip('"').endswith("-2")
    back = _zeros(sd)
    out = hyperdcp.load(back, url)
    _same(sd, back)
    tensor_bytes = sum(v.nbytes for v in sd["model"].values())
    assert tensor_bytes <= out.bytes_read <= res.metadata.data_file_bytes  # each byte read once
    assert s3.boto().list_multipart_uploads(Bucket=s3.bucket).get("Uploads") is None


def test_a_file_that_fits_the_upload_window_goes_up_in_one_put(s3):
    """With 5 MiB parts and 4 in flight, a 12 MiB data file is within ``single_put_bytes`` (4 x 5 MiB by
    default): one PUT (its ETag has no -N part count), no multipart upload; a file over it is multipart."""
    sd = _state(3, n=12 * MiB)
    for name, opts, parts in (("small", {}, None), ("big", {"single_put_bytes": 10 * MiB}, "-2")):
        url = f"s3://{s3.bucket}/{name}"
        hyperdcp.save(sd, url, storage_options={"part_bytes": 5 * MiB, **opts})
        record = json.loads(s3.boto().get_object(Bucket=s3.bucket, Key=f"{name}/hyperdcp.json")["Body"].read())
        etag = s3.boto().head_object(Bucket=s3.bucket, Key=f"{name}/{record['files'][0]['name']}")["ETag"].strip('"')
        assert ("-" in etag) == (parts is not None) and (parts is None or etag.endswith(parts)), (name, etag)
        back = _zeros(sd)
        hyperdcp.load(back, url)
        _same(sd, back)
    assert s3.boto().list_multipart_uploads(Bucket=s3.bucket).get("Uploads") is None


def test_borrowed_pieces_go_up_from_the_callers_buffers_and_copies_from_their_own(s3):
    """``write_borrowed`` keeps a view of the caller's buffer until ``close`` (a save's staged chunks go up
    from where they are, no joined copy of the file); ``write`` copies. The object is the pieces in order,
    through one PUT and through a multipart upload whose 5 MiB parts cut across pieces."""
    rng = np.random.default_rng(5)
    for name, single in (("one-put", None), ("multipart", 0)):
        opts = {"part_bytes": 5 * MiB, **({} if single is None else {"single_put_bytes": single})}
        st = ObjectStorage(f"s3://{s3.bucket}/{name}", opts)
        borrowed = rng.integers(0, 255, 7 * MiB, dtype=np.uint8)
        copied = rng.integers(0, 255, 3 * MiB + 11, dtype=np.uint8)
        tiny = np.arange(100, dtype=np.uint8)  # under SMALL_PIECE: copied even when borrowed
        with st.begin_in_place(0).create("r00000-00.safetensors") as w:
            w.write(b"hdr")
            w.write_borrowed(borrowed)
            w.write(copied)
            w.write_borrowed(tiny)
            w.write_borrowed(borrowed[:MiB])
            if single is None:  # nothing sent before close: what goes up is the borrowed buffer as it is then
                np.invert(borrowed, out=borrowed)
            want = b"hdr" + borrowed.tobytes() + copied.tobytes() + tiny.tobytes() + borrowed[:MiB].tobytes()
            copied[:] = 0  # written by copy: the upload is unchanged
            tiny[:] = 0
        got = s3.boto().get_object(Bucket=s3.bucket, Key=f"{name}/r00000-00.safetensors")["Body"].read()
        assert got == want, name
        etag = s3.boto().head_object(Bucket=s3.bucket, Key=f"{name}/r00000-00.safetensors")["ETag"].strip('"')
        assert etag.endswith("-2") if single == 0 else "-" not in etag, (name, etag)  # 11 MiB: 5 + 6 MiB
        st.close()
    assert s3.boto().list_multipart_uploads(Bucket=s3.bucket).get("Uploads") is None


@pytest.mark.parametrize("fmt", ["v1", "v2"])
def test_existing_checkpoint_is_refused_and_overwrite_replaces_it_cleanly(s3, fmt, monkeypatch):
    if fmt == "v2":  # a binary chunk index beside the record (format 2): replaced like the data objects
        monkeypatch.setenv("HYPERDCP_INDEX_MIN_CHUNKS", "0")
    url = f"s3://{s3.bucket}/ck"
    hyperdcp.save(_state(1), url)
    first = _keys(s3)
    assert any("hyperdcp-index-" in k for k in first) == (fmt == "v2")
    with pytest.raises(hyperdcp.CheckpointExistsError, match="overwrite=True"):
        hyperdcp.save(_state(2), url)
    assert _keys(s3) == first  # the refused save left nothing behind
    hyperdcp.save(_state(2), url, overwrite=True)
    now = _keys(s3)
    assert len(now) == len(first) and set(now) & set(first) == {"ck/hyperdcp.json"}  # replaced data deleted
    back = _zeros(_state(2))
    hyperdcp.load(back, url)
    _same(_state(2), back)


def test_commit_record_is_a_conditional_put(s3):
    """Two saves race to one URL: the one whose record lands second fails (If-None-Match) and removes its
    objects; the checkpoint is the first one's, whole."""
    url = f"s3://{s3.bucket}/race"
    st = ObjectStorage(url)
    a, b = st.begin_save(overwrite=False), st.begin_save(overwrite=False)  # both see no checkpoint
    hyperdcp.save(_state(1), url)  # "a" stands for another job that commits first
    with pytest.raises(hyperdcp.CheckpointExistsError, match="another save"):
        with b.create(f"r00000-{b.token}-00.safetensors") as w:
            w.write(b"x" * 100)
        try:
            b.commit(s3.boto().get_object(Bucket=s3.bucket, Key="race/hyperdcp.json")["Body"].read()[:-1] + b" ")
        except hyperdcp.CheckpointExistsError:
            b.abort()
            raise
    assert not any(b.token in k for k in _keys(s3))
    a.abort()
    back = _zeros(_state(1))
    hyperdcp.load(back, url)
    _same(_state(1), back)


def test_latest_checkpoint_lists_committed_checkpoints_only(s3):
    root = f"s3://{s3.bucket}/run"
    assert hyperdcp.latest_checkpoint(root) is None
    for step in (100, 20, 300):
        hyperdcp.save(_state(step, n=4096), f"{root}/step-{step}")
    # an interrupted save: data objects under a new step, no record
    s3.boto().put_object(Bucket=s3.bucket, Key="run/step-400/r00000-0123456789ab-00.safetensors", Body=b"partial")
    # a damaged record is no checkpoint either
    s3.boto().put_object(Bucket=s3.bucket, Key="run/step-500/hyperdcp.json", Body=b"{not json")
    assert hyperdcp.latest_checkpoint(root) == f"{root}/step-300"
    assert hyperdcp.list_checkpoints(root) == [f"{root}/step-{s}" for s in (20, 100, 300)]
    with pytest.raises(hyperdcp.IncompleteCheckpointError, match="step-400"):
        hyperdcp.load(_zeros(_state(0, n=4096)), f"{root}/step-400")
    with pytest.raises(hyperdcp.CheckpointNotFoundError, match="step-999"):
        hyperdcp.read_metadata(f"{root}/step-999")


def test_cli_inspect_verify_diff_on_urls(s3, capsys):
    from hyperdcp.cli import main as cli

    a, b = f"s3://{s3.bucket}/a", f"s3://{s3.bucket}/b"
    hyperdcp.save(_state(1, n=MiB), a)
    hyperdcp.save(_state(2, n=MiB), b)
    capsys.readouterr()
    assert cli(["inspect", a, "--json"]) == 0
    assert "model.w" in [t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]]
    assert cli(["verify", a]) == 0
    assert cli(["diff", a, a]) == 0
    assert cli(["diff", a, b]) != 0
    # damage one byte of the data file on the server: verify names it
    name = hyperdcp.read_metadata(a).files[0].name
    key = f"a/{name}"
    raw = bytearray(s3.boto().get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    raw[-5] ^= 0xFF
    s3.boto().put_object(Bucket=s3.bucket, Key=key, Body=bytes(raw))
    capsys.readouterr()
    assert cli(["verify", a]) != 0
    assert name in "".join(capsys.readouterr())
    with pytest.raises(hyperdcp.CorruptionError, match=name):
        hyperdcp.load(_zeros(_state(1, n=MiB)), a)


def test_storage_options_and_the_other_client(s3, monkeypatch):
    """storage_options carry the endpoint and credentials (no environment), and pick the obstore client."""
    opts = {"endpoint_url": s3.endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}
    for k in s3.env:
        monkeypatch.delenv(k)
    url = f"s3://{s3.bucket}/opts"
    hyperdcp.save(_state(3), url, storage_options=opts)
    back = _zeros(_state(3))
    hyperdcp.load(back, url, storage_options=opts)
    _same(_state(3), back)
    ob = {"client": "obstore", "endpoint": s3.endpoint, "access_key_id": "testing", "secret_access_key": "testing",
          "region": "us-east-1"}
    back = _zeros(_state(3))
    hyperdcp.load(back, url, storage_options=ob)
    _same(_state(3), back)
    hyperdcp.save(_state(4, n=12 * MiB), f"s3://{s3.bucket}/obstore", storage_options=ob)
    back = _zeros(_state(4, n=12 * MiB))
    hyperdcp.load(back, f"s3://{s3.bucket}/obstore", storage_options=opts)
    _same(_state(4, n=12 * MiB), back)


def test_core_imports_without_the_s3_packages():
    code = ("import sys; sys.modules['s3fs'] = None; sys.modules['obstore'] = None; sys.modules['boto3'] = None\n"
            "import hyperdcp, numpy as np\n"
            "try:\n    hyperdcp.save({'w': np.ones(2)}, 's3://bkt/x')\n"
            "except hyperdcp.StorageError as e:\n    assert 'hyperdcp[s3]' in str(e), e; print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "ok", r.stderr


def test_checkpoint_manager_on_s3_keeps_the_last_steps_and_restores_the_newest(s3):
    """The same CheckpointManager on a bucket: retention deletes whole steps (record first, then their objects),
    only committed steps are listed, and restore loads the newest bit-exact."""
    root = f"s3://{s3.bucket}/run"
    mgr = hyperdcp.CheckpointManager(root, keep_last=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, _state(step, n=64 << 10), metrics={"loss": 1.0 / step})
    mgr.close()
    assert hyperdcp.CheckpointManager(root).steps() == [3, 4]
    assert {k.split("/")[1] for k in _keys(s3, "run/")} == {"step-3", "step-4"}  # nothing of steps 1, 2 is left
    got = _zeros(_state(4, n=64 << 10))
    assert hyperdcp.CheckpointManager(root).restore(got) == 4
    _same(got, _state(4, n=64 << 10))
    assert hyperdcp.CheckpointManager(root).metrics(4) == {"loss": 0.25}


def test_format_2_checkpoints_are_listed_and_restored_by_latest_and_the_manager(s3, monkeypatch):
    """A checkpoint with a binary chunk index (format 2, what large models get) counts as committed on S3:
    latest_checkpoint finds it and the CheckpointManager lists, restores and reads its metrics."""
    monkeypatch.setenv("HYPERDCP_INDEX_MIN_CHUNKS", "0")
    root = f"s3://{s3.bucket}/run"
    mgr = hyperdcp.CheckpointManager(root)
    mgr.save(7, _state(7, n=64 << 10), metrics={"loss": 0.5})
    mgr.close()
    assert any("hyperdcp-index-" in k for k in _keys(s3, "run/step-7/"))
    assert hyperdcp.latest_checkpoint(root) == f"{root}/step-7"
    fresh = hyperdcp.CheckpointManager(root)
    assert fresh.steps() == [7] and fresh.metrics(7) == {"loss": 0.5}
    got = _zeros(_state(7, n=64 << 10))
    assert fresh.restore(got) == 7
    _same(got, _state(7, n=64 << 10))
    assert hyperdcp.verify_checkpoint(f"{root}/step-7").ok
    assert hyperdcp.read_metadata(f"{root}/step-7").format_version == 2


def test_adjacent_reads_of_one_file_are_one_request_with_the_same_bytes(s3):
    from hyperdcp.loading.coalesced_reads import CoalescedReads
    from hyperdcp.sources.remote import RemoteFiles, load_remote_metadata

    url = f"s3://{s3.bucket}/ck"
    a, b = np.arange(300_000, dtype=np.float32), np.arange(200_000, dtype=np.int64)
    hyperdcp.save({"a": a, "b": b}, url)  # one data file: a's chunk then b's, back to back
    meta = load_remote_metadata(url)
    spans = []
    for name in ("a", "b"):
        ch = meta.tensors[name].chunks
        spans.append((int(ch.file[0]), int(ch.begin[0]), int(ch.end[0] - ch.begin[0])))
    assert spans[0][0] == spans[1][0] and spans[0][1] + spans[0][2] == spans[1][1]
    files = RemoteFiles(url, meta)
    files.fd(spans[0][0])  # the file's size and header check: one request of its own
    before = files.requests
    reads = CoalescedReads(files, spans, 16 << 20)
    got = [np.empty(n, np.uint8) for _, _, n in spans]
    for (f, off, _), out in zip(reversed(spans), reversed(got)):  # in any order
        reads.read_into(f, off, out)
    assert reads.runs == 1 and files.requests - before == 1
    assert got[0].view(np.float32).tolist() == a.tolist() and got[1].view(np.int64).tolist() == b.tolist()
    assert files.bytes_read == spans[0][2] + spans[1][2]  # the same bytes, once
    files.close()


def test_a_files_first_read_and_its_header_check_are_one_request(s3):
    """The first read of a data file, when it starts at the file's first tensor and fits one request, comes
    with the file's size and header check in one ranged GET; the same bytes reach the reader, a corrupt
    header is still refused, and reads elsewhere in a file still check it first with a GET of its own."""
    from hyperdcp.loading.coalesced_reads import CoalescedReads
    from hyperdcp.sources.remote import RemoteFiles, load_remote_metadata

    url = f"s3://{s3.bucket}/first"
    a, b = np.arange(300_000, dtype=np.float32), np.arange(200_000, dtype=np.int64)
    hyperdcp.save({"a": a, "b": b}, url)
    meta = load_remote_metadata(url)
    spans = [(int(c.file[0]), int(c.begin[0]), int(c.end[0] - c.begin[0]))
             for c in (meta.tensors[k].chunks for k in "ab")]
    files = RemoteFiles(url, meta)
    reads = CoalescedReads(files, spans, 16 << 20)
    got = [np.empty(n, np.uint8) for _, _, n in spans]
    for (f, off, n), out in zip(spans, got):
        reads.fd(f, (off, n))
        reads.read_into(f, off, out)
    assert files.requests == 1  # the check, a's bytes and b's bytes: one GET
    assert got[0].view(np.float32).tolist() == a.tolist() and got[1].view(np.int64).tolist() == b.tolist()
    assert files.bytes_read == spans[0][2] + spans[1][2] and files.header_bytes_read == spans[0][1]
    files.close()

    later = RemoteFiles(url, meta)  # a reader of b only: b starts 1.2 MB into the file, so folding its read into
    f, off, n = spans[1]           # the check would fetch a's bytes for nothing: a check GET, then b's GET
    out = np.empty(n, np.uint8)
    later.fd(f, (off, n))
    later.read_into(f, off, out)
    assert later.requests == 2 and out.view(np.int64).tolist() == b.tolist() and later.bytes_read == n
    assert later.header_bytes_read < off
    later.close()

    name = meta.files[spans[0][0]].name  # a header that no longer matches the record is refused, fold or not
    key = f"first/{name}"
    raw = bytearray(s3.boto().get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    raw[10:12] = b"XX"
    s3.boto().put_object(Bucket=s3.bucket, Key=key, Body=bytes(raw))
    bad = RemoteFiles(url, meta)
    with pytest.raises(hyperdcp.CheckpointError, match=name):
        bad.fd(spans[0][0], (spans[0][1], spans[0][2]))
    bad.close()


def _four_tensor_file(s3, name: str):
    """A checkpoint of four 1 MiB tensors in one data file, and its four chunk spans in file order."""
    from hyperdcp.sources.remote import load_remote_metadata

    url = f"s3://{s3.bucket}/{name}"
    arrays = {k: np.full(MiB // 4, i + 1, np.float32) for i, k in enumerate("abcd")}
    hyperdcp.save(arrays, url)
    meta = load_remote_metadata(url)
    spans = sorted((int(c.file[0]), int(c.begin[0]), int(c.end[0] - c.begin[0]))
                   for c in (meta.tensors[k].chunks for k in "abcd"))
    assert len({f for f, _, _ in spans}) == 1
    return url, meta, spans, arrays


class _HeldCheck(ObjectStorage):
    """An S3 location whose file checks (``probe_into``) start, then wait until another request went out."""

    def __init__(self, url: str):
        import threading

        super().__init__(url)
        self.checking, self.other_request = threading.Event(), threading.Event()

    def probe_into(self, name, out, what="file"):
        self.checking.set()
        assert self.other_request.wait(20), "no other request went out while the check was in flight"
        return super().probe_into(name, out, what)

    def fetch_into(self, name, offset, out):
        got = super().fetch_into(name, offset, out)
        self.other_request.set()
        return got


def test_a_run_is_requested_while_another_thread_checks_its_file_and_handed_over_once_checked(s3):
    """Two runs of one file (a+b, c+d): the thread fetching c+d does not wait for the check the other thread
    folded into its a+b request; every byte arrives exactly once, in two requests."""
    from concurrent.futures import ThreadPoolExecutor

    from hyperdcp.loading.coalesced_reads import CoalescedReads
    from hyperdcp.sources.remote import RemoteFiles

    url, meta, spans, arrays = _four_tensor_file(s3, "early")
    storage = _HeldCheck(url)
    files = RemoteFiles(url, meta, storage=storage)
    reads = CoalescedReads(files, spans, 2 * spans[0][2])  # runs of two spans
    assert reads.runs == 2
    got = [np.empty(n, np.uint8) for _, _, n in spans]

    def one(i: int) -> None:
        if i == 2:
            assert storage.checking.wait(20)  # c's thread starts once a's thread is checking the file
        f, off, n = spans[i]
        reads.fd(f, (off, n))
        reads.read_into(f, off, got[i])

    with ThreadPoolExecutor(2) as ex:
        list(ex.map(one, [0, 2]))
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(one, [1, 3]))
    for i, k in enumerate("abcd"):
        assert got[i].view(np.float32).tolist() == arrays[k].tolist(), k
    assert files.requests == 2 and files.bytes_read == sum(n for _, _, n in spans)
    files.close()


def test_a_read_that_went_out_during_the_check_of_a_truncated_file_raises_the_checks_error(s3):
    """The early request of c+d meets a truncated object; both threads raise the check's error (the size), not a
    short read, and nothing is handed over."""
    from concurrent.futures import ThreadPoolExecutor

    from hyperdcp.loading.coalesced_reads import CoalescedReads
    from hyperdcp.sources.remote import RemoteFiles

    url, meta, spans, _ = _four_tensor_file(s3, "early-bad")
    key = f"early-bad/{meta.files[spans[0][0]].name}"
    raw = s3.boto().get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    s3.boto().put_object(Bucket=s3.bucket, Key=key, Body=raw[: spans[2][1] + 10])  # cut inside c
    storage = _HeldCheck(url)
    files = RemoteFiles(url, meta, storage=storage)
    reads = CoalescedReads(files, spans, 2 * spans[0][2])

    def one(i: int) -> str:
        if i == 2:
            assert storage.checking.wait(20)
        f, off, n = spans[i]
        with pytest.raises(hyperdcp.CorruptionError) as e:
            reads.read_into(f, off, np.empty(n, np.uint8))
        return str(e.value)

    with ThreadPoolExecutor(2) as ex:
        msgs = list(ex.map(one, [0, 2]))
    for m in msgs:
        assert "bytes but the metadata records" in m and meta.files[spans[0][0]].name in m, m
    files.close()


def test_four_threads_reading_two_runs_at_once_request_each_byte_once(s3):
    """However the threads of a read-once batch interleave, each run is one request and each byte is read once;
    the file's check is folded into the first run's request unless the other run's thread checks the file first
    (then the check is a small request of its own)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from hyperdcp.loading.coalesced_reads import CoalescedReads
    from hyperdcp.sources.remote import RemoteFiles

    url, meta, spans, arrays = _four_tensor_file(s3, "race")
    for trial in range(6):
        files = RemoteFiles(url, meta)
        reads = CoalescedReads(files, spans, 2 * spans[0][2])
        got = [np.empty(n, np.uint8) for _, _, n in spans]
        go = threading.Barrier(4)

        def one(i: int, go=go, reads=reads, got=got) -> None:
            go.wait(10)
            f, off, n = spans[i]
            reads.fd(f, (off, n))
            reads.read_into(f, off, got[i])

        order = list(range(4)) if trial % 2 else [3, 1, 2, 0]
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(one, order))
        for i, k in enumerate("abcd"):
            assert got[i].view(np.float32).tolist() == arrays[k].tolist(), (trial, k)
        folded = files.header_bytes_read == spans[0][1]  # the check fetched the header and a+b, nothing more
        assert files.requests == (2 if folded else 3), trial
        assert files.bytes_read == sum(n for _, _, n in spans), trial
        files.close()


class _Targets(ObjectStorage):
    """An S3 location that records where every streamed GET wrote (the start address of each target)."""

    def __init__(self, url: str):
        super().__init__(url)
        self.targets: list[int] = []

    def _note(self, out) -> None:
        for v in out if isinstance(out, list) else [out]:
            self.targets.append(np.frombuffer(memoryview(v).cast("B"), np.uint8).ctypes.data)

    def probe_into(self, name, out, what="file"):
        self._note(out)
        return super().probe_into(name, out, what)

    def fetch_into(self, name, offset, out):
        self._note(out)
        return super().fetch_into(name, offset, out)


@pytest.mark.parametrize("order", ["file order", "reversed"])
def test_runs_whose_buffers_lie_back_to_back_are_streamed_straight_into_them(s3, monkeypatch, order):
    """When a batch's units sit in one target buffer in file order (read-once's shared-memory slots), each run's
    GET, the first one with the file's check folded in, writes into the target itself: no run buffer and nothing
    copied afterwards. Units laid out in another order fall back to a run buffer; the bytes are the same."""
    from hyperdcp.core import buffers
    from hyperdcp.loading import coalesced_reads
    from hyperdcp.loading.coalesced_reads import CoalescedReads
    from hyperdcp.sources.remote import RemoteFiles

    url, meta, spans, arrays = _four_tensor_file(s3, f"inplace-{order[0]}")
    storage = _Targets(url)
    files = RemoteFiles(url, meta, storage=storage)
    n = spans[0][2]
    target = np.zeros(4 * n, np.uint8)
    at = [i * n for i in range(4)] if order == "file order" else [(3 - i) * n for i in range(4)]
    copies = []
    monkeypatch.setattr(coalesced_reads, "copy_into", lambda *a: (copies.append(1), buffers.copy_into(*a)))
    reads = CoalescedReads(files, spans, 2 * n, target, at)
    for (f, off, k), a in zip(spans, at):
        reads.fd(f, (off, k), target[a:a + k])
        reads.read_into(f, off, target[a:a + k])
    for (_, _, k), a, name in zip(spans, at, "abcd"):
        assert target[a:a + k].view(np.float32).tolist() == arrays[name].tolist(), name
    assert files.requests == 2 and files.bytes_read == 4 * n  # a+b with the check, then c+d; each byte once
    lo, hi = target.ctypes.data, target.ctypes.data + target.nbytes
    into_target = [lo <= t < hi for t in storage.targets]
    if order == "file order":
        assert copies == [] and into_target == [False, True, True]  # the header's bytes, then the two runs
    else:
        assert len(copies) == 4 and not any(into_target)
    files.close()


def test_a_storage_that_probes_without_streaming_still_hands_the_first_read_its_bytes(tmp_path):
    """A storage with a combined size-and-header ``probe`` but no streaming ``probe_into`` (a third-party one)
    returns the first read's bytes in its own buffer; RemoteFiles copies them into the caller's, which is
    never taken as already filled."""
    from hyperdcp.sources.remote import RemoteFiles, load_remote_metadata
    from hyperdcp.storage.local import LocalStorage

    class ProbingOnly(LocalStorage):
        max_request_bytes = 16 << 20

        def probe(self, name, n, what="file"):
            return self.fetch(name, 0, n), self.size(name, what)

    a = np.arange(300_000, dtype=np.float32)
    hyperdcp.save({"a": a}, str(tmp_path / "ck"))
    meta = load_remote_metadata(str(tmp_path / "ck"))
    c = meta.tensors["a"].chunks
    f, off, n = int(c.file[0]), int(c.begin[0]), int(c.end[0] - c.begin[0])
    files = RemoteFiles(str(tmp_path / "ck"), meta, storage=ProbingOnly(str(tmp_path / "ck")))
    out = np.full(n, 0xAB, np.uint8)
    files.read_into(f, off, out)
    assert out.view(np.float32).tolist() == a.tolist()
    files.close()


@pytest.mark.parametrize("client", ["s3fs", "obstore"])
def test_a_streamed_get_fills_the_callers_buffers_in_order_and_stops_at_the_objects_end(s3, client):
    """get_range_into writes a range into one buffer or across several, in order; at the object's end it
    writes what there is and says so; past the end it writes nothing; a missing key is ObjectMissing."""
    from hyperdcp.storage.object_client import ObjectMissing, make_client

    data = np.random.default_rng(5).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    s3.boto().put_object(Bucket=s3.bucket, Key="obj", Body=data)
    c = make_client(f"s3://{s3.bucket}/", {"client": client})
    a, b = bytearray(300), np.zeros(200, np.uint8)
    got, total = c.get_range_into("obj", 100, [a, b])
    assert got == 500 and bytes(a) == data[100:400] and b.tobytes() == data[400:600]
    assert total in (1000, None)
    tail = bytearray(300)
    got, _ = c.get_range_into("obj", 900, memoryview(tail))
    assert got == 100 and bytes(tail[:100]) == data[900:] and bytes(tail[100:]) == bytes(200)
    assert c.get_range_into("obj", 1000, bytearray(10))[0] == 0
    with pytest.raises(ObjectMissing):
        c.get_range_into("absent", 0, bytearray(10))


def test_convert_hf_into_s3_then_inspect_diff_and_verify_the_format_2_checkpoint(s3, tmp_path, monkeypatch, capsys):
    """hf-to-hyperdcp writes through the destination's Storage: into a bucket it uploads per-save objects and
    the record last; the result loads back bit-exact. It is a format-2 checkpoint (a binary chunk index object),
    which inspect, diff and verify read from the URL; an overwrite replaces every object; hyperdcp-to-hf into a
    URL is refused before anything is read or written."""
    from safetensors.numpy import save_file

    from hyperdcp.cli import main as cli
    from hyperdcp.format.metadata import METADATA_FILE
    from hyperdcp.tools.convert import hf_to_hyperdcp, hyperdcp_to_hf

    monkeypatch.setenv("HYPERDCP_INDEX_MIN_CHUNKS", "0")  # format 2 even for this small model
    rng = np.random.default_rng(5)

    def model(scale: float) -> dict:
        return {"model.w": (rng.standard_normal((512, 1024)) * scale).astype(np.float32),  # 2 MiB: 32 pieces
                "model.h": rng.standard_normal((300, 7)).astype(np.float16),
                "model.e": np.zeros((0, 3), np.float32), "model.b": rng.integers(-9, 9, 5).astype(np.int64)}

    first, second = model(1.0), model(2.0)
    for name, sd in (("one", first), ("two", second)):
        (tmp_path / name).mkdir()
        save_file(sd, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
    one, url = str(tmp_path / "one"), f"s3://{s3.bucket}/conv/step-0"
    res = hf_to_hyperdcp(one, url, threads=3, buffer_bytes=64 << 10, checksum_block_bytes=16 << 10)
    assert res.dst == url and res.tensors == 4
    meta = hyperdcp.read_metadata(url)
    assert meta.format_version == 2
    keys = _keys(s3)
    index = [k for k in keys if "/hyperdcp-index-" in k]  # the binary chunk index, written before the record
    assert len(index) == 1
    assert keys == sorted([f"conv/step-0/{n}" for n in [METADATA_FILE, *(f.name for f in meta.files)]] + index)
    back = {k: np.full_like(v, 7) for k, v in first.items()}
    hyperdcp.load(back, url)
    assert all(back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes() for k, v in first.items())
    assert hyperdcp.verify_checkpoint(url).ok
    capsys.readouterr()
    assert cli(["inspect", url, "--json"]) == 0
    assert sorted(t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]) == sorted(first)
    assert cli(["diff", url, url]) == 0
    assert cli(["diff", url, one]) == 0  # the same tensors as its HF source, read from the bucket
    with pytest.raises(hyperdcp.CheckpointExistsError, match="overwrite=True"):
        hf_to_hyperdcp(str(tmp_path / "two"), url)
    assert _keys(s3) == keys  # the refused conversion left nothing
    assert cli(["convert", "hf-to-hyperdcp", str(tmp_path / "two"), url, "--overwrite", "-q"]) == 0
    assert set(_keys(s3)) & set(keys) == {f"conv/step-0/{METADATA_FILE}"}  # every replaced object is gone
    capsys.readouterr()
    assert cli(["diff", url, one]) != 0
    assert "model.w" in capsys.readouterr().out
    back = {k: np.zeros_like(v) for k, v in second.items()}
    hyperdcp.load(back, url)
    assert all(back[k].tobytes() == v.tobytes() for k, v in second.items())
    assert s3.boto().list_multipart_uploads(Bucket=s3.bucket).get("Uploads") is None
    with pytest.raises(hyperdcp.UnsupportedStorageError, match="local"):
        hyperdcp_to_hf(url, f"s3://{s3.bucket}/hf-out")
    assert not (tmp_path / "s3:").exists()
