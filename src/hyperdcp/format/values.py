"""Plain (non-tensor) values, stored in the metadata as tagged JSON that round-trips exact types.

Supported: None, bool, int, float (NaN and infinities included), str, bytes, numpy scalars, and
lists, tuples and dicts of these. Each value is ``[tag, payload]``:

    ["none"]  ["bool", true]  ["int", "12"]  ["float", "0x1.8000000000000p+1"]  ["str", "a"]
    ["bytes", "<base64>"]  ["np", "F32", "<hex of the bytes>"]  ["list", [v, ...]]
    ["tuple", [v, ...]]  ["dict", [[k, v], ...]]

Nothing is evaluated on decode: tags select among these constructors only.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import numpy as np
import xxhash

from ..core import dtypes
from ..errors import FormatError, StateDictError

MAX_DEPTH = 64
_PLAIN = (type(None), bool, int, float, str, bytes)


def is_plain(value: Any, _depth: int = 0) -> bool:
    """True if ``value`` is a plain value (or a container of only plain values)."""
    if _depth > MAX_DEPTH:
        return False
    if type(value) in _PLAIN or isinstance(value, np.generic):
        return True
    if type(value) in (list, tuple):
        return all(is_plain(v, _depth + 1) for v in value)
    if type(value) is dict:
        return all(is_plain(k, _depth + 1) and is_plain(v, _depth + 1) for k, v in value.items())
    return False


def encode(value: Any, key: str = "?", _depth: int = 0) -> list:
    """Encode a plain value; raise StateDictError naming ``key`` for anything else."""
    if _depth > MAX_DEPTH:
        raise StateDictError(f"value at {key!r} is nested deeper than {MAX_DEPTH} levels; flatten it")
    t = type(value)
    if value is None:
        return ["none"]
    if t is bool:
        return ["bool", value]
    if t is int:  # past sys.int_max_str_digits' reach (4300 digits): hexadecimal, which has no limit
        return ["int", str(value) if value.bit_length() < 14000 else hex(value)]
    if t is float:
        return ["float", value.hex()]
    if t is str:
        return ["str", value]
    if t is bytes:
        return ["bytes", base64.b64encode(value).decode("ascii")]
    if isinstance(value, np.generic):
        code = dtypes.from_numpy(value.dtype)
        return ["np", code, np.asarray(value).tobytes().hex()]
    if t in (list, tuple):
        return [t.__name__, [encode(v, f"{key}[{i}]", _depth + 1) for i, v in enumerate(value)]]
    if t is dict:
        return ["dict", [[encode(k, key, _depth + 1), encode(v, f"{key}.{k}", _depth + 1)] for k, v in value.items()]]
    raise StateDictError(
        f"cannot save {key!r}: values of type {t.__module__}.{t.__qualname__} are neither tensors, "
        "arrays, objects with state_dict()/load_state_dict(), nor plain values (None, bool, int, float, "
        "str, bytes, numpy scalars, and lists/tuples/dicts of them). hyperdcp never pickles; convert it "
        "to one of these, or drop it from the state dict"
    )


def decode(obj: Any, where: str = "metadata", _depth: int = 0) -> Any:
    """Decode a tagged value; raise FormatError on anything malformed."""

    def bad(why: str) -> FormatError:
        return FormatError(f"{where}: malformed stored value ({why}); the metadata file is damaged")

    if _depth > MAX_DEPTH:
        raise bad("nested too deeply")
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], str):
        raise bad("expected [tag, payload]")
    tag, rest = obj[0], obj[1:]
    try:
        if tag == "none" and not rest:
            return None
        if len(rest) == 1:
            (p,) = rest
            if tag == "bool" and type(p) is bool:
                return p
            if tag == "int" and type(p) is str and p.startswith(("0x", "-0x")) and len(p) <= 1 << 24:
                return int(p, 16)
            if tag == "int" and type(p) is str and len(p) <= 4300:
                return int(p)
            if tag == "float" and type(p) is str and len(p) <= 64:
                return float.fromhex(p)
            if tag == "str" and type(p) is str:
                return p
            if tag == "bytes" and type(p) is str:
                return base64.b64decode(p.encode("ascii"), validate=True)
            if tag in ("list", "tuple") and type(p) is list:
                items = [decode(v, where, _depth + 1) for v in p]
                return items if tag == "list" else tuple(items)
            if tag == "dict" and type(p) is list:
                out = {}
                for kv in p:
                    if not isinstance(kv, list) or len(kv) != 2:
                        raise bad("dict item is not [key, value]")
                    k = decode(kv[0], where, _depth + 1)
                    try:
                        out[k] = decode(kv[1], where, _depth + 1)
                    except TypeError:
                        raise bad("unhashable dict key") from None
                return out
        if tag == "np" and len(rest) == 2 and all(type(p) is str for p in rest):
            dt = dtypes.to_numpy(rest[0])
            raw = bytes.fromhex(rest[1])
            if len(raw) != dt.itemsize:
                raise bad("numpy scalar has the wrong byte count")
            return np.frombuffer(raw, dtype=dt)[0]
    except (ValueError, binascii.Error, OverflowError, UnicodeError) as e:
        raise bad(str(e)) from None
    raise bad(f"unknown tag {tag!r} or payload")


def canonical(encoded: list) -> bytes:
    """The bytes that identify an encoded value (compact JSON): equal values give equal bytes."""
    return json.dumps(encoded, separators=(",", ":"), allow_nan=False).encode("utf-8")


def digest(encoded: list) -> int:
    """A 64-bit digest of an encoded value, compared across ranks to find values that differ."""
    return xxhash.xxh3_64_intdigest(canonical(encoded))
