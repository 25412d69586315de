"""torch tensors and DTensors.

A plain ``torch.Tensor`` is one full box held by every rank (replicated). A ``DTensor`` contributes
its local shard: the boxes follow from its mesh and ``Shard(d)``/``_StridedShard``/``Replicate()``
placements (uneven shards included; one box unless a strided shard leaves the local indices in
several runs); the ranks holding an identical box are those that share its mesh coordinates on every
sharded mesh dimension. A rank outside a DTensor's mesh holds nothing of it. A DTensor whose local
tensor is a ``LocalShardsWrapper`` and a legacy ``ShardedTensor`` (``torch.distributed._shard``)
contribute the boxes of their shard metadata.
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from ..core.boxes import Box, full_box
from ..core.layout import REPLICATE, GridLayout, dim_runs, local_boxes, replicated_layout
from ..core.shards import LocalShard, ShardedTensor
from ..errors import StateDictError

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore

try:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover
    from torch.distributed._tensor._utils import compute_local_shape_and_global_offset  # type: ignore

_CODES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.complex64: "C64",
}
for _name, _code in [("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"),
                     ("float8_e5m2", "F8_E5M2")]:
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code
TORCH_DTYPE = {v: k for k, v in _CODES.items()}


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def describe(value: Any) -> str:
    if _LEGACY and isinstance(value, _LEGACY):
        return f"ShardedTensor{tuple(value.size())} with {len(value.local_shards())} local shard(s)"
    if isinstance(value, DTensor):
        return (f"DTensor{tuple(value.shape)} {value.dtype} on mesh {tuple(value.device_mesh.shape)} "
                f"{list(value.placements)}")
    return f"Tensor{tuple(value.shape)} {value.dtype} on {value.device}"


def dtype_code(fqn: str, dtype: torch.dtype) -> str:
    try:
        return _CODES[dtype]
    except KeyError:
        raise StateDictError(f"cannot store {fqn!r}: dtype {dtype} has no safetensors equivalent") from None


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 host view of a tensor's bytes (copies only if not on CPU, not contiguous, or a conj/neg view)."""
    t = t.detach().resolve_conj().resolve_neg()  # the values the view shows, not its lazy-bit storage
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).reshape(-1).numpy()


