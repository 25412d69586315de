"""Saves and loads through a fault-injecting HTTP proxy in front of the S3 server (tests/faults/http_proxy.py).

The proxy answers 503 SlowDown / 500, resets connections before or after forwarding, or cuts response
bodies, for a fraction of requests. Every save and load either succeeds bit-exact after retries, or fails
with a StorageError naming the object; nothing half-written is ever listed, and no unfinished multipart
upload is left behind.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import hyperdcp
from hyperdcp.coordination.local import LocalCoordinator
from tests.faults.http_proxy import KINDS, FaultProxy

MiB = 1 << 20


@pytest.fixture
def proxy(s3, monkeypatch):
    px = FaultProxy("127.0.0.1", s3.port).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", px.endpoint)
    monkeypatch.setenv("HYPERDCP_S3_PART_BYTES", str(5 * MiB))
    monkeypatch.setenv("HYPERDCP_S3_SINGLE_PUT_BYTES", "0")  # multipart from the second part on
    yield px
    px.stop()


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"big": rng.standard_normal(3 * MiB).astype(np.float32),  # 12 MiB: a 3-part multipart upload
            "small": rng.integers(0, 1000, 1000), "step": seed}


def _check(url: str, seed: int) -> None:
    want = _state(seed)
    back = {"big": np.zeros_like(want["big"]), "small": np.zeros_like(want["small"]), "step": 0}
    hyperdcp.load(back, url)
    assert np.array_equal(back["big"], want["big"]) and np.array_equal(back["small"], want["small"])
    assert back["step"] == seed


def test_saves_and_loads_succeed_bit_exact_through_faults(s3, proxy):
    root = f"s3://{s3.bucket}/run"
    proxy.fault_every = 3  # a third of the requests, the kinds in turn
    for step in (1, 2):
        hyperdcp.save(_state(step), f"{root}/step-{step}", files_per_rank=2)
    hyperdcp.save(_state(3), f"{root}/step-2", overwrite=True)
    for step, seed in ((1, 1), (2, 3)):
        _check(f"{root}/step-{step}", seed)
    assert hyperdcp.latest_checkpoint(root) == f"{root}/step-2"
    injected = {k: proxy.stats[f"fault_{k}"] for k in KINDS}
    assert all(injected.values()), injected  # every kind of fault was met, and retried
    proxy.fault_every = 0
    assert s3.boto().list_multipart_uploads(Bucket=s3.bucket).get("Uploads") is None
    keys = [o["Key"] for o in s3.boto().list_objects_v2(Bucket=s3.bucket)["Contents"]]
    listed = {n for step in (1, 2) for n in [f.name for f in hyperdcp.read_metadata(f"{root}/step-{step}").files]}
    assert sorted(k.rsplit("/", 1)[1] for k in keys if not k.endswith("hyperdcp.json")) == sorted(listed)


def test_a_part_that_keeps_failing_fails_the_save_naming_the_object(s3, proxy, monkeypatch):
    monkeypatch.setenv("HYPERDCP_S3_RETRIES", "3")
    root = f"s3://{s3.bucket}/run"
    hyperdcp.save(_state(1), f"{root}/step-1")
    proxy.match = lambda method, path: method == "PUT" and "partNumber=2" in path
    proxy.fault_rate = 1.0
    with pytest.raises(hyperdcp.StorageError,
                       match=r"part 2 of data file s3://.*/step-2/r00000-\w+-00\.safetensors.*3 attempt"):
        hyperdcp.save(_state(2), f"{root}/step-2")
    proxy.fault_rate = 0.0
    assert s3.boto().list_multipart_uploads(Bucket=s3.bucket).get("Uploads") is None  # aborted
    assert hyperdcp.list_checkpoints(root) == [f"{root}/step-1"]
    with pytest.raises(hyperdcp.CheckpointNotFoundError):
        hyperdcp.read_metadata(f"{root}/step-2")
    _check(f"{root}/step-1", 1)


def test_a_load_that_keeps_failing_names_the_object(s3, proxy, monkeypatch):
    monkeypatch.setenv("HYPERDCP_S3_RETRIES", "2")
    url = f"s3://{s3.bucket}/ck"
    hyperdcp.save(_state(1), url)
    proxy.match = lambda method, path: method == "GET" and ".safetensors" in path
    proxy.fault_rate = 1.0
    proxy.kinds = ("503",)
    with pytest.raises(hyperdcp.StorageError, match=r"s3://.*/ck/r00000-\w+-00\.safetensors.*2 attempt"):
        _check(url, 1)


def test_a_request_the_server_never_answers_fails_the_save_within_a_bounded_time(s3, proxy, monkeypatch):
    root = f"s3://{s3.bucket}/run"
    hyperdcp.save(_state(1), f"{root}/step-1")
    monkeypatch.setenv("HYPERDCP_S3_RETRIES", "2")
    monkeypatch.setenv("HYPERDCP_S3_REQUEST_SECONDS", "2")  # per attempt, waiting for a connection included
    proxy.match = lambda method, path: method == "PUT" and "partNumber=2" in path
    proxy.kinds, proxy.fault_rate = ("stall",), 1.0  # the server holds part 2 and never answers
    proxy.stall_seconds = 120
    t0 = time.monotonic()
    with pytest.raises(hyperdcp.StorageError, match=r"part 2 of data file s3://.*/step-2/r00000-\w+-00\.safetensors.*"
                                                    r"2 attempt.*no answer within 2 s"):
        hyperdcp.save(_state(2), f"{root}/step-2")
    assert time.monotonic() - t0 < 30  # two attempts of 2 s and the abort; never the 120 s stall
    proxy.fault_rate = 0.0
    assert s3.boto().list_multipart_uploads(Bucket=s3.bucket).get("Uploads") is None  # aborted
    assert hyperdcp.list_checkpoints(root) == [f"{root}/step-1"]
    _check(f"{root}/step-1", 1)


class _PeerLostAfterCommit(LocalCoordinator):
    """One process whose commit broadcast fails, as when a peer dies after sending its results."""

    def broadcast(self, data, src=0):
        raise hyperdcp.CoordinationError("rank 1 is gone (simulated)")


@pytest.mark.parametrize("where", ["s3", "local"])
def test_a_rank_lost_after_the_commit_leaves_the_checkpoint_complete(s3, tmp_path, where):
    """The committer wrote the record, then telling the other ranks failed: the save raises on the committer,
    but the checkpoint stays complete (its files are not aborted away under a listed record)."""
    root = f"s3://{s3.bucket}/run" if where == "s3" else str(tmp_path / "run")
    with pytest.raises(hyperdcp.CoordinationError, match="rank 1 is gone") as info:
        hyperdcp.save(_state(4), f"{root}/step-4", coordinator=_PeerLostAfterCommit())
    assert any("committed before this error" in n for n in getattr(info.value, "__notes__", []))
    assert hyperdcp.list_checkpoints(root) == [f"{root}/step-4"]
    _check(f"{root}/step-4", 4)
    assert hyperdcp.verify_checkpoint(f"{root}/step-4").ok


def test_a_commit_record_that_landed_unanswered_keeps_its_checkpoint(s3, proxy, monkeypatch):
    """Every answer to the record's PUT is lost (the record landed on the first attempt; the retries meet the
    412 of a conditional put, and lose that too): the save fails, but its objects are not deleted under the
    record that is in place, so the checkpoint is listed and loads."""
    monkeypatch.setenv("HYPERDCP_S3_RETRIES", "2")
    root = f"s3://{s3.bucket}/run"
    proxy.match = lambda method, path: method == "PUT" and path.split("?")[0].endswith("/hyperdcp.json")
    proxy.kinds, proxy.fault_rate = ("reset_after",), 1.0
    with pytest.raises(hyperdcp.StorageError, match="commit record"):
        hyperdcp.save(_state(5), f"{root}/step-5")
    proxy.fault_rate = 0.0
    assert hyperdcp.list_checkpoints(root) == [f"{root}/step-5"]
    _check(f"{root}/step-5", 5)
