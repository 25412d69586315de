"""Body: a request body gathered from several buffers by reference, read back as their concatenation."""

from __future__ import annotations

import io

import numpy as np
import pytest

from hyperdcp.storage.body import Body


def _pieces():
    return [b"head", np.arange(1000, dtype=np.int32), b"", bytearray(b"tail" * 300), memoryview(b"!")]


def _whole(pieces) -> bytes:
    return b"".join(memoryview(p).cast("B").tobytes() for p in pieces)


@pytest.mark.parametrize("size", [1, 7, 4096, 1 << 20])
def test_a_reader_gives_the_concatenation_whatever_the_read_size(size):
    pieces = _pieces()
    body = Body(pieces)
    assert len(body) == len(_whole(pieces))
    r, got = body.open(), bytearray()
    while chunk := r.read(size):
        got += chunk
    assert bytes(got) == _whole(pieces) == body.tobytes()
    assert r.read(10) == b""


def test_seek_and_tell_as_a_client_uses_them_to_size_hash_and_resend_a_body():
    body = Body(_pieces())
    want = body.tobytes()
    r = body.open()
    assert r.seekable() and r.seek(0, io.SEEK_END) == len(want) == r.tell()
    assert r.seek(-5, io.SEEK_END) == len(want) - 5 and r.read() == want[-5:]
    r.seek(4003)  # inside the array, past the piece boundary at 4
    assert r.read(10) == want[4003:4013] and len(r) == len(want) - 4013
    with pytest.raises(ValueError):
        r.seek(-1)


def test_every_open_starts_at_the_first_byte_and_the_pieces_are_not_copied():
    arr = np.zeros(16, np.uint8)
    body = Body([arr])
    first = body.open()
    assert first.read(8) == bytes(8)
    arr[:] = 7  # a view, not a copy: the caller keeps the pieces unchanged while a request runs
    assert body.open().read() == bytes([7] * 16) and first.read() == bytes([7] * 8)
