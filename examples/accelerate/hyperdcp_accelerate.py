"""Accelerate's ``save_state`` / ``load_state`` of FSDP2 models through hyperdcp.

    import hyperdcp_accelerate

    with hyperdcp_accelerate.checkpoints():
        accelerator.save_state("out/step-300")       # model and optimizer: hyperdcp checkpoints
    ...
    with hyperdcp_accelerate.checkpoints():
        accelerator.load_state("out/step-300")       # on any world size / FSDP2 layout

With ``state_dict_type="SHARDED_STATE_DICT"`` (FSDP2's default in accelerate), accelerate saves the model
into ``<dir>/pytorch_model_fsdp_0`` and the optimizer into ``<dir>/optimizer_0`` by calling
``torch.distributed.checkpoint.save`` / ``load`` with a ``FileSystemWriter`` / ``FileSystemReader`` and
torch's default planner. Inside :func:`checkpoints` those two calls go to :mod:`hyperdcp.torch`, which
takes the writer's path; the default planners are dropped (hyperdcp plans itself), any other planner is
refused. Everything else accelerate writes (RNG states, schedulers, its own pickles) is unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import hyperdcp.torch


def _default(planner: Any, kind: type) -> Any:
    return None if type(planner) is kind else planner  # hyperdcp.torch refuses anything else, clearly


def _save(state_dict: Any, *, planner: Any = None, **kw: Any):
    return hyperdcp.torch.save(state_dict, planner=_default(planner, DefaultSavePlanner), **kw)


def _load(state_dict: Any, *, planner: Any = None, **kw: Any):
    return hyperdcp.torch.load(state_dict, planner=_default(planner, DefaultLoadPlanner), **kw)


@contextlib.contextmanager
def checkpoints() -> Iterator[None]:
    """Within it, ``torch.distributed.checkpoint.save``/``load`` (as accelerate calls them) use hyperdcp."""
    saved = dist_cp.save, dist_cp.load
    dist_cp.save, dist_cp.load = _save, _load
    try:
        yield
    finally:
        dist_cp.save, dist_cp.load = saved
