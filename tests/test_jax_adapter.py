"""JAX pytrees on one process with 8 CPU devices: save under a 2-D NamedSharding, load resharded onto
another mesh, replicated and onto one device; targets of arrays or of ``jax.ShapeDtypeStruct``; an
optax-like namedtuple state; bf16 and fp8 bit-exact; the documented key names; the errors.

Every scenario runs in one fresh JAX process (tests/jax_run.py: ``XLA_FLAGS`` must be set before jax is
imported); each test checks its own scenario's outcome."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import traceback

import numpy as np
import pytest

import hyperdcp
from tests.jax_run import run_jax

Adam = collections.namedtuple("ScaleByAdamState", "count mu nu")


def _mesh(shape, names=("x", "y")):
    import jax

    return jax.make_mesh(tuple(shape), names)


def _ns(mesh, *spec):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(*spec))


def _put(value: np.ndarray, sharding):
    import jax

    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def _same(a, b) -> bool:
    """Bit-exact: same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _model(rng):
    return {
        "params": {
            "dense": {"kernel": rng.standard_normal((16, 32)).astype(np.float32),
                      "bias": rng.standard_normal(32).astype(np.float32)},
            "layers": [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2)],
        }
    }


# -- scenarios (run inside the JAX process) -----------------------------------------------------
def reshard(tmp):
    """Save under a 2 x 4 mesh, load into arrays on a 4 x 2 mesh (specs swapped), replicated, one device."""
    import jax

    rng = np.random.default_rng(0)
    ref = _model(rng)
    m24, m42 = _mesh((2, 4)), _mesh((4, 2), ("a", "b"))
    sh = {"kernel": _ns(m24, "x", "y"), "bias": _ns(m24, "y"), "layers": _ns(m24, None, "x")}
    tree = jax.tree_util.tree_map_with_path(
        lambda p, v: _put(v, sh[p[-1].key] if hasattr(p[-1], "key") else sh["layers"]), ref)
    res = hyperdcp.save(tree, os.path.join(tmp, "c"))
    out = {"bytes_written": res.bytes_written}
    one = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    for name, pick in {"swapped": lambda v: _ns(m42, "b", "a") if v.ndim == 2 else _ns(m42, "a"),
                       "replicated": lambda v: _ns(m42), "one_device": lambda v: one}.items():
        target = jax.tree_util.tree_map(lambda v, pick=pick: _put(np.zeros_like(v), pick(v)), ref)
        got = hyperdcp.load(target, os.path.join(tmp, "c"))
        flat_ref = jax.tree_util.tree_leaves(ref)
        flat_got = jax.tree_util.tree_leaves(got.state)
        assert all(_same(g, r) for g, r in zip(flat_got, flat_ref)), name
        assert all(g.sharding == pick(r) for g, r in zip(flat_got, flat_ref)), name
        # the target is a value: its arrays still hold zeros
        assert all(not np.asarray(t).any() for t in jax.tree_util.tree_leaves(target)), name
        out[name] = got.bytes_read
    return out


