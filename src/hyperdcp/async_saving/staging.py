"""Staging for async saves: copy a rank's local shards into one shared-memory area, reused by structure.

The area is a file in ``/dev/shm`` (a tmpfs) mapped by the training process and, read-only, by the
persist process, so the writer reads the staged bytes without another copy. It is sized to exactly one
copy of the rank's local shards (each chunk 64-byte aligned) and kept while the structure (the local
plan: names, dtypes, shapes, boxes) is unchanged; a different structure frees it before allocating the
next one, so staging never holds more than one copy.

CUDA tensors are copied into the area after registering it as pinned memory (``cudaHostRegister``),
on a side stream that first waits for the current (producer) stream; the side stream is synchronized
before :meth:`Stager.stage` returns, so the copy is complete and the next optimizer step cannot race
with it. CPU tensors and numpy arrays are copied too, so mutating them after return changes nothing.
"""

from __future__ import annotations

import mmap
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from .. import adapters, shm
from ..adapters import is_tensor_like
from ..adapters.state_dict import TENSOR, _join, iter_leaves
from ..core.boxes import full_box
from ..core.shards import LocalShard, ShardedTensor, check_shard_buffer
from ..errors import StateDictError, StorageError
from ..format import values as values_codec
from ..planning.save_plan import LocalPlan

