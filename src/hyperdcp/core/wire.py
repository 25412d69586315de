"""A tiny binary envelope for messages between ranks: a JSON header plus raw numpy arrays.

Used for local plans, write assignments and write results. It carries only JSON and plain integer
arrays, so decoding never constructs arbitrary objects (no pickle).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

_MAGIC = b"HDW1"


def pack(header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> bytes:
    arrays = arrays or {}
    specs, blobs = [], []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        if a.dtype.kind not in "iub":
            raise TypeError(f"wire arrays must be integer, got {a.dtype} for {name}")
        specs.append([name, a.dtype.str, list(a.shape)])
        blobs.append(a.tobytes())
    head = json.dumps({"h": header, "a": specs}, separators=(",", ":")).encode()
    return b"".join([_MAGIC, struct.pack("<Q", len(head)), head, *blobs])


def unpack(raw: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    if raw[:4] != _MAGIC:
        raise ValueError("not a hyperdcp wire message")
    (n,) = struct.unpack_from("<Q", raw, 4)
    doc = json.loads(bytes(raw[12 : 12 + n]).decode("utf-8"))  # str: json skips detecting the encoding
    pos, arrays = 12 + n, {}
    for name, dt, shape in doc["a"]:
        dtype = np.dtype(dt)
        if dtype.kind not in "iub":
            raise ValueError("wire arrays must be integer")
        count = math.prod(shape)  # plain ints (1 for a scalar); np.prod costs ~10 us per call
        arrays[name] = np.frombuffer(raw, dtype=dtype, count=count, offset=pos).reshape(shape)
        pos += count * dtype.itemsize
    return doc["h"], arrays
