"""torch tensors and DTensors.

A plain ``torch.Tensor`` is one full box held by every rank (replicated). A ``DTensor`` contributes
its local shard: the box follows from its mesh and ``Shard(d)``/``Replicate()`` placements (uneven
shards included); the ranks holding an identical box are those that share its mesh coordinates on
every sharded mesh dimension.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from ..core.boxes import Box, full_box
from ..core.layout import REPLICATE, GridLayout, replicated_layout
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
for _name, _code in [("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")]:
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code
TORCH_DTYPE = {v: k for k, v in _CODES.items()}


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def describe(value: Any) -> str:
    if isinstance(value, DTensor):
        return f"DTensor{tuple(value.shape)} {value.dtype} on mesh {tuple(value.device_mesh.shape)} {list(value.placements)}"
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
    if for_load:
        local = value._local_tensor if isinstance(value, DTensor) else value
        if _overlaps(local):
            raise StateDictError(
                f"cannot load into {fqn!r}: several of its elements share memory (an expand()ed or broadcast view, "
                f"strides {tuple(local.stride())}); load into a tensor that owns its memory, e.g. its .clone()")


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


def dtensor_box(fqn: str, dt: "DTensor") -> Box:
    for p in dt.placements:
        if not isinstance(p, (Shard, Replicate)) or type(p).__name__ == "_StridedShard":
            raise StateDictError(
                f"cannot checkpoint {fqn!r}: placement {p} is not supported; hyperdcp stores Shard(d) and "
                "Replicate() placements (redistribute Partial tensors to Replicate first)"
            )
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return Box(tuple(int(o) for o in offset), tuple(int(s) for s in shape))


def replica_ranks(dt: "DTensor", ctx) -> tuple[int, ...] | None:
    """Group ranks holding the same box as this rank: same coordinate on every Shard mesh dim."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    ranks = mesh.mesh
    idx = tuple(slice(None) if isinstance(p, Replicate) else c for p, c in zip(dt.placements, coord))
    glob = ranks[idx].reshape(-1).tolist()
    to_group = {g: r for r, g in enumerate(ctx.global_ranks)}
    try:
        return tuple(sorted(to_group[g] for g in glob))
    except KeyError:
        return None


def grid_layout(value: torch.Tensor, ctx) -> GridLayout | None:
    """Every rank's view of where ``value`` lives (None when some mesh rank is outside ``ctx``'s group)."""
    if not isinstance(value, DTensor):
        return replicated_layout(ctx.world_size)
    mesh = value.device_mesh
    cache = _layout_cache(ctx)
    hit = cache.get(id(mesh))
    if hit is None or hit[0]() is not mesh:
        glob = np.asarray(mesh.mesh.cpu().numpy(), dtype=np.int64)
        members = np.asarray(ctx.global_ranks, dtype=np.int64)
        lookup = np.full(int(max(glob.max(initial=0), members.max(initial=0))) + 1, -1, dtype=np.int64)
        lookup[members] = np.arange(len(members), dtype=np.int64)
        grid = lookup[glob] if glob.size else glob
        if grid.size and int(grid.min()) < 0:
            grid = None  # a mesh rank outside this coordinator's group
        hit = cache[id(mesh)] = (weakref.ref(mesh), grid, GridLayout.digest_mesh(grid) if grid is not None else b"",
                                 _dim_groups(mesh) if grid is not None else ())
    _, grid, key, groups = hit
    if grid is None:
        return None
    nd = value.dim()
    placements = tuple(REPLICATE if isinstance(p, Replicate) else p.dim % max(nd, 1) for p in value.placements)
    return GridLayout(grid, placements, key, groups)


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


def to_sharded(fqn: str, value: torch.Tensor, ctx, for_load: bool) -> ShardedTensor:
    check_dense(fqn, value, for_load)
    if isinstance(value, DTensor):
        box = dtensor_box(fqn, value)
        local = value.to_local()
        reps = replica_ranks(value, ctx)
        shape = tuple(int(s) for s in value.shape)
    else:
        box, local, reps = full_box(value.shape), value, tuple(range(ctx.world_size))
        shape = box.lengths
    code = dtype_code(fqn, value.dtype)
    if tuple(local.shape) != box.lengths:
        raise StateDictError(f"{fqn!r}: local shard shape {tuple(local.shape)} does not match its placement box {box}")
    if not for_load:
        data = host_bytes(local) if box.numel else np.zeros(0, np.uint8)
        return ShardedTensor(fqn, code, shape, [LocalShard(box, data, reps)])
    layout = grid_layout(value, ctx)
    if box.numel == 0:
        return ShardedTensor(fqn, code, shape, [], layout=layout)
    local = local.detach()
    if local.device.type == "cpu" and not (local.is_conj() or local.is_neg()):
        if local.is_contiguous():
            flat = local.reshape(1) if local.dim() == 0 else local
            data = flat.view(torch.uint8).reshape(-1).numpy()
        else:  # strided: read in bounded pieces straight into the view (no full temporary)
            data = strided_bytes(local)
        return ShardedTensor(fqn, code, shape, [LocalShard(box, data, reps)], layout=layout)
    pin = local.device.type == "cuda"
    host = torch.empty(box.lengths, dtype=local.dtype, pin_memory=pin)
    st = ShardedTensor(fqn, code, shape, [LocalShard(box, host_bytes(host) if host.dim() else host.reshape(1).view(torch.uint8).numpy(), reps)],
                       layout=layout)

    def finish(dst=local, src=host):
        dst.copy_(src, non_blocking=False)

    st.finish = finish
    return st
