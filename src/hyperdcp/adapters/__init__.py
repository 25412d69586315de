"""Framework adapters: turn state-dict leaves into the core's :class:`~hyperdcp.core.shards.ShardedTensor`.

The core never imports a framework. Adapters are registered by the module of their framework and picked
through ``sys.modules``: an adapter whose framework is not loaded in the process is never consulted (and
its module never imported), so numpy-only users never import torch. See :mod:`.base` for the protocol and
its call order. numpy arrays are handled by :mod:`.numpy`; torch tensors and DTensors by :mod:`.torch`;
MindSpore Tensors, Parameters and layout slices by :mod:`.mindspore`.

    to_sharded(fqn, value, coord, for_load)   # the adapter that owns value
    is_tensor_like(value) / describe(value)    # for walking state dicts and for messages
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from .. import _runtime
from ..core.shards import ShardedTensor
from ..errors import StateDictError
from . import numpy as _numpy
from .base import Adapter


class _ModuleAdapter:
    """An :class:`Adapter` over one of this package's adapter modules (imported on first use)."""

    def __init__(self, module: str, impl: str, stager: str | None = None):
        self.module = module
        self._impl_name, self._stager_name = impl, stager
        self._impl = None

    @property
    def impl(self):
        if self._impl is None:
            self._impl = importlib.import_module(self._impl_name, __name__)
        return self._impl

    def is_tensor(self, value: Any) -> bool:
        return self.impl.is_tensor(value)

    def describe(self, value: Any) -> str:
        return self.impl.describe(value)

    def to_sharded(self, fqn: str, value: Any, coord: Any, for_load: bool) -> ShardedTensor:
        return self.impl.to_sharded(fqn, value, coord, for_load)

    def stager(self) -> Any:
        if self._stager_name is None:
            return None
        return importlib.import_module(self._stager_name, __name__).TorchStaging()


class _NumpyAdapter:
    module = "numpy"

    def is_tensor(self, value: Any) -> bool:
        return _numpy.is_array(value)

    def describe(self, value: Any) -> str:
        return "numpy array"

    def to_sharded(self, fqn: str, value: Any, coord: Any, for_load: bool) -> ShardedTensor:
        return _numpy.to_sharded(fqn, value, coord, for_load)

    def stager(self) -> Any:
        return None


def _builtin() -> list[Adapter]:
    """The adapters in the order they are asked: numpy first (always loaded), then the frameworks."""
    return [_NumpyAdapter(), _ModuleAdapter("torch", ".torch", ".torch_staging"), _ModuleAdapter("jax", ".jax"),
            _ModuleAdapter("mindspore", ".mindspore")]


def _registry() -> list[Adapter]:
    return _runtime.slot("adapters.registry", _builtin)


def register(adapter: Adapter) -> None:
    """Add an adapter (e.g. for jax or mindspore); it is asked after the built-in ones."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"{adapter!r} does not implement hyperdcp.adapters.base.Adapter")
    _registry().append(adapter)


def loaded() -> list[Adapter]:
    """The adapters whose framework module is loaded in this process, in registry order."""
    return [a for a in _registry() if sys.modules.get(a.module) is not None]


def _owner(value: Any) -> Adapter | None:
    for a in loaded():
        if a.is_tensor(value):
            return a
    return None


def is_tensor_like(value: Any) -> bool:
    """Whether some loaded framework's adapter owns ``value``."""
    return _owner(value) is not None


def to_sharded(fqn: str, value: Any, ctx, for_load: bool) -> ShardedTensor:
    """The ShardedTensor view of ``value``: for saving (buffers are read) or loading (written)."""
    a = _owner(value)
    if a is None:
        raise StateDictError(f"{fqn!r}: a {type(value).__name__} is not a tensor of any loaded framework (numpy, "
                             f"{', '.join(x.module for x in _registry()[1:])}); pass a tensor or a plain value")
    return a.to_sharded(fqn, value, ctx, for_load)


def describe(value: Any) -> str:
    """A short description of ``value`` for error messages."""
    a = _owner(value)
    return a.describe(value) if a is not None else type(value).__name__


def flatten_tree(state: Any, for_load: bool) -> tuple[Any, Any]:
    """``(flat state dict, rebuild)`` when a loaded framework's adapter claims ``state`` as one of its trees
    (a JAX pytree: :func:`.jax_tree.flatten`), else ``(state, None)``. ``rebuild(flat)`` is the loaded tree."""
    if sys.modules.get("jax") is not None:
        from .jax_tree import flatten

        got = flatten(state, for_load)
        if got is not None:
            return got
    return state, None


def stager() -> Any:
    """The fast async-staging helper of the first loaded framework that has one, or None."""
    for a in loaded():
        s = a.stager()
        if s is not None:
            return s
    return None
