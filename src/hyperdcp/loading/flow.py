"""The load flow behind :func:`hyperdcp.load`.

1. rank 0 reads the metadata and sends it to all ranks (validated on each);
2. each rank walks its state dict: every tensor leaf becomes destination boxes (its local shards),
   intersected with the stored chunks through a per-tensor index; plain values are taken from the
   metadata;
3. the needed bytes are read -- by this rank (:mod:`.reads`), or once cluster-wide and exchanged
   (:mod:`.read_once`) -- verified against their checksums and copied into place;
4. a final exchange makes an error on any rank fail the load on every rank.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

from ..adapters.state_dict import leaves_for_load
from ..coordination.base import Coordinator, run_checked
from ..errors import FormatError, MismatchError, StateDictError
from ..format.metadata import Metadata
from ..options import LoadOptions
from ..planning.load_plan import group_reads
from ..results import LoadResult
from ..sources.base import rename_keys, share_source
from .read_once import read_once
from .reads import execute_local_reads
from .targets import plan_targets


def fetch_metadata(coord: Coordinator, path: str) -> Metadata:
    """Rank 0 reads the commit record, every rank validates it; errors raise on every rank.

    A remote URL (fsspec) must hold a committed hyperdcp checkpoint: HuggingFace sources and unmerged
    rank files of no-collectives async saves are detected on local paths only.
    """
    meta, wrong_path = fetch_metadata_checked(coord, path)
    if wrong_path is not None:
        raise wrong_path
    return meta


def fetch_metadata_checked(coord: Coordinator, path: str) -> tuple[Metadata, Exception | None]:
    """:func:`fetch_metadata`, and this rank's error if it named another path than rank 0 (None if not).

    With several ranks, rank 0's path digest rides on the metadata broadcast (no extra collective); the
    caller raises the error in its next checked step, so it surfaces on every rank.
    """
    source, wrong = share_source(coord, path)
    return source.metadata, wrong



def _renamed(d: dict, key_map) -> dict:
    out = {}
    for k, v in d.items():
        new = key_map(k)
        if new is not None:
            out[new] = v
    return out


def load(state_dict: Any, path: str, coord: Coordinator, opts: LoadOptions) -> LoadResult:
    t0 = time.perf_counter()
    if opts.per_rank is not None and opts.per_rank not in ("rank0", "drop") and not callable(opts.per_rank):
        raise TypeError(f"per_rank must be None, 'rank0', 'drop' or fn(key, rank, world_size, saved_ranks), got "
                        f"{opts.per_rank!r}")
    source, wrong_path = share_source(coord, path, opts.source)  # wrong_path: raised by the planning step, everywhere
    meta, files = source.metadata, source.reader()  # HF sources: the directory of the files; URLs: RemoteFiles
    if opts.key_map is not None:
        meta = rename_keys(meta, opts.key_map)
        if meta.per_rank_values or meta.per_rank_tensors:
            meta = replace(meta, per_rank_values=_renamed(meta.per_rank_values, opts.key_map),
                           per_rank_tensors=_renamed(meta.per_rank_tensors, opts.key_map))
    if not source.verifiable:  # HF safetensors files carry no hyperdcp checksums
        opts = replace(opts, verify_checksums=False)
    try:
        def plan():
            if wrong_path is not None:
                raise wrong_path
            if not isinstance(state_dict, dict) and not hasattr(state_dict, "state_dict"):
                raise StateDictError(
                    f"load needs a dict (or an object with state_dict()) to load into, got {type(state_dict).__name__}"
                )
            leaves, finish = leaves_for_load(state_dict)
            targets = plan_targets(leaves, meta, coord, opts)
            unreadable = [k for k in targets.missing if k in getattr(source, "unreadable", {})]
            if unreadable:  # torch DCP entries hyperdcp does not decode (pickled objects, ...)
                k = unreadable[0]
                raise FormatError(f"{k!r} in {path!r} is {source.unreadable[k]}; drop it from the state dict (or pass "
                                  "strict=False to leave it untouched)"
                                  f"{f' ({len(unreadable) - 1} more)' if len(unreadable) > 1 else ''}")
            if targets.missing and opts.strict:
                raise MismatchError(
                    f"{len(targets.missing)} key(s) of the state dict are not in checkpoint {path!r}: "
                    f"{targets.missing[:10]}; pass strict=False to load the rest"
                )
            return targets, finish

        plan_what = f"planning the load of {path!r}"
        spread = opts.read_once and coord.world_size > 1
        if spread:  # a planning error travels with the read-once plan exchange
            targets = finish = plan_error = None
            try:
                targets, finish = plan()
            except Exception as e:  # noqa: BLE001 - raised on every rank by read_once
                plan_error = e
        else:
            targets, finish = run_checked(coord, plan_what, plan)

        def do_reads():
            if spread:
                read_once(files, meta, targets.pieces if targets else [], coord, opts,
                          list(targets.tensors.values()) if targets else None, plan_error, plan_what)
            else:
                reads = group_reads(meta, targets.pieces, opts.verify_checksums)
                execute_local_reads(files, meta, reads, opts)
            for st in targets.tensors.values():
                if st.finish is not None:
                    st.finish()
            # values are set only once every tensor arrived, so a failed load leaves them untouched
            for leaf, value in targets.values:
                leaf.set(value)
            finish(set(targets.missing))  # a missing key's meta tensor stays on meta, never uninitialized memory

        run_checked(coord, f"loading {path!r}", do_reads)
    finally:
        files.close()
    result = LoadResult(
        path=os.fspath(path),
        missing_keys=targets.missing,
        unused_keys=sorted(k for k in meta.keys() if k not in targets.used),
        bytes_read=files.bytes_read,
        seconds=time.perf_counter() - t0,
        metadata=meta,
        state=state_dict,
    )
    from ..logs import log_load

    log_load(result, targets.pieces, meta)
    return result
