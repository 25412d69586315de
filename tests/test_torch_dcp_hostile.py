"""Nothing in a torch DCP checkpoint runs code: a planted ``.metadata``, a value or a tensor record whose
pickle would run a command is refused with an error naming the global, and the command never runs."""

from __future__ import annotations

import os
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import hyperdcp
from hyperdcp.cli import main as cli_main


class Evil:
    """Pickles as ``os.system(<command>)``: unpickling it with pickle.load would run the command."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _save(state, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return str(path)


@pytest.fixture
def ckpt(tmp_path):
    return _save({"w": torch.arange(12.0).reshape(3, 4), "step": 7}, tmp_path / "ckpt")


def _torch_metadata(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own, trusted checkpoint


def _write_metadata(path, md):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def test_a_planted_metadata_is_refused_and_its_command_never_runs(ckpt, tmp_path, capsys):
    marker = tmp_path / "pwned"
    md = _torch_metadata(ckpt)
    md.planner_data = Evil(str(marker))  # deep inside otherwise genuine metadata
    _write_metadata(ckpt, md)
    with pytest.raises(hyperdcp.FormatError, match=r"refused to unpickle the global posix\.system.*nothing from it"):
        hyperdcp.load({"w": torch.zeros(3, 4)}, ckpt, source="torch-dcp")
    with pytest.raises(hyperdcp.FormatError, match=r"\.metadata: refused to unpickle the global posix\.system"):
        hyperdcp.read_metadata(ckpt, source="torch-dcp")
    assert cli_main(["inspect", "--source", "torch-dcp", ckpt]) == 1
    assert "posix.system" in capsys.readouterr().err
    assert not marker.exists()
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:  # the plant is real: pickle would have run it
        pickle.load(f)
    assert marker.exists()


def test_a_pickled_object_value_is_reported_by_key_and_never_constructed(tmp_path):
    marker = tmp_path / "pwned"
    path = _save({"w": torch.ones(4), "evil": Evil(str(marker)), "epoch": 3}, tmp_path / "ckpt")
    meta = hyperdcp.read_metadata(path, source="torch-dcp")
    assert meta.values == {"epoch": 3} and "w" in meta.tensors
    state = {"w": torch.zeros(4), "evil": None, "epoch": 0}
    with pytest.raises(hyperdcp.FormatError, match=r"'evil' in .* is a pickled posix\.system object"):
        hyperdcp.load(state, path, source="torch-dcp")
    state = {"w": torch.zeros(4), "epoch": 0}
    hyperdcp.load(state, path, source="torch-dcp")  # everything else loads
    assert state["epoch"] == 3 and torch.equal(state["w"], torch.ones(4))
    assert not marker.exists()


def test_a_tensor_record_whose_pickle_runs_code_is_refused(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    md = _torch_metadata(ckpt)
    (index, info), = [(k, v) for k, v in md.storage_data.items() if k.fqn == "w"]
    data = os.path.join(ckpt, info.relative_path)
    with open(data, "ab") as f:
        start = f.tell()
        torch.save(Evil(str(marker)), f)  # a torch.save record like any other, but of os.system
        info.offset, info.length = start, f.tell() - start
    _write_metadata(ckpt, md)
    with pytest.raises(hyperdcp.FormatError, match=r"record of 'w'.*refused to unpickle the global posix\.system"):
        hyperdcp.read_metadata(ckpt, source="torch-dcp")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/passwd", "sub/x.distcp"])
def test_a_data_file_outside_the_checkpoint_is_refused(ckpt, name):
    md = _torch_metadata(ckpt)
    for info in md.storage_data.values():
        info.relative_path = name
    _write_metadata(ckpt, md)
    with pytest.raises(hyperdcp.FormatError, match="not a plain file name inside the checkpoint directory"):
        hyperdcp.read_metadata(ckpt, source="torch-dcp")


def test_a_truncated_data_file_is_named(ckpt):
    data = os.path.join(ckpt, "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) - 100)
    with pytest.raises(hyperdcp.FormatError, match=r"__0_0\.distcp.*truncated"):
        hyperdcp.load({"w": torch.zeros(3, 4)}, ckpt, source="torch-dcp")


def test_garbage_metadata_is_a_format_error(ckpt):
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        f.write(b"\x80\x04\x95not a pickle at all")
    with pytest.raises(hyperdcp.FormatError, match=r"\.metadata: not a valid torch DCP pickle"):
        hyperdcp.read_metadata(ckpt, source="torch-dcp")
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump({"state_dict_metadata": np.zeros(2)}, f)
    with pytest.raises(hyperdcp.FormatError, match=r"refused to unpickle the global numpy"):
        hyperdcp.read_metadata(ckpt, source="torch-dcp")
