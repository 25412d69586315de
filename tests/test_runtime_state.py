"""Process-wide state lives in named slots of ``hyperdcp._runtime`` (one place to find it, one reset for tests).

The save plan cache is the ``planning.plan_cache`` slot (``hyperdcp.api.DEFAULT_PLAN_CACHE`` reads it), shared
by ``save`` and ``async_save``; async-save sessions are the ``async_saving.sessions`` slot.
"""

from __future__ import annotations

import numpy as np
import pytest

import hyperdcp
from hyperdcp import _runtime, api


@pytest.fixture
def fresh_runtime():
    """Fresh process-wide state for one test (and none of its state left for the next)."""
    hyperdcp.async_saving.shutdown()
    _runtime.reset()
    yield
    hyperdcp.async_saving.shutdown()
    _runtime.reset()


def test_the_plan_cache_is_a_runtime_slot_that_reset_empties(tmp_path, fresh_runtime):
    state = {"w": np.arange(8.0).reshape(2, 4), "b": np.ones(3, np.float32)}
    assert hyperdcp.save(state, str(tmp_path / "a")).plan_cache_hit is False
    assert hyperdcp.save(state, str(tmp_path / "b")).plan_cache_hit is True  # same structure: cached plan
    assert "planning.plan_cache" in _runtime.names() and api.DEFAULT_PLAN_CACHE is api.plan_cache()
    _runtime.reset()
    assert "planning.plan_cache" not in _runtime.names()
    assert hyperdcp.save(state, str(tmp_path / "c")).plan_cache_hit is False  # a fresh cache after reset
    got = {"w": np.zeros((2, 4)), "b": np.zeros(3, np.float32)}
    hyperdcp.load(got, str(tmp_path / "c"))
    assert np.array_equal(got["w"], state["w"]) and np.array_equal(got["b"], state["b"])


def test_async_sessions_are_a_runtime_slot(tmp_path, fresh_runtime):
    from hyperdcp.async_saving import session

    assert session.current_session() is None
    fut = hyperdcp.async_save({"w": np.arange(6.0)}, str(tmp_path / "a"))
    assert fut.result(timeout=120).plan_cache_hit is False
    got = {"w": np.zeros(6)}
    hyperdcp.load(got, str(tmp_path / "a"))
    assert np.array_equal(got["w"], np.arange(6.0))
    assert "async_saving.sessions" in _runtime.names() and session.current_session() is not None
    # the persist process learned the plan and sent it back: the training process's slot holds it
    assert len(api.plan_cache()) >= 1
    hyperdcp.async_saving.shutdown()
    assert session.current_session() is None
