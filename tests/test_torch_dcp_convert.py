"""``hyperdcp convert torch-dcp-to-hyperdcp`` / ``hyperdcp-to-torch-dcp``: torch DCP checkpoints become
hyperdcp checkpoints (streaming, memory bounded by the copy buffers, torch's CRC-32 checked) and back
(read by torch's own ``dcp.load``), bit for bit. Sharded torch checkpoints: tests/test_torch_dcp_source.py."""

from __future__ import annotations

import os
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import hyperdcp
from hyperdcp.cli import main as cli_main
from hyperdcp.tools.convert_torch_dcp import dcp_flatten, hyperdcp_to_torch_dcp, torch_dcp_to_hyperdcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in one process


def _state(zeros: bool = False) -> dict:
    g = torch.Generator().manual_seed(5)
    z = (lambda t: torch.zeros_like(t)) if zeros else (lambda t: t)
    return {
        "model": {"w": z(torch.randn(300, 70, generator=g)), "h": z(torch.randn(9, 4, generator=g).to(torch.bfloat16)),
                  "ids": z(torch.arange(10, dtype=torch.int64)), "mask": z(torch.rand(5, generator=g) > 0.5),
                  "scale": z(torch.tensor(2.5)), "empty": z(torch.zeros(0, 3))},
        "step": 0 if zeros else 11,
        "sched": {"lr": 0.0 if zeros else 3e-4, "milestones": [] if zeros else [10, 20],
                  "name": "" if zeros else "cos"},
    }


