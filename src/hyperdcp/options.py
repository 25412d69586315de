"""Options for save, load and async save, gathered in one object each (any field can also be passed as a
keyword). Defaults that come from the environment are read here, when an options object is made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

#: bytes per checksum block unless SaveOptions.checksum_block_bytes says otherwise (format/metadata reads it)
DEFAULT_BLOCK_BYTES = 4 << 20


@dataclass(frozen=True)
class SaveOptions:
    #: replace a complete checkpoint at the path (written aside, swapped in only once complete)
    overwrite: bool = False
    #: torch.distributed process group of the saving ranks (default: the world)
    process_group: Any = None
    #: seconds a rank waits for the others at each step before failing (None: the group's timeout)
    timeout: float | None = None
    #: bytes per checksum block (verification granularity of ranged reads)
    checksum_block_bytes: int = DEFAULT_BLOCK_BYTES
    #: data files per writing rank; more files are written by parallel threads
    files_per_rank: int = 1
    #: reuse global plans for saves of the same structure
    plan_cache: bool = True
    #: free-form JSON-serialisable metadata stored with the checkpoint
    user_metadata: dict = field(default_factory=dict)
    #: the object-store client's configuration for s3:// paths (s3fs keyword arguments: endpoint_url, key,
    #: secret, client_kwargs...; "client": "obstore" picks the other client); None: the client's own config
    storage_options: dict | None = None


@dataclass(frozen=True)
class LoadOptions:
    #: a key of the state dict absent from the checkpoint is an error (else reported)
    strict: bool = True
    #: verify per-block checksums of every byte read
    verify_checksums: bool = True
    #: convert stored dtypes to the state dict's dtypes (otherwise a dtype difference is an error)
    allow_cast: bool = False
    process_group: Any = None
    timeout: float | None = None
    #: threads issuing reads on each rank
    read_threads: int = 4
    #: read each stored byte once cluster-wide and send it to the ranks that need it (over the process
    #: group); False: every rank reads what it needs itself
    read_once: bool = True
    #: bound, per rank, on bytes read and packed (and on bytes received) per read-once batch; batches
    #: are usually far smaller (about 1/32 of a reader's share), and up to three are in flight at once
    read_once_batch_bytes: int = 256 << 20
    #: read-once: send a chunk that a whole mesh-dim group needs (replicas on other hosts) with one
    #: broadcast in that group (the DeviceMesh's own process group) instead of one message per replica
    read_once_broadcast: bool = True
    #: rename checkpoint keys before matching them to the state dict: ``key_map(name) -> new name``
    #: (None drops the key), e.g. to load HuggingFace names into a model with other names
    key_map: Callable[[str], str | None] | None = None
    #: entries stored per rank (values or plain tensors that differed between the saving ranks, keys only
    #: some ranks held), when loading on another number of ranks than saved them: None raises an error
    #: naming the key; ``"rank0"`` gives every rank the copy of the lowest saving rank; ``"drop"`` leaves
    #: them untouched (listed in ``unused_keys``); or ``fn(key, rank, world_size, saved_ranks)`` returning
    #: the saving rank whose copy ``rank`` gets (None: leave it untouched). With the same number of ranks
    #: every rank gets back its own copy (a key its rank did not save is missing), whatever this says
    per_rank: str | Callable[[str, int, int, tuple[int, ...]], int | None] | None = None
    #: read-once: ranks on the same host share the chunks they read through /dev/shm segments (False: every
    #: rank receives its own copy); default from ``HYPERDCP_READ_ONCE_SHM`` (``0``/``false``/``no``/``off``: False)
    shared_memory: bool = field(default_factory=lambda: _env_flag("HYPERDCP_READ_ONCE_SHM", True))
    #: read-once: what identifies this rank's host (ranks with the same id share /dev/shm); None: derived from
    #: the host name, boot id and /dev/shm device; default from ``HYPERDCP_HOST``
    host_id: str | None = field(default_factory=lambda: os.environ.get("HYPERDCP_HOST") or None)
    #: what kind of checkpoint ``path`` is: ``"auto"`` (hyperdcp or HuggingFace, detected; nothing is ever
    #: unpickled), or one kind by name: ``"hyperdcp"``, ``"huggingface"``, ``"torch-dcp"`` (opt-in: a
    #: torch.distributed.checkpoint directory, its ``.metadata`` read with a restricted unpickler)
    source: str = "auto"
    #: the object-store client's configuration for s3:// paths (see SaveOptions.storage_options)
    storage_options: dict | None = None


ASYNC_MODES = ("gloo", "file", "none")


@dataclass(frozen=True)
class AsyncSaveOptions:
    """How :func:`hyperdcp.async_save` runs a save (the save itself is described by :class:`SaveOptions`)."""

    #: how the persist processes exchange: ``"gloo"`` (their own CPU gloo group), ``"file"`` (files in a
    #: shared directory) or ``"none"`` (no cross-rank step; rank files merged at load or by ``finalize``)
    coordination: str = "gloo"
    #: a save while another is in flight on this rank waits for it (False: SaveInProgressError)
    wait: bool = True
    #: ``"file"`` mode: the shared directory of the exchanges (None: a hidden directory next to the checkpoint)
    exchange_dir: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        if self.coordination not in ASYNC_MODES:
            raise ValueError(f"coordination must be one of {ASYNC_MODES}, got {self.coordination!r}")


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


def resolve(cls, options, overrides: dict[str, Any]):
    """``options`` (or the defaults of ``cls``) with the keyword ``overrides`` applied; unknown names raise."""
    base = options if options is not None else cls()
    if not isinstance(base, cls):
        raise TypeError(f"options must be a {cls.__name__}, got {type(base).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; {cls.__name__} has {sorted(names)}")
    return replace(base, **overrides) if overrides else base
