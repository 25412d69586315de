"""A restricted unpickler for what torch.distributed.checkpoint writes: its ``.metadata`` and the ``data.pkl``
of the ``torch.save`` records in its data files. Nothing in a checkpoint can run code through it.

``pickle.Unpickler`` resolves every global through :meth:`find_class`; this one maps an allow-list of
``(module, name)`` pairs to *inert stand-ins defined here* (plain records, tuples, strings) and refuses
every other global with a :class:`~hyperdcp.errors.FormatError` naming it, before anything is called.
No torch class is ever constructed, so the allow-list cannot be widened by what torch itself makes
callable (torch's own ``weights_only`` loader constructs real torch objects, tensors included, and needs
torch; this needs only the standard library). Persistent ids (tensor storages) become
:class:`StorageRef` records; their bytes are never read here.

* :func:`load_metadata` -- ``.metadata``: Metadata, TensorStorageMetadata, BytesStorageMetadata,
  ChunkStorageMetadata, TensorProperties, MetadataIndex, StorageMeta, _StorageInfo, torch.Size, dtypes,
  layouts, memory formats, paths, OrderedDict/set/frozenset;
* :func:`load_record_pickle` -- a record's ``data.pkl``: a tensor (``_rebuild_tensor_v2`` over a storage)
  or, with ``tensors=False``, a plain value (None, bool, int, float, complex, str, bytes, containers).
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

from ..errors import FormatError

#: torch dtype attribute name -> hyperdcp dtype code
DTYPES = {
    "float32": "F32", "float": "F32", "float64": "F64", "double": "F64", "float16": "F16", "half": "F16",
    "bfloat16": "BF16", "int64": "I64", "long": "I64", "int32": "I32", "int": "I32", "int16": "I16",
    "short": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16", "uint32": "U32",
    "uint64": "U64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
#: the typed storage classes of data.pkl persistent ids -> dtype code
STORAGES = {
    "FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8",
    "BoolStorage": "BOOL", "ComplexFloatStorage": "C64", "UInt16Storage": "U16", "UInt32Storage": "U32",
    "UInt64Storage": "U64", "Float8_e4m3fnStorage": "F8_E4M3", "Float8_e5m2Storage": "F8_E5M2",
}
_LAYOUTS = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged")
_MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")
_MD = "torch.distributed.checkpoint.metadata"


class DType(str):
    """A torch dtype, as its hyperdcp code (``"F32"``); ``torch_name`` keeps torch's attribute name."""

    torch_name: str


class Layout(str):
    """A torch layout (``"strided"``)."""


class MemoryFormat(str):
    """A torch memory format (``"contiguous_format"``)."""


class Record:
    """An inert stand-in for one of torch's metadata dataclasses: attributes only, set from pickle state."""

    FIELDS: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any):
        for k, v in zip(self.FIELDS, args):
            setattr(self, k, v)
        for k, v in kwargs.items():
            setattr(self, str(k), v)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict state, slot state)
        if isinstance(state, tuple):  # TensorProperties pickles its fields as a tuple
            state = dict(zip(self.FIELDS, state))
        if not isinstance(state, dict) or not all(type(k) is str for k in state):
            raise FormatError(f"torch DCP metadata: a {type(self).__name__} record has state of type "
                              f"{type(state).__name__}; the file is not torch DCP metadata")
        self.__dict__.update(state)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class Metadata(Record):
    FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class TensorStorageMetadata(Record):
    FIELDS = ("properties", "size", "chunks")


class BytesStorageMetadata(Record):
    FIELDS = ()


class ChunkStorageMetadata(Record):
    FIELDS = ("offsets", "sizes")


class TensorProperties(Record):
    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


class StorageMeta(Record):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")


class StorageInfo(Record):
    FIELDS = ("relative_path", "offset", "length", "transform_descriptors")


class MetadataIndex(Record):
    """Hashable by ``(fqn, offset)`` like torch's (``index`` is a hint only)."""

    FIELDS = ("fqn", "offset", "index")

    def key(self) -> tuple:
        off = self.get("offset")
        return (self.get("fqn"), None if off is None else tuple(off))

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self.key() == other.key()


class StorageRef:
    """A persistent id of a record's ``data.pkl``: storage ``key`` of ``numel`` elements of ``dtype``."""

    def __init__(self, dtype: str, key: str, numel: int, location: str):
        self.dtype, self.key, self.numel, self.location = dtype, key, numel, location


class StoredTensor:
    """What ``_rebuild_tensor_v2`` would have built: a view of ``storage``."""

    def __init__(self, storage: Any, storage_offset: Any, size: Any, stride: Any, *_rest: Any):
        if not isinstance(storage, StorageRef):
            raise FormatError("a tensor record's data.pkl rebuilds a tensor from something other than a storage")
        for what, v in (("size", size), ("stride", stride)):
            if not isinstance(v, tuple) or not all(type(x) is int and x >= 0 for x in v):
                raise FormatError(f"a tensor record's data.pkl gives a {what} of {v!r}")
        if type(storage_offset) is not int or storage_offset < 0 or len(size) != len(stride):
            raise FormatError(f"a tensor record's data.pkl gives storage offset {storage_offset!r} for size {size}")
        self.storage, self.storage_offset, self.size, self.stride = storage, storage_offset, size, stride