def abstract_optax(tmp):
    """A flax-style params dict and an optax-like namedtuple state, restored from ShapeDtypeStructs."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    params = _model(rng)["params"]
    mesh = _mesh((2, 4))
    spec = lambda v: _ns(mesh, "x", "y") if v.ndim == 2 else _ns(mesh, "y")  # noqa: E731
    p = jax.tree_util.tree_map(lambda v: _put(v, spec(v)), params)
    state = {"params": p,
             "opt_state": (Adam(jnp.asarray(5, jnp.int32), jax.tree_util.tree_map(lambda x: x * 2, p),
                                jax.tree_util.tree_map(lambda x: x * 3, p)), None),
             "step": 12, "rng": np.arange(4, dtype=np.uint32)}
    hyperdcp.save(state, os.path.join(tmp, "c"))
    keys = sorted(hyperdcp.read_metadata(os.path.join(tmp, "c")).tensors)
    other = _mesh((8, 1))
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_ns(other, "x") if x.ndim else _ns(other)),
        {k: v for k, v in state.items() if k in ("params", "opt_state")})
    abstract.update(step=0, rng=np.zeros(4, np.uint32))
    got = hyperdcp.load(abstract, os.path.join(tmp, "c")).state
    assert type(got["opt_state"][0]) is Adam and got["opt_state"][1] is None
    assert got["step"] == 12 and _same(got["rng"], state["rng"])
    want, have = jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(got)
    assert len(want) == len(have) and all(_same(a, b) for a, b in zip(have, want))
    assert got["opt_state"][0].mu["dense"]["kernel"].sharding == _ns(other, "x")
    return keys


def low_precision(tmp):
    """bf16, fp8 e4m3fn and e5m2 (every bit pattern, NaNs included) round-trip bit-exact."""
    import jax
    import ml_dtypes

    mesh = _mesh((2, 4))
    bits8 = np.arange(256, dtype=np.uint8).reshape(32, 8)
    bits16 = (np.arange(64 * 8, dtype=np.uint32) * 127).astype(np.uint16).reshape(64, 8)
    ref = {"bf16": bits16.view(ml_dtypes.bfloat16), "e4m3": bits8.view(ml_dtypes.float8_e4m3fn),
           "e5m2": bits8.view(ml_dtypes.float8_e5m2)}
    tree = {k: _put(v, _ns(mesh, "y", "x")) for k, v in ref.items()}
    hyperdcp.save(tree, os.path.join(tmp, "c"))
    meta = hyperdcp.read_metadata(os.path.join(tmp, "c"))
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=_ns(mesh, "x")) for k, v in ref.items()}
    got = hyperdcp.load(target, os.path.join(tmp, "c")).state
    assert all(_same(got[k], ref[k]) for k in ref)
    return {k: t.dtype for k, t in meta.tensors.items()}


def replicas_once(tmp):
    """A fully replicated array on 8 devices is stored once; a 2-D sharded one in 8 boxes."""
    mesh = _mesh((2, 4))
    v = np.arange(64, dtype=np.float32).reshape(8, 8)
    hyperdcp.save({"rep": _put(v, _ns(mesh)), "half": _put(v, _ns(mesh, "x"))}, os.path.join(tmp, "c"))
    meta = hyperdcp.read_metadata(os.path.join(tmp, "c"))
    return {k: [len(t.chunks), int((t.chunks.end - t.chunks.begin).sum())] for k, t in meta.tensors.items()}


def errors(tmp):
    """What a user gets wrong, and the message: a ShapeDtypeStruct without a sharding, saving a
    ShapeDtypeStruct, a key the checkpoint lacks, a shape that differs, a 64-bit target JAX would narrow."""
    import jax

    from hyperdcp.errors import CheckpointError

    mesh = _mesh((2, 4))
    path = os.path.join(tmp, "c")
    hyperdcp.save({"w": _put(np.ones((8, 8), np.float32), _ns(mesh, "x"))}, path)
    cases = {
        "no_sharding": lambda: hyperdcp.load({"w": jax.ShapeDtypeStruct((8, 8), np.float32)}, path),
        "save_abstract": lambda: hyperdcp.save({"w": jax.ShapeDtypeStruct((8, 8), np.float32)}, path + "2"),
        "missing": lambda: hyperdcp.load({"v": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=_ns(mesh))}, path),
        "shape": lambda: hyperdcp.load({"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=_ns(mesh))}, path),
        "x64_off": lambda: hyperdcp.load({"w": jax.ShapeDtypeStruct((8, 8), np.float64, sharding=_ns(mesh))}, path,
                                         allow_cast=True),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except CheckpointError as e:
            out[name] = f"{type(e).__name__}: {e}"
    missing = hyperdcp.load({"v": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=_ns(mesh))}, path, strict=False)
    out["not_strict_keeps_target"] = (isinstance(missing.state["v"], jax.ShapeDtypeStruct)
                                      and missing.missing_keys == ["v"])
    return out


def async_save(tmp):
    """async_save of a sharded pytree: blocks only for staging; the committed checkpoint loads back."""
    rng = np.random.default_rng(3)
    mesh = _mesh((2, 4))
    ref = {"w": rng.standard_normal((64, 32)).astype(np.float32)}
    fut = hyperdcp.async_save({"w": _put(ref["w"], _ns(mesh, "x", "y"))}, os.path.join(tmp, "c"))
    fut.result(timeout=60)
    import jax

    got = hyperdcp.load({"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=_ns(mesh, "y"))},
                        os.path.join(tmp, "c")).state
    hyperdcp.async_saving.shutdown()
    return _same(got["w"], ref["w"])


SCENARIOS = [reshard, abstract_optax, low_precision, replicas_once, errors, async_save]


def run_all(pid, n, tmp):
    out = {}
    for fn in SCENARIOS:
        d = os.path.join(tmp, fn.__name__)
        os.makedirs(d)
        try:
            out[fn.__name__] = [True, fn(d)]
        except Exception:  # noqa: BLE001 - reported by the scenario's own test
            out[fn.__name__] = [False, traceback.format_exc()]
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    (out,) = run_jax(1, 8, "tests.test_jax_adapter:run_all", {"tmp": str(tmp_path_factory.mktemp("jax1"))},
                     timeout=120)
    return out


def _result(outcomes, name):
    ok, val = outcomes[name]
    assert ok, val
    return val


def test_resharded_loads_onto_another_mesh_replicated_and_one_device(outcomes):
    got = _result(outcomes, "reshard")
    nbytes = (16 * 32 + 32 + 2 * 64) * 4
    assert got["bytes_written"] >= nbytes
    assert got["swapped"] == got["replicated"] == got["one_device"] == nbytes  # each byte read once


def test_abstract_targets_restore_an_optax_like_state_with_documented_keys(outcomes):
    keys = _result(outcomes, "abstract_optax")
    assert "params.dense.kernel" in keys and "params.layers.1" in keys
    assert {"opt_state.0.count", "opt_state.0.mu.dense.kernel", "opt_state.0.nu.layers.0", "rng"} <= set(keys)


def test_bf16_and_fp8_round_trip_bit_exact(outcomes):
    assert _result(outcomes, "low_precision") == {"bf16": "BF16", "e4m3": "F8_E4M3", "e5m2": "F8_E5M2"}


def test_replicated_array_is_stored_once(outcomes):
    got = _result(outcomes, "replicas_once")
    assert got["rep"] == [1, 256]
    assert got["half"] == [2, 256]  # two boxes (x), each held by 4 devices, stored once


def test_errors_name_the_key_and_the_fix(outcomes):
    got = _result(outcomes, "errors")
    assert (got["no_sharding"].startswith("StateDictError") and "'w'" in got["no_sharding"]
            and "sharding=" in got["no_sharding"])
    assert got["save_abstract"].startswith("StateDictError") and "'w'" in got["save_abstract"]
    assert got["missing"].startswith("MismatchError") and "'v'" in got["missing"] and "strict=False" in got["missing"]
    assert got["shape"].startswith("MismatchError") and "'w'" in got["shape"]
    assert got["x64_off"].startswith("StateDictError") and "jax_enable_x64" in got["x64_off"]
    assert got["not_strict_keeps_target"] is True


def test_async_save_of_a_pytree(outcomes):
    assert _result(outcomes, "async_save") is True


def test_core_and_torch_adapter_work_without_jax(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["jax"] = None  # any 'import jax' now fails
        import numpy as np, torch
        import hyperdcp, hyperdcp.adapters.torch, hyperdcp.coordination
        state = {{"w": torch.arange(6.0), "n": np.ones(3, np.float32), "step": 1}}
        hyperdcp.save(state, {str(tmp_path / 'c')!r})
        back = {{"w": torch.zeros(6), "n": np.zeros(3, np.float32), "step": 0}}
        res = hyperdcp.load(back, {str(tmp_path / 'c')!r})
        assert res.state is back and torch.equal(back["w"], state["w"]) and back["step"] == 1
        assert type(hyperdcp.coordination.default_coordinator()).__name__ == "LocalCoordinator"
        print("ok")
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
