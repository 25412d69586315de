"""Rank metadata files of the no-collectives mode, as pure codecs: names, parsing, and their merge.

Each rank of a no-collectives save writes ``hyperdcp.rank-<rank:05d>.json`` last (see the "Async save,
no-collectives mode" section of docs/FORMAT.md). The checkpoint counts as complete when the rank files
of every rank ``0..world_size-1`` exist and carry the same ``save_id``; :func:`merge` then joins them
into ordinary :class:`~hyperdcp.format.metadata.Metadata`. No I/O here: callers read the files through
their storage and pass the bytes (``{file name: bytes}``).
"""

from __future__ import annotations

import time
from typing import Mapping

import numpy as np

from ..errors import CheckpointError, FormatError, IncompleteCheckpointError, MismatchError
from . import values as values_codec
from .metadata import METADATA_FILE, ChunkTable, FileMeta, Metadata, TensorMeta, load_signed_json, sign_json

RANK_FORMAT = "hyperdcp-rank"
PREFIX, SUFFIX = "hyperdcp.rank-", ".json"


def rank_file_name(rank: int) -> str:
    """The file name of ``rank``'s rank metadata file."""
    return f"{PREFIX}{rank:05d}{SUFFIX}"


def is_rank_file(name: str) -> bool:
    """Whether ``name`` (a plain file name) is a rank metadata file."""
    return name.startswith(PREFIX) and name.endswith(SUFFIX)


def encode_rank_doc(doc: dict) -> bytes:
    """The bytes of a rank file: strict JSON, self-checksummed like ``hyperdcp.json`` (an edited one is refused)."""
    return sign_json(doc)


def parse_rank_file(raw: bytes, where: str) -> dict:
    """The checked document of one rank file (checksum verified, schema checked); FormatError naming ``where``."""
    d = load_signed_json(raw, where)
    _check_rank_doc(d, where)
    return d


def _check_whole(path: str, docs: dict[int, dict], W: int) -> None:
    """Refuse a tensor that ranks held whole with different contents: this mode stored one copy only."""
    seen: dict[str, tuple[str, int]] = {}
    for r in range(W):
        for fqn, d in docs[r].get("whole", {}).items():
            first = seen.setdefault(fqn, (d, r))
            if first[0] != d:
                raise MismatchError(
                    f"checkpoint {path!r} (no-collectives mode): ranks {first[1]} and {r} saved tensor {fqn!r} "
                    "whole with "
                    "different contents, but this mode writes one copy of a tensor every rank holds whole (it cannot "
                    "compare them without communication), so it cannot restore each rank's own. Save per-rank tensors "
                    "with coordination='gloo' or 'file' (they are then stored per rank), or under per-rank keys"
                )


def _check_rank_doc(d, where: str) -> None:
    """The members merge relies on, with their types and ranges (see docs/FORMAT.md)."""
    def bad(why: str) -> FormatError:
        return FormatError(f"{where}: {why}; the rank metadata file is damaged or was not written by hyperdcp")

    def is_int(v, lo: int, hi: int) -> bool:
        return type(v) is int and lo <= v <= hi

    if not isinstance(d, dict) or d.get("format") != RANK_FORMAT:
        raise bad("not a hyperdcp rank metadata document")
    if d.get("version") != 1:
        raise bad("unsupported rank file version (upgrade hyperdcp?)")
    if not is_int(d.get("world_size"), 1, 1 << 31):
        raise bad("world_size must be an integer in [1, 2^31]")
    if not is_int(d.get("rank"), 0, d["world_size"] - 1):
        raise bad("rank must be an integer in [0, world_size)")
    if type(d.get("save_id")) is not str or not is_int(d.get("checksum_block_bytes"), 1, 1 << 40):
        raise bad("save_id must be a string and checksum_block_bytes a positive integer")
    files = d.get("files")
    if type(files) is not list or not all(type(f) is list and len(f) == 2 and type(f[0]) is str
                                          and is_int(f[1], 0, 1 << 60) for f in files):
        raise bad("files must be a list of [name, bytes]")
    tensors = d.get("tensors")
    cols = ("offsets", "lengths", "file", "begin", "end", "checksums")
    if type(tensors) is not dict or not all(
            type(t) is dict and type(t.get("dtype")) is str and type(t.get("shape")) is list
            and all(type(t.get(c)) is list and len(t[c]) == len(t["begin"]) for c in cols)
            and all(is_int(x, 0, len(files) - 1) for x in t["file"]) for t in tensors.values()):
        raise bad("tensors must map names to chunk columns of equal length naming this rank's files")
    for t in tensors.values():
        if not all(type(b) is list and len(b) == len(t["shape"]) for c in ("offsets", "lengths") for b in t[c]):
            raise bad("each chunk box must have one offset and one length per dimension")
    all_t = d.get("all_tensors", [])
    if type(all_t) is not list or not all(type(x) is list and len(x) == 3 and type(x[0]) is str
                                          and type(x[1]) is str and type(x[2]) is list for x in all_t):
        raise bad("all_tensors must be a list of [name, dtype, shape]")
    if type(d.get("values")) is not dict or type(d.get("user", {})) is not dict \
            or type(d.get("created_unix", 0)) not in (int, float):
        raise bad("values and user must be objects and created_unix a number")