def strided_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a strided uint8 array of shape ``t.shape + (itemsize,)`` (shares memory)."""
    isz = t.element_size()
    store = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()
    return np.lib.stride_tricks.as_strided(store[t.storage_offset() * isz:], shape=tuple(t.shape) + (isz,),
                                           strides=tuple(s * isz for s in t.stride()) + (1,), writeable=True)


def check_dense(fqn: str, value: torch.Tensor, for_load: bool) -> None:
    """Refuse sparse, nested and other non-strided tensors (and, to load into, self-overlapping views)."""
    what = "load into" if for_load else "save"
    if getattr(value, "is_nested", False):
        raise StateDictError(f"cannot {what} {fqn!r}: it is a nested tensor; hyperdcp stores dense tensors: "
                             "store its components (e.g. .unbind()) or a padded dense tensor instead")
    if value.layout is not torch.strided:
        raise StateDictError(f"cannot {what} {fqn!r}: it is a {value.layout} tensor; hyperdcp stores dense strided "
                             "tensors: convert it with .to_dense() (and back after loading)")


def check_no_overlap(fqn: str, dst: torch.Tensor) -> None:
    """Refuse to load into a view whose elements share memory (an expand()ed or broadcast view)."""
    if _overlaps(dst):
        raise StateDictError(
            f"cannot load into {fqn!r}: several of its elements share memory (an expand()ed or broadcast view, "
            f"strides {tuple(dst.stride())}); load into a tensor that owns its memory, e.g. its .clone()")


def _overlaps(t: torch.Tensor) -> bool:
    """Whether distinct elements of ``t`` may share memory (a sufficient check for non-overlap fails)."""
    if t.is_contiguous() or t.numel() <= 1:
        return False
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            return True
        span = st * n
    return False


def _legacy_sharded_types() -> tuple:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor as LegacyShardedTensor
    except ImportError:  # pragma: no cover
        return ()
    return (LegacyShardedTensor,)


def _shards_wrapper_types() -> tuple:
    try:
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
    except ImportError:  # pragma: no cover
        return ()
    return (LocalShardsWrapper,)


_LEGACY = _legacy_sharded_types()
_WRAPPER = _shards_wrapper_types()


def _steps(fqn: str, dt: "DTensor") -> list[tuple[int, int]]:
    """Per mesh dim ``(tensor dim or REPLICATE, split factor)``; raises for placements hyperdcp cannot store."""
    nd = max(dt.dim(), 1)
    out = []
    for p in dt.placements:
        if isinstance(p, Replicate):
            out.append((REPLICATE, 1))
        elif isinstance(p, Shard) or type(p).__name__ == "_StridedShard":
            out.append((int(p.dim) % nd, int(getattr(p, "split_factor", 1))))
        else:
            raise StateDictError(
                f"cannot checkpoint {fqn!r}: placement {p} is not supported; hyperdcp stores Shard(d), "
                "_StridedShard(d) and Replicate() placements: redistribute it to one of those first "
                "(Partial tensors to Replicate())"
            )
    return out


def dtensor_boxes(fqn: str, dt: "DTensor") -> list[tuple[Box, tuple[slice, ...], Any]]:
    """This rank's non-empty boxes of ``dt``, each with where it lies in its local tensor and that tensor.

    From the mesh and placements: one box, or several when a strided shard leaves this rank's indices
    in several runs along a dim (:func:`~hyperdcp.core.layout.dim_runs`). A rank outside the mesh
    holds nothing. A local ``LocalShardsWrapper`` (custom uneven shards) contributes its own shards.
    """
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    local = dt._local_tensor
    if coord is None:
        return []
    if _WRAPPER and isinstance(local, _WRAPPER):
        _steps(fqn, dt)
        out = []
        for t, off in zip(local.local_shards(), local.local_offsets()):
            box = Box(tuple(int(o) for o in off), tuple(int(n) for n in t.shape))
            if box.numel:
                out.append((box, tuple(slice(None) for _ in box.lengths), t))
        return out
    steps = _steps(fqn, dt)
    shape = tuple(int(s) for s in dt.shape)
    if all(f == 1 for _, f in steps):
        lens, offs = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
        box = Box(tuple(int(o) for o in offs), tuple(int(n) for n in lens))
        return [(box, tuple(slice(None) for _ in box.lengths), local)] if box.numel else []
    runs = [dim_runs(shape[d], [(int(mesh.shape[i]), f, int(coord[i])) for i, (td, f) in enumerate(steps) if td == d])
            for d in range(len(shape))]
    got = tuple(sum(n for _, n in r) for r in runs)
    if got != tuple(local.shape):
        raise StateDictError(
            f"{fqn!r}: the local shard has shape {tuple(local.shape)} but placements {list(dt.placements)} on mesh "
            f"{tuple(mesh.shape)} give {got}; this torch version splits strided shards differently from hyperdcp's rule"
        )
    return [(Box(g, n), tuple(slice(a, a + b) for a, b in zip(lo, n)), local) for g, n, lo in local_boxes(shape, runs)]


def dtensor_box(fqn: str, dt: "DTensor") -> Box:
    """This rank's one box of ``dt`` (empty outside its mesh); raises when it holds several (see :func:`single_box`)."""
    boxes = dtensor_boxes(fqn, dt)
    if len(boxes) > 1 or (boxes and boxes[0][2] is not dt._local_tensor):
        raise StateDictError(f"{fqn!r}: this rank holds it as {len(boxes)} separate boxes, not one; describe it "
                             "with to_sharded() instead (adapter misuse)")
    if not boxes:
        return Box((0,) * dt.dim(), (0,) * dt.dim())
    return boxes[0][0]


def single_box(value: torch.Tensor) -> bool:
    """Whether ``value``'s local data is one box that is its whole local tensor (plain tensors, most DTensors)."""
    if _LEGACY and isinstance(value, _LEGACY):
        return False
    if isinstance(value, DTensor):
        if _WRAPPER and isinstance(value._local_tensor, _WRAPPER):
            return False
        if any(type(p).__name__ == "_StridedShard" for p in value.placements):
            try:
                return len(dtensor_boxes("", value)) <= 1
            except StateDictError:
                return True  # the single-box path raises the same error with the tensor's name
    return True


