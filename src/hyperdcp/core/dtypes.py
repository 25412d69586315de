"""Element types, named as in the safetensors format ("F32", "BF16", ...).

The core copies bytes and never needs to interpret elements, so a dtype here is only a name and an
item size. Conversions to numpy (with ``ml_dtypes`` for bf16/fp8) happen only where values are
computed on, e.g. casts and diffs.
"""

from __future__ import annotations

from ..errors import FormatError

#: safetensors dtype code -> item size in bytes
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

_NUMPY_NAME = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "C64": "complex64",
}
_ML_DTYPES_NAME = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def itemsize(code: str) -> int:
    """Bytes per element of a dtype code; raises FormatError for unknown codes."""
    try:
        return ITEMSIZE[code]
    except (KeyError, TypeError):
        raise FormatError(
            f"unknown dtype {code!r}; hyperdcp knows {', '.join(sorted(ITEMSIZE))}"
        ) from None


def to_numpy(code: str):
    """The numpy dtype for a code (bf16/fp8 through ml_dtypes)."""
    import numpy as np

    itemsize(code)
    if code in _NUMPY_NAME:
        return np.dtype(_NUMPY_NAME[code])
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, _ML_DTYPES_NAME[code]))


def from_numpy(dtype) -> str:
    """The code for a numpy dtype; raises FormatError if it has none."""
    import numpy as np

    dtype = np.dtype(dtype)
    for code, name in _NUMPY_NAME.items():
        if dtype.name == name:
            return code
    for code, name in _ML_DTYPES_NAME.items():
        if dtype.name == name:
            return code
    raise FormatError(
        f"numpy dtype {dtype} has no safetensors equivalent; convert the array to one of "
        f"{', '.join(sorted(ITEMSIZE))} before saving"
    )