def merge(files: Mapping[str, bytes], path: str) -> Metadata:
    """Join the rank files of the checkpoint at ``path`` (``{file name: bytes}``) into one :class:`Metadata`.

    Raises IncompleteCheckpointError when ranks are missing or the files come from different saves,
    FormatError when one is damaged, MismatchError when this mode cannot represent what was saved.
    """
    try:
        docs: dict[int, dict] = {}
        for name in sorted(files):
            where = f"{path.rstrip('/')}/{name}"
            d = parse_rank_file(files[name], where)
            if d["rank"] in docs:
                raise FormatError(f"{where}: a second rank file claims rank {d['rank']}; the checkpoint is damaged")
            docs[d["rank"]] = d
        return _merge(path, docs)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError,
            MemoryError) as e:  # defence in depth: the schema checks above should catch these first
        raise FormatError(f"{path}: the rank metadata files cannot be merged ({type(e).__name__}); the checkpoint "
                          "is damaged; load an earlier checkpoint") from None


def _merge(path: str, docs: dict[int, dict]) -> Metadata:
    if not docs:
        raise IncompleteCheckpointError(f"incomplete checkpoint at {path!r}: no {METADATA_FILE} and no rank files")
    W = docs[min(docs)]["world_size"]
    ids = {d["save_id"] for d in docs.values()}
    if len(ids) != 1 or any(d["world_size"] != W for d in docs.values()):
        raise IncompleteCheckpointError(
            f"incomplete checkpoint at {path!r} (no-collectives mode): rank files come from different saves; load an "
            "earlier checkpoint"
        )
    if len(docs) != W:  # every rank is in [0, W): the first missing ones are found in len(docs) + 16 steps
        missing = [r for r in range(min(W, len(docs) + 16)) if r not in docs][:16]
        raise IncompleteCheckpointError(
            f"incomplete checkpoint at {path!r} (no-collectives mode): rank file(s) of rank(s) {missing} "
            f"({W - len(docs)} in all) of {W} are missing (those ranks' saves did not finish); "
            "load an earlier checkpoint"
        )
    _check_whole(path, docs, W)
    files: list[FileMeta] = []
    acc: dict[str, dict] = {}
    block = int(docs[0]["checksum_block_bytes"])
    for r in range(W):
        d = docs[r]
        base = len(files)
        files.extend(FileMeta(n, int(b)) for n, b in d["files"])
        for fqn, dtype, shape in d.get("all_tensors", []):
            acc.setdefault(fqn, {"dtype": dtype, "shape": tuple(shape), "rows": {}})
        for fqn, t in d["tensors"].items():
            a = acc.setdefault(fqn, {"dtype": t["dtype"], "shape": tuple(t["shape"]), "rows": {}})
            for k in range(len(t["begin"])):
                box = (tuple(t["offsets"][k]), tuple(t["lengths"][k]))
                a["rows"].setdefault(box, (t["file"][k] + base, t["begin"][k], t["end"][k], t["checksums"][k]))
    tensors = {}
    for fqn, a in sorted(acc.items()):
        rows = sorted(a["rows"].items())
        if not rows and all(a["shape"]):
            held = [r for r in range(W) if fqn in docs[r].get("whole", {})]
            raise MismatchError(
                f"checkpoint {path!r} (no-collectives mode): no rank wrote tensor {fqn!r} (held whole by rank(s) "
                f"{held[:8]}): this mode takes a plain tensor to be held by every rank and has one of them write it. "
                "Save a tensor that only some ranks hold (pipeline stages) as a DTensor on those ranks' mesh, or "
                "with coordination='gloo' or 'file'"
            )
        nd = len(a["shape"])
        tensors[fqn] = TensorMeta(a["dtype"], a["shape"], ChunkTable(
            np.array([b[0] for b, _ in rows], np.int64).reshape(len(rows), nd),
            np.array([b[1] for b, _ in rows], np.int64).reshape(len(rows), nd),
            np.array([v[0] for _, v in rows], np.int64), np.array([v[1] for _, v in rows], np.int64),
            np.array([v[2] for _, v in rows], np.int64), [v[3] for _, v in rows],
        ))
    every = all(docs[r].get("values_every_rank") for r in range(W))
    values, per_rank = _merge_values(path, [docs[r]["values"] for r in (range(W) if every else [0])])
    meta = Metadata(world_size=W, files=files, tensors=tensors, values=values, checksum_block_bytes=block,
                    user=dict(docs[0].get("user", {})), created_unix=float(docs[0].get("created_unix", time.time())),
                    per_rank_values=per_rank)
    # validate like a committed checkpoint (every tensor tiled exactly, files named properly)
    return Metadata.from_json(meta.to_json(), where=f"{path} (merged rank files)")


def _merge_values(path: str, per_rank_docs: list[dict]) -> tuple[dict, dict]:
    """Values every rank saved equal are stored once; the others (different, or saved by some ranks
    only) per rank. (Rank files written before per-rank values hold values on rank 0 only: shared.)"""
    values, per_rank = {}, {}
    keys = sorted({k for d in per_rank_docs for k in d})
    for k in keys:
        held = [(r, d[k]) for r, d in enumerate(per_rank_docs) if k in d]
        first = values_codec.canonical(held[0][1])
        if len(held) == len(per_rank_docs) and all(values_codec.canonical(v) == first for _, v in held[1:]):
            values[k] = values_codec.decode(held[0][1], f"{path}: value {k!r}")
        else:
            per_rank[k] = {r: values_codec.decode(v, f"{path}: value {k!r} of rank {r}") for r, v in held}
    return values, per_rank
