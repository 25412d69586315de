"""torch's fast path for async staging: cached DTensor descriptions, one ``_foreach_copy_`` on warm calls, and
CUDA copies on side streams into pinned shared memory. Used by :class:`hyperdcp.async_saving.staging.Stager`.

Call order (per :meth:`Stager.stage`): ``stage_fast(state_dict, ctx, layout)`` (warm: same structure as last
time; None means "take the full path") -> else ``leaf(fqn, value, ctx)`` per torch leaf while describing ->
``copy(srcs, layout, area)`` -> ``remember(...)`` (builds the warm path) ... ``forget(area)`` before the
area is unmapped.

CUDA tensors are copied into the area after registering it as pinned memory (``cudaHostRegister``), on
a side stream that first waits for the current (producer) stream; the side stream is synchronized
before :meth:`TorchStaging.copy` returns, so the copy is complete and the next optimizer step cannot
race with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.boxes import full_box
from ..core.shards import LocalShard, ShardedTensor
from ..errors import StateDictError
from ..format import values as values_codec
from . import is_tensor_like
from . import torch as tad
from .state_dict import TENSOR, _join

_ONE = np.zeros(1, np.uint8)


class TorchStaging:
    """The torch state of one stager: leaf descriptions by structure, the warm path, the area's torch view."""

    def __init__(self) -> None:
        self._boxes: dict[tuple, ShardedTensor] = {}
        self.fast: _Fast | None = None
        self._flat: tuple[Any, torch.Tensor] | None = None  # (area, its flat uint8 tensor)
        self._pinned: Any = None  # the area registered with cudaHostRegister

    @staticmethod
    def takes(value: Any) -> bool:
        """Whether this fast path describes ``value``: a torch tensor that is one box, its whole local tensor
        (else the generic adapter path: strided shards in several runs, LocalShardsWrapper, legacy ShardedTensor)."""
        return isinstance(value, torch.Tensor) and tad.single_box(value)

    @staticmethod
    def holds_any(srcs: list) -> bool:
        """Whether any staging source is a torch tensor (else plain numpy copies do)."""
        return any(isinstance(s, torch.Tensor) for s in srcs)

    def leaf(self, fqn: str, value, ctx) -> tuple[ShardedTensor, Any]:
        """The (cached) description of a torch leaf and its local tensor; no bytes are touched here."""
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

    # -- the area ------------------------------------------------------------------------
    def _flat_view(self, area) -> torch.Tensor:
        """The area as a flat uint8 torch tensor (shares memory)."""
        if self._flat is None or self._flat[0] is not area:
            self._flat = (area, torch.from_numpy(area.array))
        return self._flat[1]

    def _dsts(self, lay, chunks, area) -> list:
        if not lay.dst_torch:
            flat = self._flat_view(area)
            out = []
            for (st, sh), o, n in zip(chunks, lay.offsets.tolist(), lay.sizes.tolist()):
                out.append(flat[o : o + n].view(tad.TORCH_DTYPE[st.dtype]).view(sh.box.lengths))
            lay.dst_torch = out
        return lay.dst_torch

    def _pin(self, area) -> bool:
        """Register the area as page-locked memory for fast, truly asynchronous device-to-host copies."""
        if self._pinned is area:
            return True
        self.forget(self._pinned)
        try:
            rc = torch.cuda.cudart().cudaHostRegister(self._flat_view(area).data_ptr(), area.nbytes, 0)
            ok = int(getattr(rc, "value", rc)) == 0
        except Exception:  # noqa: BLE001 - pageable memory still works, only slower
            ok = False
        self._pinned = area if ok else None
        return ok

    def forget(self, area) -> None:
        """Drop every torch view of ``area`` (and unpin it) before it is unmapped."""
        if area is None:
            return
        if self._pinned is area:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._flat_view(area).data_ptr())
            except Exception:  # noqa: BLE001
                pass
            self._pinned = None
        if self._flat is not None and self._flat[0] is area:
            self._flat = None
        self.fast = None  # its destination views are views of this area

    # -- copies --------------------------------------------------------------------------
    def copy(self, srcs: list, lay, chunks, area) -> bool:
        """Copy ``srcs`` (torch tensors or numpy arrays) into the area; True if some came from a device."""
        dst_t = self._dsts(lay, chunks, area)
        cuda: list[int] = []
        grad_mode = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # copies of parameters must not join any autograd graph
        try:
            for i, s in enumerate(srcs):
                if isinstance(s, torch.Tensor):
                    if s.device.type == "cpu":
                        dst_t[i].copy_(s)
                    else:
                        cuda.append(i)  # copied on a side stream afterwards
                else:
                    np.copyto(lay.dst_np[i], s)
        finally:
            torch.set_grad_enabled(grad_mode)
        if cuda:
            self._copy_from_devices(area, [srcs[i] for i in cuda], [dst_t[i] for i in cuda])
        return bool(cuda)

    def _copy_from_devices(self, area, srcs: list, dsts: list) -> None:
        """Device-to-host copies on a side stream per device, ordered after the producer stream."""
        pinned = self._pin(area)
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

    # -- the warm path -------------------------------------------------------------------
    def remember(self, state_dict, tensors, vals, chunks, srcs, lay, replicas) -> None:
        """After a full CPU staging: build the warm path of this structure (or none if it does not apply)."""
        self.fast = _Fast.build(state_dict, tensors, vals, chunks, srcs, lay, replicas)

    def stage_fast(self, state_dict: Any, ctx, lay) -> dict | None:
        """Stage a state dict of the last staged structure; None if anything differs (the full path decides).

        Per structure, the walk (the dict keys at every level), each tensor leaf's description and the
        destination views are cached; per call this checks that every dict has the same keys, that every
        tensor leaf is the same tensor object with the same local tensor, shape, dtype and (DTensor)
        placement spec on the CPU, re-encodes the plain values, and copies all tensors with one
        ``torch._foreach_copy_``. Any difference falls back to the full path, which re-describes the
        state dict (so structure changes are detected exactly as on a first call).
        """
        fast = self.fast
        if fast is None or fast.layout is not lay or type(state_dict) is not dict:
            return None
        leaves: list = []
        try:
            _collect(state_dict, fast.skeleton, leaves)
        except _Miss:
            return None
        now = [None] * len(fast.tensor_leaves)
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
                    st, cur = self.leaf(fast.fqns[j], v, ctx)
                except StateDictError:
                    return None
                if st is not fast.sts[j]:
                    return None
            if cur.dtype is not dt or cur.shape != shp or not cur.is_cpu or cur.layout is not torch.strided:
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
        grad_mode = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        try:
            if srcs:
                torch._foreach_copy_(fast.dsts, srcs)  # one call; same result as copy_ per tensor
        finally:
            torch.set_grad_enabled(grad_mode)
        return vals


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


