"""Multi-process JAX on CPU: processes joined by ``jax.distributed.initialize`` on 127.0.0.1 save and load
through hyperdcp's JAX coordinator (no torch), each only its addressable shards; a checkpoint saved by
2 processes x 4 devices loads on 1 process x 8 devices and on 4 processes x 2 devices; an error on one
process raises on every process. Each scenario runs in fresh processes (tests/jax_run.py)."""

from __future__ import annotations

import numpy as np
import pytest

import hyperdcp
from tests.jax_run import run_jax

#: name -> (shape, dtype name, PartitionSpec over mesh axes ("x", "y"))
ARRAYS = {
    "params.dense.kernel": ((16, 24), "float32", ("x", "y")),
    "params.dense.bias": ((24,), "bfloat16", ("y",)),  # replicated across x: each box held by 2 processes
    "params.embed": ((8, 32), "float8_e4m3fn", (None, "x")),
    "opt.0.mu.dense.kernel": ((16, 24), "float32", (("x", "y"), None)),
    "opt.0.count": ((), "int32", ()),
}


def expected(name: str) -> np.ndarray:
    """The global value of array ``name`` (deterministic bits, so every process and test can rebuild it)."""
    import ml_dtypes  # noqa: F401 - registers bfloat16 / float8 with numpy

    shape, dt, _ = ARRAYS[name]
    dtype = np.dtype(dt)
    n = int(np.prod(shape, dtype=np.int64))
    seed = sum(map(ord, name))
    bits = (np.arange(n, dtype=np.uint64) * 2654435761 + seed) % (1 << (8 * dtype.itemsize))
    u = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    arr = bits.astype(u)
    if dtype.kind == "f":  # keep clear of NaN/Inf patterns: a finite value with the same low bits
        arr = (arr & u(~np.array(0, u) >> 2)) if dtype.itemsize > 1 else arr & u(0x3F)
    return arr.view(dtype).reshape(shape)


def _tree(make):
    """The nested pytree of ARRAYS, each leaf made by ``make(name)``; an optax-like namedtuple holds the
    optimizer state."""
    import collections

    Adam = collections.namedtuple("ScaleByAdamState", "count mu")
    return {
        "params": {"dense": {"kernel": make("params.dense.kernel"), "bias": make("params.dense.bias")},
                   "embed": make("params.embed")},
        "opt": (Adam(make("opt.0.count"), {"dense": {"kernel": make("opt.0.mu.dense.kernel")}}),),
        "step": 7,
    }


def _sharding(name, mesh_shape):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh(tuple(mesh_shape), ("x", "y"))
    return NamedSharding(mesh, PartitionSpec(*ARRAYS[name][2]))


def save_tree(pid, n, path, mesh_shape):
    import jax

    def make(name):
        full = expected(name)
        return jax.make_array_from_callback(full.shape, _sharding(name, mesh_shape), lambda idx: full[idx])

    res = hyperdcp.save(_tree(make), path)
    return {"rank": res.rank, "world": res.world_size, "bytes": res.bytes_written}


def load_tree(pid, n, path, mesh_shape, shape_only=True):
    import jax

    def make(name):
        shape, dt, _ = ARRAYS[name]
        return jax.ShapeDtypeStruct(shape, np.dtype(dt), sharding=_sharding(name, mesh_shape))

    res = hyperdcp.load(_tree(make), path)
    state = res.state
    assert state["step"] == 7 and type(state["opt"][0]).__name__ == "ScaleByAdamState"
    flat = {"params.dense.kernel": state["params"]["dense"]["kernel"],
            "params.dense.bias": state["params"]["dense"]["bias"],
            "params.embed": state["params"]["embed"], "opt.0.count": state["opt"][0].count,
            "opt.0.mu.dense.kernel": state["opt"][0].mu["dense"]["kernel"]}
    checked = 0
    for name, arr in flat.items():
        assert isinstance(arr, jax.Array) and arr.sharding == _sharding(name, mesh_shape), name
        full = expected(name)
        for s in arr.addressable_shards:  # this process's devices only: bit-exact against the global value
            got = np.asarray(s.data)
            assert got.dtype == full.dtype and got.tobytes() == np.ascontiguousarray(full[s.index]).tobytes(), name
            checked += 1
    return {"checked": checked, "bytes_read": res.bytes_read, "devices": len(jax.local_devices())}


def _unique_bytes() -> int:
    return sum(expected(k).nbytes for k in ARRAYS)


@pytest.fixture(scope="module")
def saved_2x4(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("jax") / "ckpt")
    out = run_jax(2, 4, "tests.test_jax_multiprocess:save_tree", {"path": path, "mesh_shape": [2, 4]}, timeout=90)
    return path, out


def test_two_processes_save_each_box_once(saved_2x4):
    path, out = saved_2x4
    assert [o["rank"] for o in out] == [0, 1] and {o["world"] for o in out} == {2}
    meta = hyperdcp.read_metadata(path)
    assert meta.world_size == 2
    assert sorted(meta.tensors) == sorted(ARRAYS) and meta.values["step"] == 7
    assert meta.tensors["params.dense.bias"].dtype == "BF16" and meta.tensors["params.embed"].dtype == "F8_E4M3"
    # the bias is on both processes (replicated along x) and is written by one of them: no byte twice
    stored = sum(int((t.chunks.end - t.chunks.begin).sum()) for t in meta.tensors.values())
    assert stored == _unique_bytes()
    assert 0 < min(o["bytes"] for o in out)  # both processes wrote their share


def test_load_on_one_process_with_eight_devices(saved_2x4):
    path, _ = saved_2x4
    (got,) = run_jax(1, 8, "tests.test_jax_multiprocess:load_tree", {"path": path, "mesh_shape": [4, 2]}, timeout=60)
    assert got["devices"] == 8 and got["checked"] > 0


def test_load_on_four_processes_with_two_devices(saved_2x4):
    path, _ = saved_2x4
    out = run_jax(4, 2, "tests.test_jax_multiprocess:load_tree", {"path": path, "mesh_shape": [2, 4]}, timeout=90)
    assert [o["devices"] for o in out] == [2] * 4
    # each process read only what its devices hold: together well under 4 full copies
    assert sum(o["bytes_read"] for o in out) < 2 * _unique_bytes()


def errors(pid, n, path):
    """Process 1 asks for a wrong shape: the load fails on both, naming the key. Then process 1 stops
    taking part: process 0's next load fails within its timeout, naming process 1."""
    import jax

    from hyperdcp.errors import CheckpointError, CoordinationError

    shape = (16, 24) if pid == 0 else (32, 24)
    sh = _sharding("params.dense.kernel", (2, 2))
    target = {"params": {"dense": {"kernel": jax.ShapeDtypeStruct(shape, np.float32, sharding=sh)}}}
    out = {}
    try:
        hyperdcp.load(target, path)
        out["mismatch"] = None
    except CheckpointError as e:
        out["mismatch"] = f"{type(e).__name__}: {e}"
    if pid == 0:
        try:
            hyperdcp.load(target, path, timeout=3, strict=False)
            out["late"] = None
        except CoordinationError as e:
            out["late"] = str(e)
    return out


def test_an_error_on_one_process_raises_on_every_process(saved_2x4):
    path, _ = saved_2x4
    out = run_jax(2, 2, "tests.test_jax_multiprocess:errors", {"path": path}, timeout=60)
    for o in out:
        assert o["mismatch"] is not None and "params.dense.kernel" in o["mismatch"], o
    assert "process(es) 1 of 2" in out[0]["late"] and "3 s" in out[0]["late"]
