"""MindSpore state through hyperdcp: a Cell's parameters and its Adam state restored in place, bit-exact.

The scenarios: a small nn.SequentialCell trained two steps with nn.Adam (so every moment is non-zero) is
saved from ``parameters_dict()`` / the optimizer's ``parameters_dict()``; a freshly initialised copy loads
the checkpoint into its own Parameters, which keep their identity, name and dtype and end up bit-equal to
the trained ones. bfloat16 Tensors (MindSpore has them; this wheel cannot make bf16 Parameters under
numpy 2) round-trip word for word, NaN payloads and signed zeros included. A Cell given whole goes through
its ``state_dict()`` / ``load_state_dict()``. Errors name the tensor.
"""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

import hyperdcp  # noqa: E402
from hyperdcp.adapters import mindspore as msa  # noqa: E402

msa.prime()
nn = ms.nn

BF16_WORDS = np.array([0x3FC0, 0xBFC0, 0x7FC1, 0xFFFF, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001, 0x7F7F],
                      np.uint16).view(np.int16)  # 1.5, -1.5, NaN with payload, -NaN, -0, 0, inf, -inf, subnormal, max


def bf16(words: np.ndarray):
    return ms.Tensor.from_numpy(np.ascontiguousarray(words)).view(ms.bfloat16)


def words(t) -> np.ndarray:
    return t.view(ms.int16).asnumpy()


def build(seed: int):
    ms.set_seed(seed)
    net = nn.SequentialCell([nn.Dense(3, 4), nn.ReLU(), nn.Dense(4, 2)])
    return net, nn.Adam(net.trainable_params(), learning_rate=0.01)


def train(net, opt, steps: int, seed: int = 0) -> None:
    loss = nn.MSELoss()
    grad = ms.value_and_grad(lambda x, y: loss(net(x), y), None, opt.parameters)
    rng = np.random.RandomState(seed)
    x, y = ms.Tensor(rng.randn(5, 3).astype(np.float32)), ms.Tensor(rng.randn(5, 2).astype(np.float32))
    for _ in range(steps):
        _, g = grad(x, y)
        opt(g)


def trained(seed: int):
    net, opt = build(seed)
    train(net, opt, 2, seed)
    return net, opt


def snapshot(params) -> dict[str, np.ndarray]:
    return {k: v.asnumpy().copy() for k, v in params.items()}


def test_cell_and_adam_state_restored_in_place_bit_exact(tmp_path):
    net, opt = trained(seed=1)
    want_net, want_opt = snapshot(net.parameters_dict()), snapshot(opt.parameters_dict())
    assert np.abs(want_opt["moment2.0.weight"]).sum() > 0  # the optimizer really has state
    hyperdcp.save({"model": net.parameters_dict(), "optim": opt.parameters_dict(), "step": 2}, tmp_path / "c")

    fresh_net, fresh_opt = build(seed=7)  # a restart: new Cell, new optimizer, nothing trained yet
    model, optim = fresh_net.parameters_dict(), fresh_opt.parameters_dict()
    before = {k: (id(p), p.name, p.dtype) for k, p in {**model, **optim}.items()}
    assert not np.array_equal(model["0.weight"].asnumpy(), want_net["0.weight"])
    state = {"model": model, "optim": optim, "step": 0}
    hyperdcp.load(state, tmp_path / "c")

    assert state["step"] == 2
    for got, want in ((fresh_net.parameters_dict(), want_net), (fresh_opt.parameters_dict(), want_opt)):
        for k, p in got.items():
            assert (id(p), p.name, p.dtype) == before[k], k
            assert p.asnumpy().dtype == want[k].dtype and p.asnumpy().tobytes() == want[k].tobytes(), k
    meta = hyperdcp.read_metadata(tmp_path / "c")
    assert meta.tensors["optim.moment1.0.weight"].dtype == "F32" and meta.tensors["optim.global_step"].dtype == "I32"
    # the restored Parameters are the ones training uses: one more step of both runs agrees exactly
    train(net, opt, 1, seed=4)
    train(fresh_net, fresh_opt, 1, seed=4)
    assert snapshot(fresh_net.parameters_dict()).keys() == want_net.keys()
    for k, v in snapshot(net.parameters_dict()).items():
        assert fresh_net.parameters_dict()[k].asnumpy().tobytes() == v.tobytes(), k


