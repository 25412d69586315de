"""The Adapter protocol: how a framework's values become the core's shard contract.

An adapter serves one framework module (``module``: checked in ``sys.modules``, never imported by
hyperdcp itself, so a framework that the user did not import costs nothing). Call order, per state-dict
leaf: ``is_tensor(value)`` (does this adapter own the leaf?) -> ``to_sharded(fqn, value, coord,
for_load)`` (its global shape, dtype and this rank's boxes with their bytes; for loads, writable
destinations) -> on errors ``describe(value)`` (a short type description for messages). Async saves
ask ``stager()`` once for an optional fast staging helper (None: the generic path copies
``to_sharded`` buffers).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

from ..core.shards import ShardedTensor


@runtime_checkable
class Adapter(Protocol):
    """One framework's values -> :class:`~hyperdcp.core.shards.ShardedTensor` (see the module docstring)."""

    #: the framework's top-level module name (``"torch"``, ``"numpy"``, ``"jax"``, ...)
    module: ClassVar[str]

    def is_tensor(self, value: Any) -> bool:
        """Whether ``value`` is a tensor of this framework."""
        ...

    def describe(self, value: Any) -> str:
        """A short description of ``value`` for error messages (e.g. ``"DTensor [Shard(0)] on cpu"``)."""
        ...

    def to_sharded(self, fqn: str, value: Any, coord: Any, for_load: bool) -> ShardedTensor:
        """The shard-contract view of ``value`` under the ranks of ``coord``: buffers are read (save) or
        written (``for_load``)."""
        ...

    def stager(self) -> Any:
        """A fast staging helper for async saves, or None."""
        ...
