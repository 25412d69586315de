"""torchtitan's CheckpointManager, saving and loading with hyperdcp.

torchtitan's ``Trainer`` builds whatever checkpoint manager its config names (``config.checkpoint.build(...)``
in torchtitan/trainer.py), so a config registry function chooses this one:

    # my_configs.py, importable (on PYTHONPATH) with this file
    from torchtitan.models.llama3.config_registry import llama3_8b
    from hyperdcp_torchtitan import HyperdcpCheckpointManager, use_hyperdcp

    def llama3_8b_hyperdcp():
        config = llama3_8b()
        config.checkpoint = HyperdcpCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)
        return config                # or: return use_hyperdcp(llama3_8b()), its checkpoint settings kept

    torchrun --nproc-per-node 8 -m torchtitan.train --module my_configs --config llama3_8b_hyperdcp

(``--checkpoint.*`` flags override it as usual). Everything torchtitan does around checkpoints stays (what
goes into the state, intervals, the last step, ``load_step``, ``exclude_from_loading``, HF import/export
through its state-dict adapter); four things change:

* ``dcp_save`` / ``dcp_load``: the native checkpoints go through :mod:`hyperdcp.torch` (async modes too);
* per-rank state (the dataloader's) under another world size: each rank loads its own rank's copy when
  there is one, as DCP finds it under the rank's key (hyperdcp asks for that rule, ``per_rank=``);
* ``_find_load_step``: the newest *committed* hyperdcp checkpoint ``step-N`` (torch's version looks for
  DCP's ``.metadata`` and would otherwise silently start afresh, then overwrite the old step);
* ``_purge_stale_checkpoints``: hyperdcp's retention, which counts only committed checkpoints, never
  deletes the newest one and deletes crash-safely (``keep_latest_k``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager

import hyperdcp
import hyperdcp.torch
from hyperdcp.retention import Retention, StepInfo
from hyperdcp.storage.local import LocalStorage

_STEP = re.compile(r"step-(\d+)")


def _own_rank(key: str, rank: int, world_size: int, saved: tuple[int, ...]) -> int | None:
    """Which saved copy of a per-rank entry (the dataloader's ``{"dp_rank_N": ..., "world_size": W}``) a rank
    loads after the world size changed: its own rank's, as torch DCP finds it under the rank's key; none when
    its rank saved none (its state stays as it is). torchtitan's dataloader then decides whether the state
    of another dp degree is usable (it refuses; ``exclude_from_loading=["dataloader"]`` starts it afresh)."""
    return rank if rank in saved else None


class HyperdcpCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager on hyperdcp checkpoints (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False):
        if to_hf:  # HF export: torchtitan's own writer
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if async_mode == AsyncMode.DISABLED:
            hyperdcp.torch.save(state_dict, checkpoint_id=checkpoint_id)
            return None
        return hyperdcp.torch.async_save(state_dict, checkpoint_id=checkpoint_id)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf or not hyperdcp.is_checkpoint(checkpoint_id):  # HF weights, or a torch DCP initial load
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        hyperdcp.torch.load(state_dict, checkpoint_id=checkpoint_id, per_rank=_own_rank)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        """The newest committed step under ``folder`` (rank 0 decides for every rank), or -1."""
        folder = folder or self.folder
        if not os.path.isdir(folder):
            return -1
        try:
            latest = hyperdcp.latest_checkpoint(folder)
        except hyperdcp.FormatError:  # only torch DCP checkpoints there (from before the switch): torch's rule
            return super()._find_load_step(folder)
        m = _STEP.fullmatch(os.path.basename(latest)) if latest else None
        return int(m.group(1)) if m else -1

    def _purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k <= 0 or dist.get_rank() != 0 or not os.path.isdir(self.folder):
            return
        steps = []
        for path in hyperdcp.list_checkpoints(self.folder):
            m = _STEP.fullmatch(os.path.basename(path))
            if m:
                steps.append(StepInfo(int(m.group(1)), os.path.basename(path), 0.0))
        root = LocalStorage(self.folder)
        try:
            for s in Retention(keep_last=self.keep_latest_k).to_delete(steps, now=0.0):
                root.delete(s.name)
            root.sweep()
        finally:
            root.close()


def use_hyperdcp(trainer_config: Any) -> Any:
    """``trainer_config`` (a torchtitan ``Trainer.Config``) with its checkpoint section on
    :class:`HyperdcpCheckpointManager`, every setting of its ``CheckpointManager.Config`` kept."""
    old = trainer_config.checkpoint
    kept = {f.name: getattr(old, f.name) for f in fields(HyperdcpCheckpointManager.Config)
            if f.init and hasattr(old, f.name)}
    trainer_config.checkpoint = HyperdcpCheckpointManager.Config(**kept)
    return trainer_config
