"""Process-wide state in one place: named slots that their owners fill on first use.

Every cache or registry that lives for the whole process (the save plan cache, async-save sessions,
live shared-memory segments, per-group gloo state, ...) is a slot here instead of a module global, so
that tests can reset all of it at once (:func:`reset`) and a reader finds every piece of process state
in one module. This module is a leaf: it imports nothing from hyperdcp.

    cache = _runtime.slot("planning.plan_cache", PlanCache)   # created on first use, then shared
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_SLOTS: dict[str, Any] = {}
_LOCK = threading.Lock()


def slot(name: str, factory: Callable[[], T]) -> T:
    """The process-wide object named ``name``, made by ``factory()`` on first use."""
    try:
        return _SLOTS[name]
    except KeyError:
        with _LOCK:
            if name not in _SLOTS:
                _SLOTS[name] = factory()
            return _SLOTS[name]


def names() -> list[str]:
    """The slots filled so far (for diagnostics and tests)."""
    return sorted(_SLOTS)


def reset(*which: str) -> None:
    """Forget the named slots (all of them without arguments); the next use makes fresh ones.

    For tests: live resources (processes, segments) are not released here; their owners' own
    shutdown functions do that.
    """
    with _LOCK:
        for name in which or list(_SLOTS):
            _SLOTS.pop(name, None)
