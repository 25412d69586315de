"""Corruption (issue 5): damaged bytes always end in an error naming the file; ``hyperdcp verify``.

Full campaign: ``python -m tests.faults.corruption_campaign --trials 200`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import os

import numpy as np

import hyperdcp
from hyperdcp.cli import main as cli_main
from tests.faults import corruption_campaign as cc


def test_corruption_campaign_sample():
    res = cc.campaign(80, seed=11, log=lambda *a: None)
    assert not res["failures"], res["failures"][:3]
    assert res["counts"].get("detected") == 80, res["counts"]


def test_verify_clean_and_damaged(tmp_path, capsys):
    state = cc.make_state()
    path = str(tmp_path / "ck")
    hyperdcp.save(state, path, checksum_block_bytes=1024, files_per_rank=2)
    assert cli_main(["verify", path]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "GB/s" in out
    meta = hyperdcp.read_metadata(path)
    t = meta.tensors["model.w"]
    f = os.path.join(path, meta.files[int(t.chunks.file[0])].name)
    with open(f, "r+b") as fh:
        fh.seek(int(t.chunks.begin[0]) + 1500)  # inside block 1 of the chunk
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x10]))
    rep = hyperdcp.verify_checkpoint(path, threads=3)
    assert not rep.ok and len(rep.bad_chunks) == 1
    bad = rep.bad_chunks[0]
    assert bad.tensor == "model.w" and bad.block == 1 and bad.file == os.path.basename(f)
    assert cli_main(["verify", path, "--threads", "2"]) == 1
    out = capsys.readouterr().out
    assert "BAD CHUNK" in out and "model.w" in out and "FAILED" in out
    # the loader names file and tensor too
    try:
        hyperdcp.load(cc.zeros_like(state), path)
    except hyperdcp.CorruptionError as e:
        assert os.path.basename(f) in str(e) and "model.w" in str(e)
    else:
        raise AssertionError("corruption not detected")


def test_verify_truncated_file_and_missing_checkpoint(tmp_path, capsys):
    path = str(tmp_path / "ck")
    hyperdcp.save({"a": np.arange(1000.0)}, path)
    name = hyperdcp.read_metadata(path).files[0].name
    with open(os.path.join(path, name), "r+b") as fh:
        fh.truncate(100)
    rep = hyperdcp.verify_checkpoint(path)
    assert not rep.ok and name in rep.file_errors[0]
    assert cli_main(["verify", str(tmp_path / "nope")]) == 1
    assert "no checkpoint" in capsys.readouterr().err