def test_a_cell_given_whole_is_saved_and_restored_through_its_state_dict(tmp_path):
    net, _ = trained(seed=2)
    want = snapshot(net.parameters_dict())
    hyperdcp.save({"net": net}, tmp_path / "c")
    other, _ = trained(seed=3)
    hyperdcp.load({"net": other}, tmp_path / "c")
    assert {k: v.asnumpy().tobytes() for k, v in other.parameters_dict().items()} == \
        {k: v.tobytes() for k, v in want.items()}
    assert sorted(hyperdcp.read_metadata(tmp_path / "c").tensors) == ["net." + k for k in sorted(want)]


def test_bf16_round_trips_word_for_word(tmp_path):
    grid = bf16(np.arange(-600, 600, 5, dtype=np.int16).reshape(8, 30))
    hyperdcp.save({"special": bf16(BF16_WORDS), "grid": grid, "f16": ms.Tensor(np.float16([1.5, -0.0]))},
                  tmp_path / "c")
    meta = hyperdcp.read_metadata(tmp_path / "c")
    assert meta.tensors["special"].dtype == "BF16" and meta.tensors["f16"].dtype == "F16"
    special, back_grid = bf16(np.zeros(10, np.int16)), bf16(np.zeros((8, 30), np.int16))
    f16 = ms.Tensor(np.zeros(2, np.float16))
    hyperdcp.load({"special": special, "grid": back_grid, "f16": f16}, tmp_path / "c")
    assert special.dtype == ms.bfloat16 and words(special).tobytes() == BF16_WORDS.tobytes()
    assert words(back_grid).tobytes() == words(grid).tobytes()
    assert f16.asnumpy().tobytes() == np.float16([1.5, -0.0]).tobytes()


def test_mindspore_bf16_reads_as_ml_dtypes_bfloat16_in_numpy(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    hyperdcp.save({"b": bf16(BF16_WORDS)}, tmp_path / "c")
    back = {"b": np.zeros(10, ml_dtypes.bfloat16)}
    hyperdcp.load(back, tmp_path / "c")
    assert back["b"].view(np.int16).tobytes() == BF16_WORDS.tobytes()


def test_loading_a_saved_shape_into_another_shape_names_the_tensor(tmp_path):
    hyperdcp.save({"w": ms.Parameter(ms.Tensor(np.ones((3, 4), np.float32)), name="w")}, tmp_path / "c")
    with pytest.raises(hyperdcp.CheckpointError, match="'w'.*shape"):
        hyperdcp.load({"w": ms.Parameter(ms.Tensor(np.zeros((4, 3), np.float32)), name="w")}, tmp_path / "c")


def test_a_slice_whose_shape_disagrees_with_its_layout_is_refused_with_the_name(tmp_path):
    part = ms.Parameter(ms.Tensor(np.zeros((3, 4), np.float32)), name="w")
    bad = msa.Sharded(part, {"device_matrix": (1,), "tensor_map": (0, -1)}, shape=(4, 4))
    with pytest.raises(hyperdcp.CheckpointError, match="'w'.*slice has shape"):
        hyperdcp.save({"w": bad}, tmp_path / "c")


def test_async_save_stages_mindspore_state_at_the_call(tmp_path):
    w = ms.Parameter(ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)), name="w")
    fut = hyperdcp.async_save({"w": w, "b": bf16(BF16_WORDS)}, tmp_path / "c")
    w.set_data(ms.Tensor(np.zeros((3, 4), np.float32)))  # training goes on while the save persists
    fut.result(timeout=120)
    back, b = ms.Parameter(ms.Tensor(np.ones((3, 4), np.float32)), name="w"), bf16(np.zeros(10, np.int16))
    hyperdcp.load({"w": back, "b": b}, tmp_path / "c")
    assert back.asnumpy().tobytes() == np.arange(12, dtype=np.float32).tobytes()
    assert words(b).tobytes() == BF16_WORDS.tobytes()
