"""What a save stores per rank: content digests (:func:`content_table`), their comparison
(:func:`classify_per_rank`) and the result (:class:`PerRank`); see docs/FORMAT.md "Per-rank entries"."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import xxhash

_CONTENT_MAGIC = b"HDCT"


def content_table(tensor_keys: Sequence[str], tensor_digests: Sequence[int], value_keys: Sequence[str],
                  value_digests: Sequence[int]) -> bytes:
    """One rank's content digests: one 64-bit digest per whole-held tensor and per plain value.

    Binary form: magic, the JSON key lists' length, the JSON ``[tensor keys, value keys]``, then the
    digests (tensors first) as little-endian uint64. The key lists are equal on most ranks, so the
    receiver groups ranks by them.
    """
    keys = json.dumps([list(tensor_keys), list(value_keys)], separators=(",", ":")).encode()
    d = np.array(list(tensor_digests) + list(value_digests), dtype="<u8")
    return b"".join([_CONTENT_MAGIC, struct.pack("<Q", len(keys)), keys, d.tobytes()])


@dataclass
class PerRank:
    """What a save stores per rank: plain values, and tensors with their holders (sorted ranks)."""

    values: list[str] = field(default_factory=list)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.values or self.tensors)

    def to_bytes(self) -> bytes:
        from ..core import wire

        names = sorted(self.tensors)
        counts = np.array([len(self.tensors[k]) for k in names], np.int64)
        flat = np.concatenate([self.tensors[k] for k in names]).astype(np.int64) if names else np.zeros(0, np.int64)
        return wire.pack({"values": self.values, "tensors": names}, {"counts": counts, "flat": flat})

    @classmethod
    def from_bytes(cls, raw: bytes) -> "PerRank":
        from ..core import wire

        head, arr = wire.unpack(raw)
        starts = np.concatenate([[0], np.cumsum(arr["counts"])]).astype(np.int64)
        return cls(list(head["values"]),
                   {k: arr["flat"][starts[i] : starts[i + 1]] for i, k in enumerate(head["tensors"])})

    def tensor_key(self) -> bytes:
        """Identifies the tensors stored per rank and their holders (part of the plan cache key)."""
        h = xxhash.xxh3_128()
        for k in sorted(self.tensors):
            h.update(k.encode() + b"\0" + np.asarray(self.tensors[k], "<i8").tobytes() + b"\1")
        return h.digest()


def classify_per_rank(tables: Sequence[bytes], world: int) -> PerRank:
    """Which entries a save stores per rank, from every rank's :func:`content_table`.

    A plain value is stored once when every rank holds it with the same digest, else per rank (it
    differs, or only some ranks hold it). A tensor held whole by several ranks is stored once when
    their digests agree, else per rank (held only by some ranks is fine: it is stored from them).
    Ranks are grouped by their key lists, so the cost is one numpy pass per group plus one step per key
    and group, never per (rank, key) in Python.
    """
    groups: dict[bytes, tuple[list, list[int], list[np.ndarray]]] = {}
    for r, raw in enumerate(tables):
        if raw[:4] != _CONTENT_MAGIC:
            raise ValueError("not a hyperdcp content table")
        (kl,) = struct.unpack_from("<Q", raw, 4)
        kb = raw[12 : 12 + kl]
        g = groups.get(kb)
        if g is None:
            g = groups[kb] = (json.loads(kb), [], [])
        g[1].append(r)
        g[2].append(np.frombuffer(raw, "<u8", offset=12 + kl))
    # per key: [holder count, a digest, differs, holder rank arrays]
    info: dict[tuple[int, str], list] = {}
    for (tkeys, vkeys), ranks, digs in groups.values():
        m = np.stack(digs) if digs else np.zeros((0, 0), "<u8")
        if m.shape[1] == 0:
            continue
        lo, hi, d0 = m.min(axis=0), m.max(axis=0), m[0]
        rk = np.array(ranks, np.int64)
        for j, key in enumerate([(0, k) for k in tkeys] + [(1, k) for k in vkeys]):
            e = info.get(key)
            if e is None:
                info[key] = [len(ranks), int(d0[j]), bool(lo[j] != hi[j]), [rk]]
            else:
                e[0] += len(ranks)
                e[2] = e[2] or bool(lo[j] != hi[j]) or int(d0[j]) != e[1]
                e[3].append(rk)
    out = PerRank()
    for (kind, k), (count, _, differs, rks) in sorted(info.items()):
        if kind == 1 and (differs or count < world):
            out.values.append(k)
        elif kind == 0 and differs:
            out.tensors[k] = np.sort(np.concatenate(rks))
    return out
