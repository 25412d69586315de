"""JAX <-> MindSpore through one checkpoint, bit-exact (bf16 included).

* JAX on 8 CPU devices saves a pytree sharded 2-D (NamedSharding over a (2, 4) mesh); MindSpore loads it
  into a Cell's Parameters in place, into a bf16 tensor, and into the slices of a MindSpore layout (one
  slice per simulated rank);
* MindSpore saves new values; JAX loads them into arrays under another sharding (a (4, 2) mesh).

JAX runs in a fresh process (tests/jax_run.py: XLA_FLAGS before the import); MindSpore in this one.
"""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
pytest.importorskip("jax")

import hyperdcp  # noqa: E402
from hyperdcp.adapters import mindspore as msa  # noqa: E402
from hyperdcp.adapters import mindspore_layout as msl  # noqa: E402
from tests.jax_run import run_jax  # noqa: E402

msa.prime()

#: a Dense(4 -> 8) cell's parameters, as MindSpore names them, plus a bf16 tensor
SHAPES = {"0.weight": (8, 4), "0.bias": (8,), "bf": (8, 12)}


def values(seed: int) -> dict[str, np.ndarray]:
    """Deterministic values: f32 for the cell, bf16 bit patterns (finite, both signs) for ``bf``."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items() if k != "bf"}
    words = rng.integers(0, 1 << 16, size=SHAPES["bf"], dtype=np.uint32).astype(np.uint16) & np.uint16(0xBFFF)
    out["bf"] = words.view(ml_dtypes.bfloat16)
    return out


def _jax_save(pid, n, path, seed):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((2, 4), ("x", "y"))
    vals = values(seed)
    specs = {"0.weight": PartitionSpec("x", "y"), "0.bias": PartitionSpec("y"), "bf": PartitionSpec("x", "y")}
    tree = {"model": {k: jax.device_put(jnp.asarray(v), NamedSharding(mesh, specs[k]))
                      for k, v in vals.items() if k != "bf"},
            "bf": jax.device_put(jnp.asarray(vals["bf"]), NamedSharding(mesh, specs["bf"]))}
    assert len(tree["bf"].addressable_shards) == 8
    hyperdcp.save(tree, path)
    return {"ok": True}


def _jax_load(pid, n, path, seed):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((4, 2), ("a", "b"))
    vals = values(seed)
    target = {"model": {k: jax.ShapeDtypeStruct(SHAPES[k], np.float32,
                                                sharding=NamedSharding(
                                                    mesh, PartitionSpec(*("b", "a")[:len(SHAPES[k])])))
                        for k in ("0.weight", "0.bias")},
              "bf": jax.ShapeDtypeStruct(SHAPES["bf"], vals["bf"].dtype,
                                         sharding=NamedSharding(mesh, PartitionSpec("a")))}
    got = hyperdcp.load(target, path).state
    same = {}
    for k in ("0.weight", "0.bias"):
        a = got["model"][k]
        same[k] = bool(a.sharding.spec == target["model"][k].sharding.spec
                       and np.asarray(a).tobytes() == vals[k].tobytes())
    same["bf"] = bool(np.asarray(got["bf"]).view(np.uint16).tobytes() == vals["bf"].view(np.uint16).tobytes())
    return same


def _bf16_tensor(words: np.ndarray):
    return ms.Tensor.from_numpy(np.ascontiguousarray(words)).view(ms.bfloat16)


def test_jax_save_loads_into_mindspore_and_a_mindspore_save_loads_into_jax(tmp_path):
    src, back = str(tmp_path / "from_jax"), str(tmp_path / "from_ms")
    run_jax(1, 8, "tests.test_cross_framework_jax_mindspore:_jax_save", {"path": src, "seed": 1}, timeout=120)
    want = values(1)

    # into a Cell's Parameters, in place (the objects stay the same), and a bf16 tensor
    ms.set_seed(0)
    net = ms.nn.SequentialCell([ms.nn.Dense(4, 8)])
    params = net.parameters_dict()
    ids = {k: id(v) for k, v in params.items()}
    bf = _bf16_tensor(np.zeros(SHAPES["bf"], np.uint16))
    state = {"model": params, "bf": bf}
    hyperdcp.load(state, src)
    for k in ("0.weight", "0.bias"):
        assert id(params[k]) == ids[k]
        assert params[k].asnumpy().tobytes() == want[k].tobytes(), k
    assert state["bf"].view(ms.int16).asnumpy().tobytes() == want["bf"].view(np.uint16).tobytes()

    # into the slices of a MindSpore layout: the weight split on both dims over a (2, 2) device matrix
    layout = ms.parallel.Layout((2, 2), ("dp", "mp"))("dp", "mp")
    spec = msl.parse_layout("model.0.weight", layout)
    for rank in range(4):
        part = ms.Parameter(ms.Tensor(np.zeros((4, 2), np.float32)), name="0.weight")
        hyperdcp.load({"model": {"0.weight": msa.Sharded(part, layout, rank=rank)}}, src, strict=False)
        box = msl.local_box(spec, SHAPES["0.weight"], msl.coordinate(spec, rank))
        assert box.lengths == (4, 2)
        sl = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))
        assert part.asnumpy().tobytes() == np.ascontiguousarray(want["0.weight"][sl]).tobytes(), rank

    # MindSpore saves new values; JAX loads them under another sharding
    new = values(2)
    for k in ("0.weight", "0.bias"):
        params[k].set_data(ms.Tensor(new[k]))
    hyperdcp.save({"model": params, "bf": _bf16_tensor(new["bf"].view(np.uint16))}, back)
    same = run_jax(1, 8, "tests.test_cross_framework_jax_mindspore:_jax_load", {"path": back, "seed": 2},
                   timeout=120)[0]
    assert same == {"0.weight": True, "0.bias": True, "bf": True}
