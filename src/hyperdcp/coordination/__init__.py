"""Cross-rank coordination: byte-level collectives with error propagation. No pickle anywhere.

- :mod:`.base`: the :class:`Coordinator` and :class:`Transport` interfaces;
- :mod:`.checked`: the error-carrying steps (an error on one rank raises on every rank);
- :mod:`.local`, :mod:`.torch_dist`, :mod:`.files`: the coordinators;
- :mod:`.shm`: same-host shared-memory segments.

:func:`default_coordinator` picks the coordinator a save or load runs on.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import CoordinationError
from .base import Coordinator, Transport
from .checked import RaisedEverywhere, run_checked
from .local import LocalCoordinator

__all__ = ["Coordinator", "LocalCoordinator", "RaisedEverywhere", "Transport", "default_coordinator", "run_checked"]


def default_coordinator(process_group: Any = None, timeout: float | None = None) -> Coordinator:
    """torch.distributed when it is initialized (in the given group), else the JAX distributed runtime
    when ``jax.distributed.initialize()`` ran (several processes), else MindSpore's communication when
    ``mindspore.communication.init()`` ran (several ranks), else a single process.

    Neither framework is imported here: each is used only when the program already imported it.
    """
    if sys.modules.get("torch") is not None:
        from .torch_dist import TorchCoordinator, torch_distributed_initialized

        if torch_distributed_initialized():
            return TorchCoordinator(process_group, timeout)
    if process_group is None and sys.modules.get("jax") is not None:
        from .jax_dist import JaxCoordinator, jax_distributed_initialized

        if jax_distributed_initialized():
            return JaxCoordinator(timeout)
    if process_group is None and sys.modules.get("mindspore") is not None:
        from .mindspore_dist import MindSporeCoordinator, mindspore_distributed_initialized

        if mindspore_distributed_initialized():
            return MindSporeCoordinator()
    if process_group is not None:
        raise CoordinationError("a process_group was given but torch.distributed is not initialized; call "
                                "torch.distributed.init_process_group() first, or drop process_group=")
    return LocalCoordinator()