def _size(*args: Any) -> tuple:
    items = tuple(args[0]) if args else ()
    if not all(type(x) is int for x in items):
        raise FormatError(f"torch.Size of {items!r}: not all integers")
    return items


def _dtype(name: str) -> DType:
    d = DType(DTYPES[name])
    d.torch_name = name
    return d


def _path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


def _mem_format(code: Any) -> MemoryFormat:
    names = {0: "contiguous_format", 1: "channels_last", 2: "channels_last_3d", 3: "preserve_format"}
    if code not in names:
        raise FormatError(f"torch DCP metadata: unknown memory format code {code!r}")
    return MemoryFormat(names[code])


def _layout(name: Any) -> Layout:
    if type(name) is not str or name.removeprefix("torch.") not in _LAYOUTS:
        raise FormatError(f"torch DCP metadata: unknown layout {name!r}")
    return Layout(name.removeprefix("torch."))


def _metadata_globals() -> dict[tuple[str, str], Any]:
    g: dict[tuple[str, str], Any] = {
        (_MD, "Metadata"): Metadata, (_MD, "TensorStorageMetadata"): TensorStorageMetadata,
        (_MD, "BytesStorageMetadata"): BytesStorageMetadata, (_MD, "ChunkStorageMetadata"): ChunkStorageMetadata,
        (_MD, "TensorProperties"): TensorProperties, (_MD, "MetadataIndex"): MetadataIndex,
        (_MD, "StorageMeta"): StorageMeta, (_MD, "_MEM_FORMAT_ENCODING"): _mem_format,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
        ("torch", "Size"): _size, ("torch.serialization", "_get_layout"): _layout,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
    }
    for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        g[("pathlib", cls)] = _path
    for name in DTYPES:
        g[("torch", name)] = _dtype(name)
    for name in _LAYOUTS:
        g[("torch", name)] = Layout(name)
    for name in _MEMORY_FORMATS:
        g[("torch", name)] = MemoryFormat(name)
    return g


_METADATA_GLOBALS = _metadata_globals()
_PLAIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict, ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset, ("builtins", "complex"): complex,
}


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): StoredTensor, ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict, ("torch", "Size"): _size,
    **{("torch", name): code for name, code in STORAGES.items()},
}


class _Restricted(pickle.Unpickler):
    def __init__(self, raw: bytes, allowed: dict[tuple[str, str], Any], where: str, storages: bool):
        super().__init__(io.BytesIO(raw))
        self.allowed, self.where, self.storages = allowed, where, storages

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except (KeyError, TypeError):
            raise Refused(module, name, self.where) from None

    def persistent_load(self, pid: Any) -> Any:
        if (self.storages and isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and pid[1] in STORAGES.values() and type(pid[2]) is str and type(pid[4]) is int and pid[4] >= 0):
            return StorageRef(pid[1], pid[2], pid[4], str(pid[3]))
        raise FormatError(f"{self.where}: refused persistent id {str(pid)[:80]!r} (only tensor storages are "
                          "expected here); nothing was executed")


class Refused(FormatError):
    """A pickle named a global outside the allow-list: nothing was constructed or called."""

    def __init__(self, module: str, name: str, where: str):
        self.global_name = f"{module}.{name}"
        super().__init__(
            f"{where}: refused to unpickle the global {self.global_name}: torch DCP checkpoints hold only "
            "torch's metadata records and plain values, so this file was damaged, written by an unknown torch "
            "version, or crafted to run code; nothing from it was executed (do not load it with pickle or "
            "torch.load(weights_only=False))"
        )


def _run(raw: bytes, allowed: dict, where: str, storages: bool) -> Any:
    try:
        return _Restricted(raw, allowed, where, storages).load()
    except FormatError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            OverflowError, RecursionError, MemoryError, UnicodeDecodeError) as e:
        raise FormatError(f"{where}: not a valid torch DCP pickle ({type(e).__name__}: {str(e)[:200]}); the file is "
                          "damaged or not written by torch.distributed.checkpoint") from None


def load_metadata(raw: bytes, where: str) -> Metadata:
    """Parse a torch DCP ``.metadata`` pickle into :class:`Metadata` stand-ins; FormatError on anything else."""
    md = _run(raw, _METADATA_GLOBALS, where, storages=False)
    if not isinstance(md, Metadata) or not isinstance(md.get("state_dict_metadata"), dict):
        raise FormatError(f"{where}: holds a {type(md).__name__}, not torch DCP Metadata with state_dict_metadata")
    return md


def load_record_pickle(raw: bytes, where: str, *, tensors: bool) -> Any:
    """The object of a ``torch.save`` record's ``data.pkl``: a :class:`StoredTensor` (``tensors``) or a plain value."""
    return _run(raw, _TENSOR_GLOBALS if tensors else _PLAIN_GLOBALS, where, storages=tensors)
