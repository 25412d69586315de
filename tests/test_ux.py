"""Smaller defects of issue 10 part 5: SaveFuture is a concurrent.futures.Future, results print short
summaries, torch DCP checkpoints are recognised as such, and the opt-in ``hyperdcp`` logger."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import hyperdcp
from hyperdcp.async_saving import AsyncSaveTimeoutError, SaveFuture
from hyperdcp.cli import main as cli_main

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


# -- SaveFuture ------------------------------------------------------------------------------------
def test_an_async_save_returns_a_concurrent_futures_future(tmp_path):
    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": 7}
    path = str(tmp_path / "step-7")
    fut = hyperdcp.async_save(state, path)
    assert isinstance(fut, concurrent.futures.Future)  # torchtitan asserts this
    called = []
    fut.add_done_callback(lambda f: called.append(f.result().path))
    done, _ = concurrent.futures.wait([fut], timeout=120)
    assert done == {fut} and fut.done() and fut.exception() is None
    assert fut.result(timeout=1).path == os.path.abspath(path)
    assert called == [os.path.abspath(path)]
    late = []
    fut.add_done_callback(late.append)  # after completion: called at once
    assert late == [fut]
    assert fut.cancel() is False and not fut.cancelled()
    got = {"w": np.zeros((3, 4), np.float32), "step": None}
    hyperdcp.load(got, path)
    assert np.array_equal(got["w"], state["w"]) and got["step"] == 7


def test_a_pending_save_future_times_out_with_a_timeout_error_and_cannot_be_cancelled(tmp_path):
    fut = SaveFuture(str(tmp_path / "c"), rank=0, seq=1, blocking_seconds=0.0, first_call=False)
    for call in (fut.result, fut.exception):
        with pytest.raises(AsyncSaveTimeoutError, match="not finished after 0.01s") as e:
            call(timeout=0.01)
        assert isinstance(e.value, concurrent.futures.TimeoutError)
    assert fut.cancel() is False and fut.running()
    err = hyperdcp.StorageError("disk full")
    fut._finish(None, err)
    assert fut.exception() is err
    with pytest.raises(hyperdcp.StorageError, match="disk full"):
        fut.result()


# -- short reprs -------------------------------------------------------------------------------------
def test_results_print_short_summaries(tmp_path):
    state = {f"layer{i}.w": np.full(4, i, np.float32) for i in range(2000)}
    path = str(tmp_path / "big")
    saved = hyperdcp.save(state, path)
    loaded = hyperdcp.load({k: np.zeros(4, np.float32) for k in list(state)[:1000]} | {"extra": np.zeros(1)},
                           path, strict=False)
    for r in (saved, loaded):
        assert len(repr(r)) < 400, repr(r)
        assert repr(path.split("/")[-1])[1:-1] in repr(r)
    assert "bytes_written=" in repr(saved) and "files_written=1" in repr(saved)
    assert "missing_keys=['extra'] (1)" in repr(loaded) and "(1000)" in repr(loaded)
    assert len(loaded.unused_keys) == 1000 and loaded.metadata is not None, "the fields themselves are whole"


# -- torch DCP checkpoints -----------------------------------------------------------------------------
@pytest.fixture
def torch_dcp(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "torch" / "step-5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": torch.nn.Linear(3, 2).state_dict()}, checkpoint_id=path)
    assert os.path.exists(os.path.join(path, ".metadata"))
    return path


def test_a_torch_dcp_checkpoint_is_named_in_every_error(torch_dcp, capsys):
    msg = r"torch.distributed.checkpoint \(torch DCP\) checkpoint.*only when asked.*source=\"torch-dcp\""
    with pytest.raises(hyperdcp.FormatError, match=msg):
        hyperdcp.read_metadata(torch_dcp)
    with pytest.raises(hyperdcp.FormatError, match=msg):
        hyperdcp.load({"model": {"weight": np.zeros((2, 3), np.float32)}}, torch_dcp)
    with pytest.raises(hyperdcp.FormatError, match="torch DCP"):
        hyperdcp.latest_checkpoint(torch_dcp)  # the checkpoint instead of the directory holding them
    with pytest.raises(hyperdcp.FormatError, match=r"no hyperdcp checkpoint but 1 .*torch DCP.*step-5"):
        hyperdcp.latest_checkpoint(os.path.dirname(torch_dcp))
    assert cli_main(["inspect", torch_dcp]) == 1
    assert cli_main(["verify", torch_dcp]) == 1
    out = capsys.readouterr()
    assert out.err.startswith("hyperdcp inspect: error: ") and "torch DCP" in out.err and "torch DCP" in out.out
    assert "has no hyperdcp.json" not in out.err + out.out


def test_latest_checkpoint_ignores_torch_dcp_beside_hyperdcp_checkpoints(torch_dcp):
    root = os.path.dirname(torch_dcp)
    hyperdcp.save({"w": np.ones(2)}, os.path.join(root, "step-3"))
    assert hyperdcp.latest_checkpoint(root) == os.path.join(root, "step-3")


# -- logging ---------------------------------------------------------------------------------------
def test_one_info_line_per_save_and_load(tmp_path, caplog):
    state = {"w": np.arange(1000, dtype=np.float32), "b": np.ones(10, np.int64)}
    path = str(tmp_path / "c")
    with caplog.at_level(logging.INFO, logger="hyperdcp"):
        saved = hyperdcp.save(state, path)
        hyperdcp.load({"w": np.zeros(1000, np.float32)}, path, strict=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "hyperdcp"]
    assert len(lines) == 2, lines
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in saved.files_written)
    assert lines[0].startswith(f"saved {path}: rank 0/1 wrote {on_disk / 1000:.2f} kB in ") and "GB/s" in lines[0]
    assert (lines[1].startswith(f"loaded {path}: read 4.00 kB in ")
            and "for 4.00 kB of state (read amplification 1.00x)" in lines[1])


def test_nothing_is_logged_by_default(tmp_path):
    script = textwrap.dedent(f"""
        import numpy as np, hyperdcp
        hyperdcp.save({{"w": np.ones(3)}}, {str(tmp_path / "c")!r})
        hyperdcp.load({{"w": np.zeros(3)}}, {str(tmp_path / "c")!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=SRC))
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr
