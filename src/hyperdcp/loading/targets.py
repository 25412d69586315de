"""A rank's destinations: state-dict leaves -> tensors to fill (as pieces of stored chunks), plain
values to set, and the keys that are missing; per-rank entries resolved to the saving rank to take.

Call order: ``leaves_for_load(state_dict)`` (adapters), then :func:`plan_targets` on every rank; the
load flow reads ``LoadTargets.pieces`` and sets ``LoadTargets.values`` only after every tensor arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .. import adapters
from ..adapters.state_dict import TENSOR, LoadLeaf
from ..coordination.base import Coordinator
from ..core.boxes import Box
from ..core.shards import LocalShard, ShardedTensor
from ..errors import MismatchError
from ..format.metadata import Metadata
from ..options import LoadOptions
from ..planning.load_plan import Piece, TensorIndex, check_compatible, pieces_for


@dataclass
class LoadTargets:
    """This rank's destinations: tensors to fill, values to set, and what is missing."""

    tensors: dict[str, ShardedTensor]
    values: list[tuple[LoadLeaf, Any]]
    missing: list[str]
    pieces: list[Piece]
    used: set[str]


_DROP, _ABSENT = object(), object()


def saved_rank(fqn: str, saved: Sequence[int], meta: Metadata, coord: Coordinator, opts: LoadOptions) -> Any:
    """The saving rank whose copy of per-rank entry ``fqn`` this rank loads, ``_DROP`` or ``_ABSENT``.

    With the world size of the save each rank takes its own copy (``_ABSENT`` when it saved none);
    otherwise ``opts.per_rank`` decides, and without it the load fails naming the key.
    """
    saved = tuple(int(r) for r in saved)
    if meta.world_size == coord.world_size:
        return coord.rank if coord.rank in saved else _ABSENT
    how = opts.per_rank
    if how is None:
        raise MismatchError(
            f"{fqn!r} was saved per rank (it differed between the {meta.world_size} saving ranks, or only ranks "
            f"{list(saved[:8])}{' ...' if len(saved) > 8 else ''} held it), and this load runs on {coord.world_size} "
            "ranks, so which saved copy each rank should get is not defined. Pass per_rank='rank0' (every rank "
            "takes the copy of the lowest saving rank), per_rank='drop' (leave it as it is), or "
            "per_rank=fn(key, rank, world_size, saved_ranks) returning the saving rank to take"
        )
    if how == "rank0":
        return saved[0]
    if how == "drop":
        return _DROP
    got = how(fqn, coord.rank, coord.world_size, saved)
    if got is None:
        return _DROP
    if type(got) is not int or got not in saved:
        raise MismatchError(
            f"per_rank returned {got!r} for {fqn!r} on rank {coord.rank}; it must return one of the saving ranks "
            f"{list(saved[:8])}{' ...' if len(saved) > 8 else ''} or None"
        )
    return got


def _per_rank_view(st: ShardedTensor, saved: tuple[int, ...], row: int) -> ShardedTensor:
    """``st`` as row ``row`` of a tensor stored per rank (one leading dimension more, ``len(saved)`` rows)."""
    shards = [LocalShard(Box((row,) + sh.box.offsets, (1,) + sh.box.lengths), sh.data, None) for sh in st.shards]
    return ShardedTensor(st.fqn, st.dtype, (len(saved),) + tuple(st.shape), shards, st.finish, layout=None)


def plan_targets(leaves: list[LoadLeaf], meta: Metadata, coord: Coordinator, opts: LoadOptions) -> LoadTargets:
    index = TensorIndex(meta)
    out = LoadTargets({}, [], [], [], set())
    for leaf in leaves:
        fqn = leaf.fqn
        if leaf.kind == TENSOR:
            if fqn not in meta.tensors:
                if fqn in meta.values or fqn in meta.per_rank_values:
                    raise MismatchError(f"{fqn!r} is a tensor in the state dict but a plain value in the checkpoint")
                out.missing.append(fqn)
                continue
            st = adapters.to_sharded(fqn, leaf.value, coord, for_load=True)
            stored = meta.tensors[fqn]
            saved = meta.per_rank_tensors.get(fqn)
            if saved is not None:
                who = saved_rank(fqn, saved, meta, coord, opts)
                if who is _ABSENT:
                    out.missing.append(fqn)
                    continue
                if who is _DROP:
                    continue
                st = _per_rank_view(st, saved, saved.index(who))
            check_compatible(fqn, st, stored, opts.allow_cast)
            out.tensors[fqn] = st
            out.pieces.extend(pieces_for(st, index.get(fqn), stored))
        elif fqn in meta.per_rank_values:
            by_rank = meta.per_rank_values[fqn]
            who = saved_rank(fqn, sorted(by_rank), meta, coord, opts)
            if who is _ABSENT:
                out.missing.append(fqn)
                continue
            if who is _DROP:
                continue
            out.values.append((leaf, by_rank[who]))
        elif fqn in meta.values:
            out.values.append((leaf, meta.values[fqn]))
        elif fqn in meta.tensors:
            raise MismatchError(
                f"{fqn!r} is a plain value ({type(leaf.value).__name__}) in the state dict but a tensor in the "
                "checkpoint; put a tensor of the saved shape there to load it"
            )
        else:
            out.missing.append(fqn)
            continue
        out.used.add(fqn)
    return out
