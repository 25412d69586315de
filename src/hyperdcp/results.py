"""What the public calls return: :class:`LoadResult` (load), :class:`VerifyReport` (verify_checkpoint),
:class:`ConvertResult` (the conversions), :class:`SaveResult` (save, and async_save's future)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .format.metadata import Metadata
from .storage.commit import load_metadata
from .storage.urls import is_object_store


@dataclass
class SaveResult:
    """What :func:`hyperdcp.save` returns on every rank."""

    path: str
    rank: int
    world_size: int
    bytes_written: int  # by this rank
    files_written: list[str]
    plan_cache_hit: bool
    seconds: float
    _metadata: Metadata | None = field(default=None, repr=False)

    @property
    def metadata(self) -> Metadata:
        """The committed metadata (read from disk on ranks other than 0)."""
        if self._metadata is None:
            if is_object_store(self.path):
                from .storage.object_listing import read_record

                self._metadata = read_record(self.path)
            else:
                self._metadata = load_metadata(self.path)
        return self._metadata

    def __repr__(self) -> str:
        return (f"SaveResult(path={self.path!r}, rank={self.rank}, world_size={self.world_size}, "
                f"bytes_written={self.bytes_written}, files_written={len(self.files_written)}, "
                f"plan_cache_hit={self.plan_cache_hit}, seconds={self.seconds:.3f})")


@dataclass
class LoadResult:
    """What :func:`hyperdcp.load` returns on every rank (the state dict is updated in place)."""

    path: str
    missing_keys: list[str] = field(default_factory=list)  # in the state dict, not in the checkpoint
    unused_keys: list[str] = field(default_factory=list)  # in the checkpoint, not asked for
    bytes_read: int = 0  # from storage, by this rank
    seconds: float = 0.0
    metadata: Metadata | None = None
    #: the loaded state: the state dict itself (torch, numpy: filled in place), or a new pytree (JAX)
    state: Any = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (f"LoadResult(path={self.path!r}, bytes_read={self.bytes_read}, seconds={self.seconds:.3f}, "
                f"missing_keys={_short(self.missing_keys)}, unused_keys={_short(self.unused_keys)})")


def _short(keys: list[str], n: int = 3) -> str:
    """A key list for a repr: its first few keys and how many there are."""
    return f"[{', '.join(map(repr, keys[:n]))}{', ...' if len(keys) > n else ''}] ({len(keys)})"


@dataclass
class BadChunk:
    """One chunk whose bytes do not match its checksums (or could not be read)."""

    file: str
    tensor: str
    box: str
    block: int  # first bad checksum block in the chunk, -1 when the chunk could not be read
    byte_offset: int  # absolute offset in the file of that block
    reason: str

    def __str__(self) -> str:
        where = f"block {self.block} at byte {self.byte_offset}" if self.block >= 0 else "unreadable"
        return f"{self.file}: tensor {self.tensor!r} chunk {self.box}: {where}: {self.reason}"


@dataclass
class VerifyReport:
    """What :func:`hyperdcp.verify_checkpoint` found; ``ok`` when nothing is wrong.

    ``checksums`` is False for sources that carry no block checksums (HuggingFace safetensors): their
    files' presence, type, size and headers were checked, not their bytes (``bytes_checked`` is 0).
    """

    path: str
    files: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    bad_chunks: list[BadChunk] = field(default_factory=list)
    file_errors: list[str] = field(default_factory=list)  # metadata or whole-file problems
    kind: str = "hyperdcp"  # the source kind (hyperdcp.sources)
    checksums: bool = True  # block checksums were checked

    @property
    def ok(self) -> bool:
        return not self.bad_chunks and not self.file_errors

    @property
    def gb_per_s(self) -> float:
        return self.bytes_checked / 1e9 / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ConvertResult:
    """What a conversion (:func:`hyperdcp.tools.convert.hf_to_hyperdcp`, ``hyperdcp_to_hf``) did."""

    src: str
    dst: str
    tensors: int
    tensor_bytes: int
    files: list[str]
    seconds: float
    skipped_values: list[str] = field(default_factory=list)
    tensor_names: list[str] = field(default_factory=list, repr=False)

    @property
    def gb_per_s(self) -> float:
        return self.tensor_bytes / 1e9 / max(self.seconds, 1e-9)