def _equal(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        assert v.dtype == b["model"][k].dtype and torch.equal(v, b["model"][k]), k
    assert (a["step"], a["sched"]) == (b["step"], b["sched"])


@pytest.fixture
def torch_ckpt(tmp_path):
    path = str(tmp_path / "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), checkpoint_id=path)
    return path


def test_torch_dcp_to_hyperdcp_and_back_is_bit_exact(torch_ckpt, tmp_path):
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    res = torch_dcp_to_hyperdcp(torch_ckpt, ours, buffer_bytes=16 << 10, checksum_block_bytes=4 << 10)
    assert res.tensors == 6 and res.skipped_values == []
    assert hyperdcp.verify_checkpoint(ours).ok  # checksummed as written
    state = _state(zeros=True)
    hyperdcp.load(state, ours)  # a plain hyperdcp checkpoint now: no source= needed
    _equal(state, _state())
    hyperdcp_to_torch_dcp(ours, back)
    state = _state(zeros=True)
    dcp.load(state, checkpoint_id=back)  # torch's own reader
    _equal(state, _state())


def test_every_dtype_scalars_and_empty_tensors_also_load_directly(torch_ckpt):
    state = _state(zeros=True)
    res = hyperdcp.load(state, torch_ckpt, source="torch-dcp")
    _equal(state, _state())
    assert res.bytes_read == sum(v.numel() * v.element_size() for v in _state()["model"].values())


def test_conversion_memory_is_bounded_by_its_buffers(tmp_path):
    src, dst = str(tmp_path / "big"), str(tmp_path / "ours")
    big = {"w": torch.arange(8 << 20, dtype=torch.float32)}  # 32 MiB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(big, checkpoint_id=src)
    tracemalloc.start()
    try:
        torch_dcp_to_hyperdcp(src, dst, threads=2, buffer_bytes=1 << 20, checksum_block_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20, f"converting 32 MiB took {peak} bytes of Python memory"
    out = {"w": torch.zeros(8 << 20)}
    hyperdcp.load(out, dst)
    assert torch.equal(out["w"], big["w"])


def test_a_damaged_torch_data_file_fails_the_conversion_naming_it(torch_ckpt, tmp_path):
    meta = hyperdcp.read_metadata(torch_ckpt, source="torch-dcp")
    w = meta.tensors["model.w"].chunks
    data = os.path.join(torch_ckpt, meta.files[int(w.file[0])].name)
    with open(data, "r+b") as f:
        f.seek(int(w.begin[0]) + 1000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(hyperdcp.CorruptionError, match=r"__0_0\.distcp.*'model\.w'.*CRC-32"):
        torch_dcp_to_hyperdcp(torch_ckpt, str(tmp_path / "ours"))
    assert not os.path.exists(tmp_path / "ours")


def test_the_cli_converts_both_ways_and_inspect_names_the_kind(torch_ckpt, tmp_path, capsys):
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    assert cli_main(["inspect", torch_ckpt]) == 1
    assert "--source torch-dcp" in capsys.readouterr().err  # the default path says what it is, unpickles nothing
    assert cli_main(["inspect", "--source", "torch-dcp", torch_ckpt]) == 0
    out = capsys.readouterr().out
    assert "model.w" in out and "torch.distributed.checkpoint" in out and "values: sched, step" in out
    assert cli_main(["convert", "torch-dcp-to-hyperdcp", "-q", torch_ckpt, ours]) == 0
    assert cli_main(["convert", "hyperdcp-to-torch-dcp", "-q", ours, back]) == 0
    assert cli_main(["convert", "hyperdcp-to-torch-dcp", "-q", ours, back]) == 1  # no silent overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["convert", "hyperdcp-to-torch-dcp", "-q", "--overwrite", ours, back]) == 0
    state = _state(zeros=True)
    dcp.load(state, checkpoint_id=back)
    _equal(state, _state())


def test_torch_dcp_converts_straight_into_s3_and_loads_back_bit_exact(torch_ckpt, s3, capsys):
    """Into a bucket (moto's real S3 server): per-save objects, the commit record last, a load, verify, no silent
    overwrite; the CLI too."""
    url = f"s3://{s3.bucket}/from-torch/step-11"
    res = torch_dcp_to_hyperdcp(torch_ckpt, url, buffer_bytes=16 << 10, checksum_block_bytes=4 << 10, threads=3)
    assert res.tensors == 6 and res.skipped_values == [] and res.dst == url
    keys = sorted(o["Key"] for o in s3.boto().list_objects_v2(Bucket=s3.bucket, Prefix="from-torch/")["Contents"])
    assert "from-torch/step-11/hyperdcp.json" in keys
    assert all(k.endswith("hyperdcp.json") or any(f in k for f in res.files) for k in keys), keys
    state = _state(zeros=True)
    hyperdcp.load(state, url)
    _equal(state, _state())
    assert hyperdcp.verify_checkpoint(url).ok
    with pytest.raises(hyperdcp.CheckpointExistsError):
        torch_dcp_to_hyperdcp(torch_ckpt, url)
    other = f"s3://{s3.bucket}/from-torch/step-12"
    assert cli_main(["convert", "torch-dcp-to-hyperdcp", "-q", torch_ckpt, other]) == 0
    assert hyperdcp.latest_checkpoint(f"s3://{s3.bucket}/from-torch") == other
    state = _state(zeros=True)
    hyperdcp.load(state, other)
    _equal(state, _state())


def test_a_damaged_torch_data_file_fails_a_conversion_into_s3_and_nothing_is_listed(torch_ckpt, s3):
    meta = hyperdcp.read_metadata(torch_ckpt, source="torch-dcp")
    w = meta.tensors["model.w"].chunks
    with open(os.path.join(torch_ckpt, meta.files[int(w.file[0])].name), "r+b") as f:
        f.seek(int(w.begin[0]) + 1000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    root = f"s3://{s3.bucket}/bad"
    with pytest.raises(hyperdcp.CorruptionError, match=r"__0_0\.distcp.*'model\.w'.*CRC-32"):
        torch_dcp_to_hyperdcp(torch_ckpt, f"{root}/step-1")
    assert hyperdcp.list_checkpoints(root) == []
    assert s3.boto().list_objects_v2(Bucket=s3.bucket, Prefix="bad/").get("KeyCount", 0) == 0  # aborted: no objects


def test_values_are_split_as_torch_splits_them():
    groups = [{"lr": 0.1, "params": ["a", "b"]}, {"lr": 0.2, "params": []}]
    flat = {k: v for k, _, v in dcp_flatten("optim.param_groups", groups)}
    assert flat == {"optim.param_groups.0.lr": 0.1, "optim.param_groups.0.params": ["a", "b"],
                    "optim.param_groups.1.lr": 0.2, "optim.param_groups.1.params": []}
    assert dcp_flatten("ids", (1, 2)) == [("ids", ("ids",), (1, 2))]
    assert np.isclose(dict((k, v) for k, _, v in dcp_flatten("s", {"x": {"y": 1.5}}))["s.x.y"], 1.5)
