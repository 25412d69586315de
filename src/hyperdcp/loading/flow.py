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
from dataclasses import dataclass, field, replace
from typing import Any

from .. import hf
from ..adapters.state_dict import leaves_for_load
from ..async_save.rank_files import has_rank_files
from ..coordination.base import Coordinator, broadcast_checked, run_checked
from ..errors import MismatchError, StateDictError
from ..format.metadata import METADATA_FILE, Metadata
from ..options import LoadOptions
from ..path_identity import DIGEST_BYTES, mismatch_with_source, path_digest
from ..planning.load_plan import group_reads
from ..storage.commit import read_metadata_bytes
from ..storage.remote import is_remote, local_path, open_files, read_remote_metadata_bytes, url_join
from .read_once import read_once
from .reads import execute_local_reads
from .targets import plan_targets


@dataclass
class LoadResult:
    """What :func:`hyperdcp.load` returns on every rank (the state dict is updated in place)."""

    path: str
    missing_keys: list[str] = field(default_factory=list)  # in the state dict, not in the checkpoint
    unused_keys: list[str] = field(default_factory=list)  # in the checkpoint, not asked for
    bytes_read: int = 0  # from storage, by this rank
    seconds: float = 0.0
    metadata: Metadata | None = None

    def __repr__(self) -> str:
        return (f"LoadResult(path={self.path!r}, bytes_read={self.bytes_read}, seconds={self.seconds:.3f}, "
                f"missing_keys={_short(self.missing_keys)}, unused_keys={_short(self.unused_keys)})")


def _short(keys: list[str], n: int = 3) -> str:
    """A key list for a repr: its first few keys and how many there are."""
    return f"[{', '.join(map(repr, keys[:n]))}{', ...' if len(keys) > n else ''}] ({len(keys)})"


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
    tag = coord.world_size > 1

    def shared(what: str, read) -> tuple[bytes, Exception | None]:
        raw = broadcast_checked(coord, what, (lambda: path_digest(path) + read()) if tag else read, 0)
        if not tag:
            return raw, None
        return raw[DIGEST_BYTES:], mismatch_with_source(path, raw[:DIGEST_BYTES], coord.rank, "load")

    if is_remote(path):
        raw, wrong = shared(f"reading the metadata of {path!r}", lambda: read_remote_metadata_bytes(path))
        return Metadata.from_json(raw, where=url_join(path, METADATA_FILE)), wrong
    path = local_path(path)  # file:// URLs
    if not has_rank_files(path) and hf.is_hf_source(path):  # no hyperdcp.json but safetensors files: HuggingFace
        raw, wrong = shared(f"reading the safetensors headers of {path!r}",
                            lambda: hf._encode_view(hf.read_hf_metadata(path)))
        return hf._decode_view(raw), wrong
    raw, wrong = shared(f"reading the metadata of {path!r}", lambda: read_metadata_bytes(path))
    return Metadata.from_json(raw, where=os.path.join(os.fspath(path), METADATA_FILE)), wrong



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
    meta, wrong_path = fetch_metadata_checked(coord, path)  # wrong_path: raised by the planning step, everywhere
    files = open_files(getattr(meta, "root", "") or path, meta)  # HF sources: the directory of the files; URLs: RemoteFiles
    if opts.key_map is not None:
        from ..hf import rename_keys

        meta = rename_keys(meta, opts.key_map)
        if meta.per_rank_values or meta.per_rank_tensors:
            meta = replace(meta, per_rank_values=_renamed(meta.per_rank_values, opts.key_map),
                           per_rank_tensors=_renamed(meta.per_rank_tensors, opts.key_map))
    if not getattr(meta, "has_checksums", True):  # HF safetensors files carry no hyperdcp checksums
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
            finish()

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
    )
    from ..logs import log_load

    log_load(result, targets.pieces, meta)
    return result