ALIGN = 64
_ONE = np.zeros(1, np.uint8)


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
            raise StorageError(f"cannot map the async-save staging area {self.path!r} ({self.nbytes} bytes): {e}") from e
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self._torch = None
        self._cuda_registered = False

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

    def torch_view(self):
        """The area as a flat uint8 torch tensor (shares memory)."""
        if self._torch is None:
            import torch

            self._torch = torch.from_numpy(self.array)
        return self._torch

    def pin_for_cuda(self) -> bool:
        """Register the area as page-locked memory for fast, truly asynchronous device-to-host copies."""
        if self._cuda_registered:
            return True
        import torch

        try:
            rc = torch.cuda.cudart().cudaHostRegister(self.torch_view().data_ptr(), self.nbytes, 0)
            self._cuda_registered = int(getattr(rc, "value", rc)) == 0
        except Exception:  # noqa: BLE001 - pageable memory still works, only slower
            self._cuda_registered = False
        return self._cuda_registered

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
        if self._cuda_registered:
            try:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self._torch.data_ptr())
            except Exception:  # noqa: BLE001
                pass
            self._cuda_registered = False
        self._torch = None
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
    dst_torch: list = field(default_factory=list)
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
        self._boxes: dict[tuple, ShardedTensor] = {}
        self._built: tuple | None = None
        self._tad = None
        self._fast: _Fast | None = None
        #: called before a different structure replaces the area (the session makes the persist process unmap it)
        self.before_new_area = None

    # -- describing the state dict ---------------------------------------------------------
    def _torch_leaf(self, fqn: str, value, ctx) -> tuple[ShardedTensor, Any]:
        """The (cached) description of a torch leaf and its local tensor; no bytes are touched here."""
        tad = self._tad
        if tad is None:
            from ..adapters import torch as tad

            self._tad = tad
        tad.check_dense(fqn, value, False)  # sparse, nested: a clear error naming the key
        if isinstance(value, tad.DTensor):
            local = value._local_tensor  # what to_local() returns, without the autograd wrapper
            key = (fqn, tuple(value.shape), value.dtype, tuple(value.placements), id(value.device_mesh))
        else:
            local = value
            key = (fqn, tuple(value.shape), value.dtype, None, ctx.world_size)
        st = self._boxes.get(key)
        if st is None:
            if isinstance(value, tad.DTensor):
                box, reps = tad.dtensor_box(fqn, value), tad.replica_ranks(value, ctx)
            else:
                box, reps = full_box(value.shape), tuple(range(ctx.world_size))
            code = tad.dtype_code(fqn, value.dtype)
            n = box.numel * tad.TORCH_DTYPE[code].itemsize
            sh = LocalShard(box, np.broadcast_to(_ONE, (n,)), reps)  # placeholder buffer
            shape = tuple(int(x) for x in value.shape)
            st = ShardedTensor(fqn, code, shape, [sh] if box.numel else [])
            if len(self._boxes) > 1 << 16:
                self._boxes.clear()
            self._boxes[key] = st
        if st.shards and tuple(local.shape) != st.shards[0].box.lengths:
            raise StateDictError(f"{fqn!r}: local shard shape {tuple(local.shape)} does not match its placement box "
                                 f"{st.shards[0].box}")
        return st, local

    def describe(self, state_dict: Any, ctx) -> tuple[list[ShardedTensor], dict[int, Any], dict[str, Any]]:
        if not isinstance(state_dict, dict) and not hasattr(state_dict, "state_dict"):
            raise StateDictError(f"the state dict must be a dict (or an object with state_dict()), got {type(state_dict).__name__}")
        tensors, sources, vals = [], {}, {}
        torch_mod = sys.modules.get("torch")
        for fqn, kind, v in iter_leaves(state_dict):
            if kind != TENSOR:
                vals[fqn] = values_codec.encode(v, fqn)
                continue
            if torch_mod is not None and isinstance(v, torch_mod.Tensor) and _single_box(v):
                st, src = self._torch_leaf(fqn, v, ctx)
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
        offsets = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64) if len(sizes) else np.zeros(0, np.int64)
        total = int(padded.sum())
        self.area = ShmArea(total)
        lay = Layout(key, plan, offsets, sizes, total, plan_bytes=plan_bytes)
        arr = self.area.array
        lay.dst_np = [arr[o : o + n] for o, n in zip(offsets.tolist(), sizes.tolist())]
        self.layout = lay
        return lay, True

    def _torch_dsts(self, lay: Layout, chunks) -> list:
        if not lay.dst_torch:
            from ..adapters.torch import TORCH_DTYPE

            flat = self.area.torch_view()
            out = []
            for (st, sh), o, n in zip(chunks, lay.offsets.tolist(), lay.sizes.tolist()):
                out.append(flat[o : o + n].view(TORCH_DTYPE[st.dtype]).view(sh.box.lengths))
            lay.dst_torch = out
        return lay.dst_torch

    def stage(self, state_dict: Any, ctx) -> StagedCopy:
        """Copy every local shard of ``state_dict`` into the area; return when the copy is complete."""
        t0 = time.perf_counter()
        fast = self._fast
        if fast is not None and fast.layout is self.layout and self.area is not None:
            got = self._stage_fast(fast, state_dict, ctx)
            if got is not None:
                return StagedCopy(fast.layout, self.area, got, fast.replicas, time.perf_counter() - t0, False)
        self._fast = None
        tensors, sources, vals = self.describe(state_dict, ctx)
        ident = (tuple(map(id, tensors)), tuple(vals))
        if self._built is not None and self._built[0] == ident:
            plan, chunks = self._built[1], self._built[2]  # same cached descriptions: same plan
        else:
            plan, chunks = LocalPlan.build(tensors, list(vals))
            self._built = (ident, plan, chunks)
        lay, first = self._layout_for(plan, chunks)
        srcs = [sources[id(sh)] for _, sh in chunks]
        torch_mod = sys.modules.get("torch")
        cuda = []
        if torch_mod is not None and any(isinstance(s, torch_mod.Tensor) for s in srcs):
            dst_t = self._torch_dsts(lay, chunks)
            grad_mode = torch_mod.is_grad_enabled()
            torch_mod.set_grad_enabled(False)  # copies of parameters must not join any autograd graph
            try:
                self._copy_all(torch_mod, srcs, dst_t, lay, cuda)
            finally:
                torch_mod.set_grad_enabled(grad_mode)
            if cuda:
                self._copy_from_devices(torch_mod, [srcs[i] for i in cuda], [dst_t[i] for i in cuda])
        else:
            for d, s in zip(lay.dst_np, srcs):
                np.copyto(d, s)
        replicas = [sh.replica_ranks for _, sh in chunks]
        if torch_mod is not None and not cuda:
            self._fast = _Fast.build(state_dict, tensors, vals, chunks, srcs, lay, replicas, torch_mod)
        return StagedCopy(lay, self.area, vals, replicas, time.perf_counter() - t0, first)

    # -- the warm path -------------------------------------------------------------------
    def _stage_fast(self, fast: "_Fast", state_dict: Any, ctx) -> dict | None:
        """Stage a state dict of the last staged structure; None if anything differs (the full path decides).

        Per structure, the walk (the dict keys at every level), each tensor leaf's description and the
        destination views are cached; per call this checks that every dict has the same keys, that every
        tensor leaf is the same tensor object with the same local tensor, shape, dtype and (DTensor)
        placement spec on the CPU, re-encodes the plain values, and copies all tensors with one
        ``torch._foreach_copy_``. Any difference falls back to the full path, which re-describes the
        state dict (so structure changes are detected exactly as on a first call).
        """
        if type(state_dict) is not dict:
            return None
        leaves: list = []
        try:
            _collect(state_dict, fast.skeleton, leaves)
        except _Miss:
            return None
        now = [None] * len(fast.tensor_leaves)
        torch_mod = fast.torch
        for j, (i, typ, shp, dt, spec) in enumerate(fast.tensor_leaves):
            v = leaves[i]
            if type(v) is not typ:
                return None
            if spec is None:
                cur = v  # a plain tensor's description is its shape and dtype, checked below
            elif v._spec is spec:  # the same placement spec object: same mesh, placements, global shape
                cur = v._local_tensor
            else:  # e.g. a new DTensor from model.state_dict(): the same cached description, or the full path
                try:
                    st, cur = self._torch_leaf(fast.fqns[j], v, ctx)
                except StateDictError:
                    return None
                if st is not fast.sts[j]:
                    return None
            if cur.dtype is not dt or cur.shape != shp or not cur.is_cpu or cur.layout is not torch_mod.strided:
                return None
            now[j] = cur
        vals = {}
        for i, fqn in fast.value_leaves:
            v = leaves[i]
            if type(v) in fast.container_types or is_tensor_like(v):
                return None
            try:
                vals[fqn] = values_codec.encode(v, fqn)
            except StateDictError:
                return None
        srcs = [now[j] for j in fast.chunk_src]
        grad_mode = torch_mod.is_grad_enabled()
        torch_mod.set_grad_enabled(False)
        try:
            if srcs:
                torch_mod._foreach_copy_(fast.dsts, srcs)  # one call; same result as copy_ per tensor
        finally:
            torch_mod.set_grad_enabled(grad_mode)
        return vals

    @staticmethod
    def _copy_all(torch_mod, srcs: list, dst_t: list, lay: Layout, cuda: list) -> None:
        tensor = torch_mod.Tensor
        for i, s in enumerate(srcs):
            if isinstance(s, tensor):
                if s.device.type == "cpu":
                    dst_t[i].copy_(s)
                else:
                    cuda.append(i)  # copied on a side stream afterwards
            else:
                np.copyto(lay.dst_np[i], s)

    def _copy_from_devices(self, torch, srcs: list, dsts: list) -> None:
        """Device-to-host copies on a side stream per device, ordered after the producer stream."""
        pinned = self.area.pin_for_cuda()
        by_dev: dict = {}
        for s, d in zip(srcs, dsts):
            by_dev.setdefault(s.device, []).append((s, d))
        streams = []
        for dev, pairs in by_dev.items():
            if dev.type != "cuda":
                for s, d in pairs:
                    d.copy_(s)
                continue
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))  # the producer's writes come first
            with torch.cuda.stream(side):
                for s, d in pairs:
                    d.copy_(s, non_blocking=pinned)
            streams.append(side)
        for side in streams:
            side.synchronize()  # complete before returning: no race with the next optimizer step

    def release(self) -> None:
        if self.area is not None:
            self.area.close()
        self.area = None
        self.layout = None


