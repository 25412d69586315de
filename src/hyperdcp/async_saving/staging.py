"""Staging for async saves: copy a rank's local shards into one shared-memory area, reused by structure.

The area is a file in ``/dev/shm`` (a tmpfs) mapped by the training process and, read-only, by the
persist process, so the writer reads the staged bytes without another copy. It is sized to exactly one
copy of the rank's local shards (each chunk 64-byte aligned) and kept while the structure (the local
plan: names, dtypes, shapes, boxes) is unchanged; a different structure frees it before allocating the
next one, so staging never holds more than one copy.

torch tensors take the framework's fast path (:mod:`hyperdcp.adapters.torch_staging`: cached
descriptions, one ``_foreach_copy_`` on warm calls, CUDA copies on side streams into the pinned area,
complete before :meth:`Stager.stage` returns). CPU tensors and numpy arrays are copied too, so mutating
them after return changes nothing.

Call order: ``Stager()`` once per session -> ``stage(state_dict, coord)`` per save (returns a
:class:`StagedCopy`) ... -> ``release()``.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from .. import adapters, shm
from ..adapters.state_dict import TENSOR, iter_leaves
from ..core.shards import ShardedTensor, check_shard_buffer
from ..errors import StateDictError, StorageError
from ..format import values as values_codec
from ..planning.save_plan import LocalPlan

ALIGN = 64


def shm_dir() -> str:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


def staging_dirs() -> list[str]:
    """Where staging areas may go, in order: ``HYPERDCP_STAGING_DIR`` if set, /dev/shm, the temp directory
    (disk-backed: slower, but a save still works where /dev/shm is small, e.g. Docker's 64 MB default)."""
    out = []
    for d in (os.environ.get("HYPERDCP_STAGING_DIR"), shm_dir(), tempfile.gettempdir()):
        if d and os.path.isdir(d) and os.access(d, os.W_OK) and os.path.realpath(d) not in map(os.path.realpath, out):
            out.append(d)
    return out


def remove_stale_areas(directory: str) -> int:
    """Unlink staging files (and read-once segments) left by processes that no longer exist (e.g. a rank
    killed with SIGKILL before its persist process mapped the area); they would otherwise hold RAM in
    /dev/shm forever. See :mod:`hyperdcp.shm` for how an orphan is recognised."""
    return shm.reclaim(directory)


class ShmArea:
    """A named shared-memory file of ``nbytes`` bytes, mapped read-write (the owner) or read-only.

    The owner reserves every page up front (``posix_fallocate``): a tmpfs without room fails with a
    :class:`StorageError` here and the next staging directory is tried, instead of a SIGBUS on first touch.
    """

    def __init__(self, nbytes: int, path: str | None = None, readonly: bool = False):
        self.nbytes = max(int(nbytes), 1)
        self.owner = path is None
        flags = os.O_RDONLY if readonly else os.O_RDWR
        if self.owner:
            fd, self.path = self._create()
        else:
            self.path = path
            try:
                fd = os.open(self.path, flags)
            except OSError as e:
                raise StorageError(f"cannot open the async-save staging area {self.path!r}: {e.strerror or e}") from e
        try:
            self.mm = mmap.mmap(fd, self.nbytes, access=mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE)
        except (OSError, ValueError) as e:
            if self.owner:
                self.unlink()
            raise StorageError(f"cannot map the async-save staging area {self.path!r} ({self.nbytes} bytes): "
                               f"{e}") from e
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        #: called by close() before unmapping (the stager's framework views, e.g. a pinned torch view)
        self.before_close = None

    def _create(self) -> tuple[int, str]:
        tried = []
        for d in staging_dirs():
            shm.reclaim(d)
            free = shm.free_bytes(d)
            if free and free < self.nbytes:
                tried.append(f"{d}: {free} bytes free")
                continue
            path = os.path.join(d, shm.new_name("stage"))
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            except OSError as e:
                tried.append(f"{d}: {e.strerror or e}")
                continue
            try:
                os.ftruncate(fd, self.nbytes)
                shm.reserve(fd, self.nbytes)
            except OSError as e:
                os.close(fd)
                try:
                    os.unlink(path)
                except OSError:
                    pass
                tried.append(f"{d}: {e.strerror or e}")
                continue
            if d != shm_dir() and not os.environ.get("HYPERDCP_STAGING_DIR"):
                warnings.warn(f"hyperdcp: /dev/shm cannot hold this rank's {self.nbytes}-byte async-save staging area "
                              f"({'; '.join(tried)}); staging in {d} (disk-backed, slower). Enlarge /dev/shm (docker "
                              "--shm-size) or set HYPERDCP_STAGING_DIR", RuntimeWarning, stacklevel=4)
            return fd, path
        raise StorageError(
            f"cannot create the async-save staging area ({self.nbytes} bytes, one copy of this rank's local shards): "
            f"{'; '.join(tried) or 'no writable directory'}; enlarge /dev/shm (docker --shm-size), point "
            "HYPERDCP_STAGING_DIR at a directory with room, or use hyperdcp.save"
        )

    unlinked = False

    def unlink(self) -> None:
        """Remove the name; the mappings stay valid until closed."""
        if self.owner and not self.unlinked:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.unlinked = True

    def close(self) -> None:
        hook, self.before_close = self.before_close, None
        if hook is not None:
            hook(self)
        self.array = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        self.unlink()


@dataclass
class Layout:
    """Where each chunk of one structure lives in the area."""

    key: bytes
    plan: LocalPlan
    offsets: np.ndarray  # (n,) int64 byte offset of each chunk
    sizes: np.ndarray  # (n,) int64
    total: int
    writers: dict[int, np.ndarray] = field(default_factory=dict)  # per world size: chunks this rank writes alone
    dst_np: list = field(default_factory=list)
    dst_torch: list = field(default_factory=list)  # the framework's views of the same destinations
    plan_bytes: bytes = b""  # plan.to_bytes(), computed once per structure


@dataclass
class StagedCopy:
    """What one staging produced: everything the persist process needs, as plain data."""

    layout: Layout
    area: ShmArea
    values: dict[str, Any]  # encoded (JSON-ready) plain values
    replicas: list[tuple[int, ...] | None]
    seconds: float
    first: bool


class Stager:
    """Per-process staging state: the shared-memory area and the layout of the last structure."""

    def __init__(self) -> None:
        self.area: ShmArea | None = None
        self.layout: Layout | None = None
        self._built: tuple | None = None
        self._fw = None  # the framework's fast staging (adapters.stager()), once its framework is loaded
        #: called before a different structure replaces the area (the session makes the persist process unmap it)
        self.before_new_area = None

    @property
    def _fast(self):
        """The warm path of the last structure, if the framework's staging built one (tests and diagnostics)."""
        return None if self._fw is None else self._fw.fast

    def _framework(self):
        if self._fw is None:
            self._fw = adapters.stager()
        return self._fw

    def describe(self, state_dict: Any, ctx) -> tuple[list[ShardedTensor], dict[int, Any], dict[str, Any]]:
        if not isinstance(state_dict, dict) and not hasattr(state_dict, "state_dict"):
            raise StateDictError("the state dict must be a dict (or an object with state_dict()), got "
                                 f"{type(state_dict).__name__}")
        tensors, sources, vals = [], {}, {}
        fw = self._framework()
        for fqn, kind, v in iter_leaves(state_dict):
            if kind != TENSOR:
                vals[fqn] = values_codec.encode(v, fqn)
                continue
            if fw is not None and fw.takes(v):
                st, src = fw.leaf(fqn, v, ctx)
                for sh in st.shards:
                    sources[id(sh)] = src
            else:
                st = adapters.to_sharded(fqn, v, ctx, for_load=False)
                for sh in st.shards:
                    check_shard_buffer(fqn, sh, st.dtype)
                    sources[id(sh)] = sh.data
            tensors.append(st)
        return tensors, sources, vals

    # -- the area ------------------------------------------------------------------------
    def _layout_for(self, plan: LocalPlan, chunks) -> tuple[Layout, bool]:
        plan_bytes = plan.to_bytes()
        key = xxhash.xxh3_128(plan_bytes).digest()
        if self.layout is not None and self.layout.key == key and self.area is not None:
            return self.layout, False
        if self.area is not None and self.before_new_area is not None:
            self.before_new_area()  # the persist process unmaps the old area first
        self.release()  # never two areas at once: staging memory stays bounded by one copy
        sizes = np.array([sh.data.size for _, sh in chunks], dtype=np.int64)
        padded = (sizes + ALIGN - 1) // ALIGN * ALIGN
        offsets = (np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64) if len(sizes)
                   else np.zeros(0, np.int64))
        total = int(padded.sum())
        self.area = ShmArea(total)
        if self._fw is not None:
            self.area.before_close = self._fw.forget
        lay = Layout(key, plan, offsets, sizes, total, plan_bytes=plan_bytes)
        arr = self.area.array
        lay.dst_np = [arr[o : o + n] for o, n in zip(offsets.tolist(), sizes.tolist())]
        self.layout = lay
        return lay, True

    def stage(self, state_dict: Any, ctx) -> StagedCopy:
        """Copy every local shard of ``state_dict`` into the area; return when the copy is complete."""
        t0 = time.perf_counter()
        fw = self._framework()
        if fw is not None and self.area is not None and self.layout is not None:
            got = fw.stage_fast(state_dict, ctx, self.layout)
            if got is not None:
                return StagedCopy(self.layout, self.area, got, fw.fast.replicas, time.perf_counter() - t0, False)
            fw.fast = None
        tensors, sources, vals = self.describe(state_dict, ctx)
        ident = (tuple(map(id, tensors)), tuple(vals))
        if self._built is not None and self._built[0] == ident:
            plan, chunks = self._built[1], self._built[2]  # same cached descriptions: same plan
        else:
            plan, chunks = LocalPlan.build(tensors, list(vals))
            self._built = (ident, plan, chunks)
        lay, first = self._layout_for(plan, chunks)
        srcs = [sources[id(sh)] for _, sh in chunks]
        replicas = [sh.replica_ranks for _, sh in chunks]
        if fw is not None and fw.holds_any(srcs):
            if not fw.copy(srcs, lay, chunks, self.area):  # no device copies: the warm path applies next time
                fw.remember(state_dict, tensors, vals, chunks, srcs, lay, replicas)
        else:
            for d, s in zip(lay.dst_np, srcs):
                np.copyto(d, s)
        return StagedCopy(lay, self.area, vals, replicas, time.perf_counter() - t0, first)

    def release(self) -> None:
        if self.area is not None:
            self.area.close()
        self.area = None
        self.layout = None


def writers_alone(lay: Layout, replicas: list, rank: int, world_size: int) -> np.ndarray:
    """For the no-collectives mode: the local chunks this rank writes, decided without communication.

    A chunk held by several ranks (``replica_ranks``) is written by one holder picked by a hash of the
    tensor name and box, so every holder makes the same choice and writes spread over the holders.
    Chunks with unknown holders are written by this rank.
    """
    hit = lay.writers.get(world_size)
    if hit is not None:
        return hit
    plan = lay.plan
    mine = []
    for i, reps in enumerate(replicas):
        if not reps or rank not in reps or len(reps) == 1:
            mine.append(i)
            continue
        spec = plan.tensors[int(plan.tidx[i])]
        nd = len(spec.shape)
        h = xxhash.xxh3_64_intdigest(spec.fqn.encode() + plan.offsets[i, :nd].astype("<i8").tobytes())
        if reps[h % len(reps)] == rank:
            mine.append(i)
    out = np.array(mine, dtype=np.int64)
    lay.writers[world_size] = out
    return out