def replica_ranks(dt: "DTensor", ctx) -> tuple[int, ...] | None:
    """Group ranks holding the same box as this rank: same coordinate on every Shard mesh dim.

    Cached per (mesh, which mesh dims replicate) and coordinator: many tensors share them, and the
    set may hold every rank."""
    mesh = dt.device_mesh
    mask = tuple(isinstance(p, Replicate) for p in dt.placements)
    cache = _layout_cache(ctx)
    key = ("replicas", id(mesh), mask)
    hit = cache.get(key)
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    coord = mesh.get_coordinate()
    out = None
    if coord is not None:
        idx = tuple(slice(None) if rep else c for rep, c in zip(mask, coord))
        glob = np.asarray(mesh.mesh.cpu().numpy(), dtype=np.int64)[idx].reshape(-1)
        members = np.asarray(ctx.global_ranks, dtype=np.int64)
        order = np.argsort(members)
        pos = np.searchsorted(members[order], glob)
        ok = (pos < len(members)) & (members[order][np.minimum(pos, len(members) - 1)] == glob)
        if ok.all():
            out = tuple(sorted(order[pos].tolist()))
    cache[key] = (weakref.ref(mesh), out)
    return out


@lru_cache(maxsize=16)
def _all_ranks(world: int) -> tuple[int, ...]:
    return tuple(range(world))


def _lift(mesh) -> tuple[Any, tuple[int, ...]] | None:
    """(root mesh, the root dims this sub-mesh spans, increasing) when ``mesh`` is a slice of a larger
    mesh (``mesh["dp"]`` of a ``("dp", "tp")`` mesh), else None.

    A tensor on the sub-mesh is then described on the root mesh, replicated along the other root dims:
    the same layout on every rank of the root (FSDP2 + TP puts norms and embeddings on the "dp"
    sub-mesh, a different one on each TP rank). Read-once only uses it when every rank's digest agrees,
    i.e. when the ranks of the sibling sub-meshes really hold the tensor likewise.
    """
    try:
        root = mesh._get_root_mesh()
    except AttributeError:
        return None
    if root is None or root is mesh:
        return None
    names, rnames = getattr(mesh, "mesh_dim_names", None), getattr(root, "mesh_dim_names", None)
    rcoord = root.get_coordinate()
    if not names or not rnames or rcoord is None or any(n not in rnames for n in names):
        return None
    dims = tuple(rnames.index(n) for n in names)
    if list(dims) != sorted(set(dims)):
        return None
    rgrid = root.mesh.cpu().numpy()
    idx = tuple(slice(None) if k in dims else int(c) for k, c in enumerate(rcoord))
    if not np.array_equal(rgrid[idx], mesh.mesh.cpu().numpy()):
        return None
    return root, dims


def grid_layout(value: torch.Tensor, ctx) -> GridLayout | None:
    """Every rank's view of where ``value`` lives (None when some mesh rank is outside ``ctx``'s group,
    or the local tensor holds custom shards)."""
    if _LEGACY and isinstance(value, _LEGACY):
        return None
    if not isinstance(value, DTensor):
        return replicated_layout(ctx.world_size)
    if _WRAPPER and isinstance(value._local_tensor, _WRAPPER):
        return None
    mesh = value.device_mesh
    cache = _layout_cache(ctx)
    hit = cache.get(id(mesh))
    if hit is None or hit[0]() is not mesh:
        members = np.asarray(ctx.global_ranks, dtype=np.int64)
        lifted = _lift(mesh)
        top, dims = lifted if lifted is not None else (mesh, tuple(range(mesh.ndim)))
        grid = _group_grid(top, members)
        if grid is None and lifted is not None:  # the root reaches outside this group: the sub-mesh alone
            top, dims = mesh, tuple(range(mesh.ndim))
            grid = _group_grid(top, members)
        hit = cache[id(mesh)] = (weakref.ref(mesh), grid, GridLayout.digest_mesh(grid) if grid is not None else b"",
                                 _dim_groups(top) if grid is not None else (), dims)
    _, grid, key, groups, dims = hit
    if grid is None:
        return None
    steps = _steps("", value)
    placements, factors = [REPLICATE] * grid.ndim, [1] * grid.ndim
    for k, (d, f) in zip(dims, steps):
        placements[k], factors[k] = d, f
    return GridLayout(grid, tuple(placements), key, groups, tuple(factors) if any(f != 1 for f in factors) else ())


def _group_grid(mesh, members: np.ndarray) -> np.ndarray | None:
    """The mesh with each global rank replaced by its rank in the group of ``members`` (None if some
    mesh rank is outside that group)."""
    glob = np.asarray(mesh.mesh.cpu().numpy(), dtype=np.int64)
    lookup = np.full(int(max(glob.max(initial=0), members.max(initial=0))) + 1, -1, dtype=np.int64)
    lookup[members] = np.arange(len(members), dtype=np.int64)
    grid = lookup[glob] if glob.size else glob
    return None if grid.size and int(grid.min()) < 0 else grid


