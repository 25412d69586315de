"""MindSpore Tensors and Parameters, whole or sliced by a MindSpore parallel layout.

A plain ``mindspore.Tensor`` / ``Parameter`` (a Cell's ``parameters_dict()`` or ``state_dict()``, an
optimizer's moments) is one full box held by every rank, like a plain torch tensor. A parameter
slice of a parallel network is wrapped with its layout, :class:`Sharded` (or :func:`with_layouts`
for a whole ``parameter_layout_dict``); its box and replicas follow from the device matrix and tensor
map (:mod:`.mindspore_layout`). Loads fill the very objects given: ``Parameter.set_data`` (identity,
name and dtype kept) or ``Tensor.assign_value``, after the bytes were read into a host buffer.

bfloat16 is stored as ``BF16`` and moved as raw 16-bit words (``Tensor.view(int16)``), so it
round-trips bit-exactly even though this MindSpore wheel's numpy bfloat16 bridge does not work with
numpy 2.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping

import mindspore as ms
import numpy as np

from ..core.boxes import full_box
from ..core.layout import GridLayout, replicated_layout
from ..core.shards import LocalShard, ShardedTensor, flat_bytes
from ..errors import StateDictError
from . import mindspore_layout as msl

_CODES: dict[Any, str] = {}
for _name, _code in [("bool_", "BOOL"), ("uint8", "U8"), ("int8", "I8"), ("int16", "I16"), ("uint16", "U16"),
                     ("float16", "F16"), ("bfloat16", "BF16"), ("int32", "I32"), ("uint32", "U32"),
                     ("float32", "F32"), ("int64", "I64"), ("uint64", "U64"), ("float64", "F64"),
                     ("complex64", "C64")]:
    if hasattr(ms, _name):
        _CODES[getattr(ms, _name)] = _code
MS_DTYPE = {v: k for k, v in _CODES.items()}
#: numpy dtype of the host buffer of each code (bf16 travels as its 16-bit words)
_HOST = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16, "F16": np.float16,
         "BF16": np.int16, "I32": np.int32, "U32": np.uint32, "F32": np.float32, "I64": np.int64, "U64": np.uint64,
         "F64": np.float64, "C64": np.complex64}


_PRIMED: list[bool] = []


def prime() -> None:
    """MindSpore 2.10's wheel is built against numpy 1.x: under numpy 2 its first dtype-taking call
    (e.g. ``Tensor.view(dtype)``, ``nn.Dense(...)``) fails once with a SystemError while probing numpy's C
    API, then works. Take that failure here, once, quietly. Called before the first bf16 bitcast only (not
    at import: msrun jobs must set the device and ``init()`` before any kernel runs, and a failed probe
    leaves MindSpore's numpy bridge broken for the rest of the process, see docs/MINDSPORE.md); programs
    may call it themselves before their first dtype-taking call."""
    if _PRIMED:
        return
    _PRIMED.append(True)
    t = ms.Tensor.from_numpy(np.zeros(1, np.int16))
    with contextlib.redirect_stderr(io.StringIO()):
        for _ in range(2):
            try:
                t.view(ms.bfloat16)
                return
            except SystemError:
                continue


def bitcast(t: Any, dtype: Any) -> Any:
    """``t.view(dtype)`` (same bytes, another element type of the same size), priming MindSpore first."""
    prime()
    return t.view(dtype)


@dataclass(eq=False)
class Sharded:
    """A parameter's local slice under a MindSpore layout: save it, or load into it, in a state dict.

    ``local``: this rank's slice (a ``Parameter`` or ``Tensor``; loads fill it in place). ``layout``: a
    ``mindspore.parallel.Layout`` called with the tensor's axes, its ``to_dict()``, or a
    ``parameter_layout_dict`` entry. ``rank``: this process's rank in the layout's ``rank_list``
    numbering (default: the coordinator's global rank). ``shape``: the full tensor's shape (default:
    the slice's shape times the pieces per dim).
    """

    local: Any
    layout: Any
    rank: int | None = None
    shape: tuple[int, ...] | None = None
    _spec: Any = field(default=None, init=False, repr=False)

    def spec(self, fqn: str) -> msl.MsLayout:
        if self._spec is None:
            self._spec = msl.parse_layout(fqn, self.layout)
        return self._spec


def with_layouts(params: Mapping[str, Any], layouts: Mapping[str, Any], rank: int | None = None) -> dict[str, Any]:
    """``params`` with every entry named in ``layouts`` (e.g. ``net.parameter_layout_dict``) wrapped as
    :class:`Sharded`; the others stay as they are (whole on every rank)."""
    return {k: Sharded(v, layouts[k], rank) if k in layouts else v for k, v in params.items()}


def is_tensor(value: Any) -> bool:
    return isinstance(value, (ms.Tensor, Sharded))


def describe(value: Any) -> str:
    if isinstance(value, Sharded):
        return f"MindSpore slice {tuple(value.local.shape)} {value.local.dtype} of layout {value.layout!r}"
    kind = "Parameter" if isinstance(value, ms.Parameter) else "Tensor"
    return f"MindSpore {kind}{tuple(value.shape)} {value.dtype}"


def dtype_code(fqn: str, dtype: Any) -> str:
    try:
        return _CODES[dtype]
    except KeyError:
        raise StateDictError(f"cannot store {fqn!r}: MindSpore dtype {dtype} has no safetensors equivalent; cast it "
                             f"(e.g. .astype(mindspore.float32)) first") from None


def host_bytes(t: Any, code: str) -> np.ndarray:
    """A flat uint8 host view of a MindSpore tensor's values (asnumpy; bf16 through its int16 bits)."""
    if getattr(t, "has_init", False):  # a Parameter whose initializer has not run yet
        t.init_data()
    arr = (bitcast(t, ms.int16) if code == "BF16" else t).asnumpy()
    return flat_bytes(np.ascontiguousarray(arr))


def _setter(dst: Any, host: np.ndarray, code: str):
    def finish() -> None:
        src = ms.Tensor.from_numpy(host)
        if code == "BF16":
            src = bitcast(src, ms.bfloat16)
        if isinstance(dst, ms.Parameter):
            dst.set_data(src)
        else:
            dst.assign_value(src)
    return finish


def _cache(ctx) -> dict:
    """Per coordinator (its group fixes the rank numbering): what many tensors of one layout share."""
    cache = getattr(ctx, "_hyperdcp_ms_layouts", None)
    if cache is None:
        cache = {}
        try:
            ctx._hyperdcp_ms_layouts = cache
        except AttributeError:  # a coordinator with __slots__: no caching
            pass
    return cache


def _group_grid(spec: msl.MsLayout, ctx) -> np.ndarray | None:
    """``rank_list`` as the coordinator's group ranks (None if some rank is outside the group); cached per
    device matrix and rank list, so the per-tensor cost does not grow with the number of ranks."""
    cache = _cache(ctx)
    key = ("grid", spec.device_matrix, spec.rank_list)
    if key not in cache:
        glob = spec.ranks()
        members = np.asarray(ctx.global_ranks, np.int64)
        lookup = np.full(int(max(glob.max(), members.max(initial=0))) + 1, -1, np.int64)
        lookup[members] = np.arange(len(members), dtype=np.int64)
        grid = lookup[glob]
        cache[key] = None if int(grid.min()) < 0 else grid
    return cache[key]


def _replicas(spec: msl.MsLayout, coord: tuple[int, ...], grid: np.ndarray, ctx) -> tuple[int, ...]:
    """Group ranks holding the same box as ``coord`` (cached per layout family and coordinate)."""
    split = spec.split_dims()
    cache = _cache(ctx)
    key = ("reps", spec.device_matrix, spec.rank_list, split, tuple(coord[i] for i in split))
    if key not in cache:
        cache[key] = tuple(sorted(grid[msl.replica_positions(spec, coord)].tolist()))
    return cache[key]


def _grid_layout(spec: msl.MsLayout, grid: np.ndarray, ctx) -> GridLayout:
    cache = _cache(ctx)
    key = ("layout", spec.device_matrix, spec.rank_list, spec.tensor_map)
    if key not in cache:
        cache[key] = msl.grid_layout(spec, grid)
    return cache[key]


@lru_cache(maxsize=16)
def _all_ranks(world: int) -> tuple[int, ...]:
    return tuple(range(world))


def _sharded_parts(fqn: str, value: Sharded, ctx):
    """(full shape, this rank's box or None, its replica ranks or None, the group grid or None, the layout)."""
    spec = value.spec(fqn)
    local = value.local
    if not isinstance(local, ms.Tensor):
        raise StateDictError(f"{fqn!r}: Sharded.local must be a mindspore Tensor or Parameter, got "
                             f"{type(local).__name__}")
    shape = tuple(int(s) for s in value.shape) if value.shape is not None else msl.full_shape(fqn, spec, local.shape)
    msl.check_shape(fqn, spec, shape)
    me = value.rank if value.rank is not None else ctx.global_ranks[ctx.rank]
    coord = msl.coordinate(spec, int(me))
    grid = _group_grid(spec, ctx)
    if coord is None:  # this rank holds nothing of it (another stage's, or outside rank_list)
        return shape, None, None, grid, spec
    box = msl.local_box(spec, shape, coord)
    if tuple(int(s) for s in local.shape) != box.lengths:
        raise StateDictError(f"{fqn!r}: rank {me}'s slice has shape {tuple(local.shape)} but layout "
                             f"{spec.device_matrix}/{spec.tensor_map} of a {shape} tensor gives it {box.lengths}")
    reps = _replicas(spec, coord, grid, ctx) if grid is not None else None
    return shape, box, reps, grid, spec


def to_sharded(fqn: str, value: Any, ctx, for_load: bool) -> ShardedTensor:
    if isinstance(value, Sharded):
        shape, box, reps, grid, spec = _sharded_parts(fqn, value, ctx)
        local = value.local
        layout = _grid_layout(spec, grid, ctx) if (for_load and grid is not None) else None
    else:
        local = value
        shape = tuple(int(s) for s in value.shape)
        box = full_box(shape)
        reps = _all_ranks(ctx.world_size)
        layout = replicated_layout(ctx.world_size) if for_load else None
    code = dtype_code(fqn, local.dtype)
    if box is None or not box.numel:
        return ShardedTensor(fqn, code, shape, [], layout=layout)
    if not for_load:
        return ShardedTensor(fqn, code, shape, [LocalShard(box, host_bytes(local, code), reps)])
    host = np.empty(box.lengths, _HOST[code])
    st = ShardedTensor(fqn, code, shape, [LocalShard(box, flat_bytes(host), reps)], layout=layout)
    st.finish = _setter(local, host, code)
    return st
