"""Adapters are picked through ``sys.modules``: a framework the process has not imported is never consulted,
and a new framework plugs in by registering an :class:`~hyperdcp.adapters.base.Adapter`.

The scenario: a minimal framework ``fakefw`` whose tensors wrap a numpy array is registered; a state dict
holding its tensors saves and loads back exactly while ``fakefw`` is imported, and its tensors are not
recognised once the module is gone from ``sys.modules``.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import hyperdcp
from hyperdcp import _runtime, adapters
from hyperdcp.adapters import numpy as np_adapter
from hyperdcp.adapters.base import Adapter


class FakeTensor:
    def __init__(self, data: np.ndarray):
        self.data = data


class FakeAdapter:
    module = "fakefw"

    def is_tensor(self, value) -> bool:
        return isinstance(value, FakeTensor)

    def describe(self, value) -> str:
        return f"fakefw tensor {value.data.shape}"

    def to_sharded(self, fqn, value, coord, for_load):
        return np_adapter.to_sharded(fqn, value.data, coord, for_load)

    def stager(self):
        return None


@pytest.fixture
def fakefw(monkeypatch):
    monkeypatch.setitem(sys.modules, "fakefw", types.ModuleType("fakefw"))
    _runtime.reset("adapters.registry")
    adapters.register(FakeAdapter())
    yield
    _runtime.reset("adapters.registry")  # back to the built-in adapters


def test_a_registered_framework_saves_and_loads_exactly(tmp_path, fakefw):
    assert isinstance(FakeAdapter(), Adapter)
    state = {"layer": {"w": FakeTensor(np.arange(12, dtype=np.float32).reshape(3, 4))}, "step": 3}
    hyperdcp.save(state, str(tmp_path / "step-3"))
    meta = hyperdcp.read_metadata(str(tmp_path / "step-3"))
    assert meta.tensors["layer.w"].shape == (3, 4)
    got = {"layer": {"w": FakeTensor(np.zeros((3, 4), np.float32))}, "step": 0}
    hyperdcp.load(got, str(tmp_path / "step-3"))
    assert np.array_equal(got["layer"]["w"].data, state["layer"]["w"].data) and got["step"] == 3
    assert adapters.describe(got["layer"]["w"]) == "fakefw tensor (3, 4)"


def test_an_adapter_whose_framework_is_not_imported_is_never_asked(fakefw, monkeypatch):
    t = FakeTensor(np.ones(2))
    assert adapters.is_tensor_like(t)
    monkeypatch.delitem(sys.modules, "fakefw")
    assert not adapters.is_tensor_like(t)
    assert [a.module for a in adapters.loaded()] == [m for m in ("numpy", "torch", "jax", "mindspore")
                                                     if m in sys.modules]


def test_registering_something_that_is_not_an_adapter_is_refused():
    with pytest.raises(TypeError, match="does not implement"):
        adapters.register(object())
