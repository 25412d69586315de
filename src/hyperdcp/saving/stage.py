"""Staging: a state dict becomes one rank's StagedState (host chunks in plan order, plus plain values).

Call order: ``staged = stage(state_dict, coord)`` on every rank, then :func:`hyperdcp.saving.flow.persist`
(collective) or :func:`hyperdcp.saving.no_collectives.persist_alone` (each rank alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from .. import adapters
from ..adapters.state_dict import TENSOR, iter_leaves
from ..coordination.base import Coordinator
from ..core import dtypes
from ..core.shards import LocalShard, ShardedTensor, check_shard_buffer
from ..errors import StateDictError
from ..format import values as values_codec
from ..format.metadata import MAX_DIMS, MAX_TENSOR_BYTES
from ..planning.save_plan import LocalPlan, content_table


@dataclass
class StagedState:
    """One rank's contribution to a save: host chunks in plan order, and plain values."""

    plan: LocalPlan
    chunks: list[tuple[ShardedTensor, LocalShard]]
    values: dict[str, Any]
    #: the values encoded (tagged JSON); computed when first needed
    encoded: dict[str, list] | None = None

    def encoded_values(self) -> dict[str, list]:
        if self.encoded is None:
            self.encoded = {k: values_codec.encode(v, k) for k, v in self.values.items()}
        return self.encoded

    def content(self) -> bytes:
        """This rank's content table: a digest of every tensor it holds whole and of every value.

        Compared across ranks to find what differs between them (and so is stored per rank): a tensor
        every rank claims to hold whole (a plain tensor, a replicated DTensor) is checked, not trusted.
        """
        tkeys, tdig = [], []
        for st, sh in self.chunks:
            if sh.box.lengths == tuple(st.shape) and not any(sh.box.offsets):
                tkeys.append(st.fqn)
                tdig.append(xxhash.xxh3_64_intdigest(sh.data))
        enc = self.encoded_values()
        vkeys = sorted(enc)
        return content_table(tkeys, tdig, vkeys, [values_codec.digest(enc[k]) for k in vkeys])

    @property
    def nbytes(self) -> int:
        return sum(sh.data.size for _, sh in self.chunks)


def check_storable(fqn: str, shape: tuple[int, ...], dtype: str) -> None:
    """Refuse, before anything is written, a tensor the format cannot store (so every save loads)."""
    if not fqn:
        raise StateDictError("a tensor is stored under the empty key ''; hyperdcp names every tensor by a non-empty "
                             "key: put it in the state dict under a name")
    if len(shape) > MAX_DIMS:
        raise StateDictError(f"tensor {fqn!r} has {len(shape)} dimensions; the format stores at most {MAX_DIMS}: "
                             "reshape it before saving")
    numel = 1
    for s in shape:
        numel *= int(s)
    if numel * dtypes.itemsize(dtype) > MAX_TENSOR_BYTES:
        raise StateDictError(f"tensor {fqn!r} of shape {list(shape)} is larger than the format's "
                             f"{MAX_TENSOR_BYTES}-byte limit per tensor")


def stage(state_dict: Any, ctx: Coordinator) -> StagedState:
    """Describe ``state_dict`` for saving (no copies of CPU tensors; device tensors come to host)."""
    if not isinstance(state_dict, dict) and not hasattr(state_dict, "state_dict"):
        raise StateDictError("the state dict must be a dict (or an object with state_dict()), got "
                             f"{type(state_dict).__name__}")
    tensors, vals, enc = [], {}, {}
    for fqn, kind, v in iter_leaves(state_dict):
        if kind == TENSOR:
            st = adapters.to_sharded(fqn, v, ctx, for_load=False)
            check_storable(fqn, st.shape, st.dtype)
            for sh in st.shards:
                check_shard_buffer(fqn, sh, st.dtype)
            tensors.append(st)
        else:
            enc[fqn] = values_codec.encode(v, fqn)
            vals[fqn] = v
    plan, chunks = LocalPlan.build(tensors, list(vals))
    return StagedState(plan, chunks, vals, enc)