def _skeleton(d: dict, prefix: str, fqns: list, leaves: list) -> tuple:
    """The key skeleton of a tree of plain dicts whose leaves are torch tensors or plain values, else _Miss."""
    keys, kids = tuple(d), []
    for k, v in d.items():
        fqn = _join(prefix, k)
        if isinstance(v, torch.Tensor):
            kids.append(None)
            fqns.append(fqn)
            leaves.append((fqn, TENSOR))
        elif values_codec.is_plain(v):
            kids.append(None)
            fqns.append(fqn)
            leaves.append((fqn, "value"))
        elif type(v) is dict:
            n0 = len(leaves)
            kid = _skeleton(v, fqn, fqns, leaves)
            if not any(kind == TENSOR for _, kind in leaves[n0:]):
                raise _Miss  # a container of values only: keep to the full walk's rules
            kids.append(kid)
        else:
            raise _Miss  # numpy arrays, lists/tuples of tensors, stateful objects: the full path
    return keys, (None if all(k is None for k in kids) else kids)


@dataclass
class _Fast:
    """What the warm path of one structure needs (see :meth:`TorchStaging.stage_fast`)."""

    layout: Any
    skeleton: tuple
    tensor_leaves: list  # (leaf index, type, local shape, dtype, DTensor spec or None); no tensor is kept alive
    fqns: list  # per tensor leaf
    sts: list  # per tensor leaf: the cached ShardedTensor description
    value_leaves: list  # (leaf index, fqn)
    chunk_src: list  # per chunk: its tensor leaf
    dsts: list
    replicas: list
    container_types: tuple = (dict, list, tuple)

    @classmethod
    def build(cls, state_dict, tensors, vals, chunks, srcs, lay, replicas) -> "_Fast | None":
        if type(state_dict) is not dict or not lay.dst_torch:
            return None
        fqns_all: list = []
        leaves: list = []
        try:
            skel = _skeleton(state_dict, "", fqns_all, leaves)
        except (_Miss, StateDictError):
            return None
        t_fqns = [f for f, kind in leaves if kind == TENSOR]
        if t_fqns != [st.fqn for st in tensors] or [f for f, kind in leaves if kind != TENSOR] != list(vals):
            return None  # not the walk the full path did
        flat: list = []
        _collect(state_dict, skel, flat)
        DT = tad.DTensor
        index = {id(st): j for j, st in enumerate(tensors)}
        chunk_src = []
        for (st, _), s in zip(chunks, srcs):
            j = index.get(id(st))
            if j is None or not isinstance(s, torch.Tensor) or not s.is_cpu:
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
            if loc.layout is not torch.strided or not loc.is_cpu:
                return None
            t_leaves.append((i, type(v), loc.shape, loc.dtype, v._spec if is_dt else None))
        return cls(lay, skel, t_leaves, t_fqns, list(tensors), vleaves, chunk_src, list(lay.dst_torch), replicas)
