"""Framework adapters: turn state-dict leaves into the core's :class:`~hyperdcp.core.shards.ShardedTensor`.

The core never imports a framework. numpy arrays are handled here; torch tensors and DTensors by
:mod:`hyperdcp.adapters.torch`, imported only when torch is already loaded in the process.
"""

from __future__ import annotations

import sys
from typing import Any

from ..core.shards import ShardedTensor
from . import numpy as _numpy


def is_tensor_like(value: Any) -> bool:
    if _numpy.is_array(value):
        return True
    if sys.modules.get("torch") is not None:
        from . import torch as _torch

        return _torch.is_tensor(value)
    return False


def to_sharded(fqn: str, value: Any, ctx, for_load: bool) -> ShardedTensor:
    """The ShardedTensor view of ``value``: for saving (buffers are read) or loading (written)."""
    if _numpy.is_array(value):
        return _numpy.to_sharded(fqn, value, ctx, for_load)
    from . import torch as _torch

    return _torch.to_sharded(fqn, value, ctx, for_load)


def describe(value: Any) -> str:
    if _numpy.is_array(value):
        return "numpy array"
    if sys.modules.get("torch") is not None:
        from . import torch as _torch

        if _torch.is_tensor(value):
            return _torch.describe(value)
    return type(value).__name__