def _dim_groups(mesh) -> tuple:
    """This rank's process group along each mesh dimension (created with the mesh; reused, never made here)."""
    if mesh.get_coordinate() is None:
        return ()
    try:
        return tuple(mesh.get_group(d) for d in range(mesh.ndim))
    except (RuntimeError, ValueError, AttributeError):  # a mesh without per-dimension groups
        return ()


def _layout_cache(ctx) -> dict[int, Any]:
    # per coordinator (its group fixes the rank numbering); meshes are shared by many tensors. Keyed by
    # id() and checked through a weak reference: hashing a DeviceMesh is slow
    cache = getattr(ctx, "_hyperdcp_layouts", None)
    if cache is None:
        cache = {}
        try:
            ctx._hyperdcp_layouts = cache
        except AttributeError:  # a coordinator with __slots__: no caching
            pass
    return cache


def _parts(fqn: str, value: torch.Tensor, ctx) -> tuple[tuple[int, ...], list[tuple[Box, tuple[slice, ...], Any]], Any]:
    """(global shape, this rank's boxes with their local location and tensor, replica ranks)."""
    if _LEGACY and isinstance(value, _LEGACY):
        out = []
        for sh in value.local_shards():
            md = sh.metadata
            box = Box(tuple(int(o) for o in md.shard_offsets), tuple(int(n) for n in md.shard_sizes))
            if tuple(sh.tensor.shape) != box.lengths:
                raise StateDictError(f"{fqn!r}: a local shard has shape {tuple(sh.tensor.shape)} but its metadata "
                                     f"says {box}")
            if box.numel:
                out.append((box, tuple(slice(None) for _ in box.lengths), sh.tensor))
        return tuple(int(s) for s in value.size()), out, None
    if isinstance(value, DTensor):
        boxes = dtensor_boxes(fqn, value)
        return tuple(int(s) for s in value.shape), boxes, replica_ranks(value, ctx) if boxes else None
    box = full_box(value.shape)
    parts = [(box, tuple(slice(None) for _ in box.lengths), value)] if box.numel else []
    return box.lengths, parts, _all_ranks(ctx.world_size)


def _dtype(value: torch.Tensor):
    if _LEGACY and isinstance(value, _LEGACY):
        return value.metadata().tensor_properties.dtype
    return value.dtype


def to_sharded(fqn: str, value: torch.Tensor, ctx, for_load: bool) -> ShardedTensor:
    if not (_LEGACY and isinstance(value, _LEGACY)):
        check_dense(fqn, value, for_load)
    shape, parts, reps = _parts(fqn, value, ctx)
    code = dtype_code(fqn, _dtype(value))
    for box, sl, local in parts:
        got = tuple(local[sl].shape) if box.ndim else tuple(local.shape)
        if got != box.lengths:
            raise StateDictError(f"{fqn!r}: local shard shape {got} does not match its placement box {box}")
    if not for_load:
        if any(local.device.type == "meta" for _, _, local in parts):
            raise StateDictError(f"cannot save {fqn!r}: it is on the meta device and holds no data; "
                                 "materialize it first")
        shards = [LocalShard(box, host_bytes(local[sl] if box.ndim else local), reps) for box, sl, local in parts]
        return ShardedTensor(fqn, code, shape, shards)
    layout = grid_layout(value, ctx)
    shards, copies = [], []
    for box, sl, local in parts:
        local = local.detach()
        dst = local[sl] if box.ndim else local
        if dst.device.type == "meta":
            raise StateDictError(f"cannot load into {fqn!r}: its local shard is on the meta device; allocate it first")
        check_no_overlap(fqn, dst)
        if dst.device.type == "cpu" and not (dst.is_conj() or dst.is_neg()):
            if dst.is_contiguous():
                flat = dst.reshape(1) if dst.dim() == 0 else dst
                data = flat.view(torch.uint8).reshape(-1).numpy()
            else:  # strided: read in bounded pieces straight into the view (no full temporary)
                data = strided_bytes(dst)
            shards.append(LocalShard(box, data, reps))
            continue
        host = torch.empty(box.lengths, dtype=dst.dtype, pin_memory=dst.device.type == "cuda")
        data = host_bytes(host) if host.dim() else host.reshape(1).view(torch.uint8).numpy()
        shards.append(LocalShard(box, data, reps))
        copies.append((dst, host))
    st = ShardedTensor(fqn, code, shape, shards, layout=layout)
    if copies:
        def finish(copies=copies):
            for dst, src in copies:
                dst.copy_(src, non_blocking=False)

        st.finish = finish
    return st