class _Miss(Exception):
    pass


def _collect(d: dict, node: tuple, out: list) -> None:
    """Append the leaves of ``d`` in walk order, following a cached skeleton; raise _Miss if the keys differ."""
    keys, kids = node
    if type(d) is not dict or len(d) != len(keys) or tuple(d) != keys:
        raise _Miss
    if kids is None:
        out.extend(d.values())
        return
    for v, kid in zip(d.values(), kids):
        if kid is None:
            out.append(v)
        else:
            _collect(v, kid, out)


def _skeleton(d: dict, prefix: str, torch_mod, fqns: list, leaves: list) -> tuple:
    """The key skeleton of a tree of plain dicts whose leaves are torch tensors or plain values, else _Miss."""
    keys, kids = tuple(d), []
    for k, v in d.items():
        fqn = _join(prefix, k)
        if isinstance(v, torch_mod.Tensor):
            kids.append(None)
            fqns.append(fqn)
            leaves.append((fqn, TENSOR))
        elif values_codec.is_plain(v):
            kids.append(None)
            fqns.append(fqn)
            leaves.append((fqn, "value"))
        elif type(v) is dict:
            n0 = len(leaves)
            kid = _skeleton(v, fqn, torch_mod, fqns, leaves)
            if not any(kind == TENSOR for _, kind in leaves[n0:]):
                raise _Miss  # a container of values only: keep to the full walk's rules
            kids.append(kid)
        else:
            raise _Miss  # numpy arrays, lists/tuples of tensors, stateful objects: the full path
    return keys, (None if all(k is None for k in kids) else kids)


