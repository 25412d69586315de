"""Every rank of a save or a load must name the same checkpoint.

The check costs no collective of its own: an 8-byte digest of the path rides on an exchange that
happens anyway (the save's plan-digest all-gather, the load's metadata broadcast). Paths are compared as
absolute paths (the save already requires one namespace: every rank writes into the temporary directory
rank 0 names) or, for URLs, as given without trailing slashes.
"""

from __future__ import annotations

import os

import xxhash

from ..errors import MismatchError
from .urls import is_remote

DIGEST_BYTES = 8


def path_digest(path: str | os.PathLike) -> bytes:
    """The 8-byte identity of the checkpoint path ``path`` as this rank names it."""
    p = os.fspath(path)
    key = p.rstrip("/") if is_remote(p) else os.path.normpath(os.path.abspath(p))
    return xxhash.xxh3_64_digest(key.encode("utf-8", "surrogatepass"))


def mismatch_with_source(path: str, theirs: bytes, rank: int, what: str, src: int = 0) -> MismatchError | None:
    """The error of a rank whose path differs from the one ``src`` used (``theirs``: src's digest), else None."""
    if theirs == path_digest(path):
        return None
    return MismatchError(
        f"rank {rank} passed checkpoint path {os.fspath(path)!r} to {what}, but rank {src} passed a different path; "
        "every rank must pass the same path (resolve it once -- e.g. hyperdcp.latest_checkpoint, which rank 0 "
        "resolves and shares when a process group is up -- and use it on all ranks)"
    )


def mismatch_among(path: str, digests: list[bytes], rank: int, what: str) -> MismatchError | None:
    """With every rank's digest at hand (an all-gather), the same error on every rank if any differs."""
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if not differ:
        return None
    shown = ", ".join(str(r) for r in differ[:16]) + (" ..." if len(differ) > 16 else "")
    return MismatchError(
        f"the ranks passed different checkpoint paths to {what}: rank(s) {shown} differ from rank 0 (this rank, "
        f"{rank}, passed {os.fspath(path)!r}); every rank must pass the same path (resolve it once, e.g. "
        "hyperdcp.latest_checkpoint on rank 0, shared when a process group is up)"
    )
