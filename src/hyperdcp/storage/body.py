"""Body: one request body gathered from several buffers, sent without joining them into one.

A save's data file is its header and its chunks' bytes, already in memory; joining them for a PUT costs a
copy of the file into fresh memory (on a loaded host, faulting its pages in costs more than the copy), and
the socket layer would copy it once more. A :class:`Body` keeps views of the pieces and hands a client a
fresh seekable reader per attempt (:meth:`Body.open`), so a retried request starts again from its first
byte. The pieces must stay unchanged until the request has finished.
"""

from __future__ import annotations

import bisect
import io
import itertools
from typing import Iterable

from ..core.buffers import copy_into

__all__ = ["Body"]


class Body:
    """The concatenation of ``pieces`` (bytes-like), by reference."""

    def __init__(self, pieces: Iterable) -> None:
        self.pieces = [mv for mv in (memoryview(p).cast("B") for p in pieces) if len(mv)]
        self._starts = [0, *itertools.accumulate(len(p) for p in self.pieces)]

    def __len__(self) -> int:
        return self._starts[-1]

    def open(self) -> "_Reader":
        """A new reader at the first byte (seekable, for clients that hash the body before sending it)."""
        return _Reader(self)

    def tobytes(self) -> bytes:
        """The body as one bytes object (a copy), for clients that only take bytes."""
        return b"".join(self.pieces)


class _Reader(io.RawIOBase):
    def __init__(self, body: Body) -> None:
        super().__init__()
        self._body, self._pos = body, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._body)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, b) -> int:
        out, body, got = memoryview(b).cast("B"), self._body, 0
        i = bisect.bisect_right(body._starts, self._pos) - 1
        while got < len(out) and self._pos < len(body):
            piece, at = body.pieces[i], self._pos - body._starts[i]
            k = min(len(out) - got, len(piece) - at)
            copy_into(out[got:got + k], piece[at:at + k])
            got, self._pos, i = got + k, self._pos + k, i + 1
        return got

    def __len__(self) -> int:  # aiohttp and botocore size a body by len() when it has one
        return len(self._body) - self._pos