def _single_box(v) -> bool:
    """Whether a torch leaf is one box that is its whole local tensor (else the generic adapter path
    describes it: strided shards in several runs, LocalShardsWrapper, legacy ShardedTensor)."""
    from ..adapters.torch import single_box

    return single_box(v)


@dataclass
class _Fast:
    """What the warm path of one structure needs (see :meth:`Stager._stage_fast`)."""

    layout: Layout
    skeleton: tuple
    tensor_leaves: list  # (leaf index, type, local shape, dtype, DTensor spec or None); no tensor is kept alive
    fqns: list  # per tensor leaf
    sts: list  # per tensor leaf: the cached ShardedTensor description
    value_leaves: list  # (leaf index, fqn)
    chunk_src: list  # per chunk: its tensor leaf
    dsts: list
    replicas: list
    torch: Any
    tensor_type: Any
    container_types: tuple = (dict, list, tuple)

    @classmethod
    def build(cls, state_dict, tensors, vals, chunks, srcs, lay, replicas, torch_mod) -> "_Fast | None":
        if type(state_dict) is not dict or not lay.dst_torch:
            return None
        fqns_all: list = []
        leaves: list = []
        try:
            skel = _skeleton(state_dict, "", torch_mod, fqns_all, leaves)
        except (_Miss, StateDictError):
            return None
        t_fqns = [f for f, kind in leaves if kind == TENSOR]
        if t_fqns != [st.fqn for st in tensors] or [f for f, kind in leaves if kind != TENSOR] != list(vals):
            return None  # not the walk the full path did
        flat: list = []
        _collect(state_dict, skel, flat)
        DT = getattr(getattr(torch_mod, "distributed", None), "tensor", None)
        DT = getattr(DT, "DTensor", None) if DT is not None else None
        index = {id(st): j for j, st in enumerate(tensors)}
        chunk_src = []
        for (st, _), s in zip(chunks, srcs):
            j = index.get(id(st))
            if j is None or not isinstance(s, torch_mod.Tensor) or not s.is_cpu:
                return None
            chunk_src.append(j)
        t_leaves, vleaves = [], []
        for i, (fqn, kind) in enumerate(leaves):
            v = flat[i]
            if kind != TENSOR:
                vleaves.append((i, fqn))
                continue
            is_dt = DT is not None and isinstance(v, DT)
            loc = v._local_tensor if is_dt else v
            if loc.layout is not torch_mod.strided or not loc.is_cpu:
                return None
            t_leaves.append((i, type(v), loc.shape, loc.dtype, v._spec if is_dt else None))
        return cls(lay, skel, t_leaves, t_fqns, list(tensors), vleaves, chunk_src, list(lay.dst_torch),
                   replicas, torch_mod, torch_mod.Tensor)


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
