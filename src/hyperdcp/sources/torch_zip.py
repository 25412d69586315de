"""Locating the parts of one ``torch.save`` record (a zip archive stored inside a torch DCP data file) from
its zip directory, without reading or executing its contents.

:func:`read_record` reads the record's tail (end-of-central-directory, zip64 included, and the central
directory) and its head (the local headers of ``data.pkl``, ``byteorder`` and the storage entries, which
torch writes first), and returns a :class:`Record`: each entry's data offset and size, relative to the
record. Every entry must be stored uncompressed and lie inside the record; anything else is a
:class:`~hyperdcp.errors.FormatError` naming the file and byte offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable

from ..errors import FormatError

_EOCD, _EOCD64, _LOC64 = 0x06054B50, 0x06064B50, 0x07064B50
_CEN, _LOC = 0x02014B50, 0x04034B50
#: how much of a record's start and end one read takes (covers torch's headers, data.pkl and directory)
HEAD_BYTES = 1024
TAIL_BYTES = 2048
MAX_ENTRIES = 1 << 16


@dataclass
class Record:
    """One ``torch.save`` archive: entry name (without the archive folder) -> (data offset, size)."""

    prefix: str
    entries: dict[str, tuple[int, int]]
    head: bytes  # the record's first bytes, as read
    crcs: dict[str, int]  # entry name -> the CRC-32 the zip directory records

    def data(self, name: str, pread: Callable[[int, int], bytes], where: str) -> bytes:
        """The bytes of a (small) entry, from the head already read when they are in it."""
        off, n = self.entries[name]
        if off + n <= len(self.head):
            return self.head[off:off + n]
        raw = pread(n, off)
        if len(raw) != n:
            raise FormatError(f"{where}: entry {name!r} is truncated")
        return raw


def read_record(pread: Callable[[int, int], bytes], length: int, where: str) -> Record:
    """Parse the zip directory of a record of ``length`` bytes; ``pread(n, off)`` reads inside the record."""
    if length < 22:
        raise FormatError(f"{where}: {length} bytes is too short for a torch.save record")
    head = pread(min(length, HEAD_BYTES), 0)
    t0 = max(0, length - TAIL_BYTES)
    tail = head[t0:] if length <= len(head) else pread(length - t0, t0)

    def at(off: int, n: int) -> bytes:
        if off >= t0 and off + n <= length:
            return tail[off - t0:off - t0 + n]
        if off + n <= len(head):
            return head[off:off + n]
        raw = pread(n, off) if 0 <= off and off + n <= length else b""
        if len(raw) != n:
            raise FormatError(f"{where}: zip structure points outside the record (bytes {off}..{off + n} of {length})")
        return raw

    e = tail.rfind(struct.pack("<I", _EOCD))
    if e < 0 or len(tail) - e < 22:
        raise FormatError(f"{where}: no zip end record: not a torch.save record (or it is truncated)")
    _, _, _, _, count, cd_size, cd_off, _ = struct.unpack("<IHHHHIIH", tail[e:e + 22])
    if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_off == 0xFFFFFFFF:
        loc = t0 + e - 20
        sig, _, eocd64, _ = struct.unpack("<IIQI", at(loc, 20))
        if sig != _LOC64:
            raise FormatError(f"{where}: zip64 end record locator missing")
        f = struct.unpack("<IQHHIIQQQQ", at(eocd64, 56))
        if f[0] != _EOCD64:
            raise FormatError(f"{where}: zip64 end record missing")
        count, cd_size, cd_off = f[7], f[8], f[9]
    if count > MAX_ENTRIES or cd_off + cd_size > length:
        raise FormatError(f"{where}: zip directory of {count} entries at {cd_off} does not fit the record")
    cd = at(cd_off, cd_size)
    entries: dict[str, tuple[int, int]] = {}
    pos = 0
    names = []
    for _ in range(count):
        if pos + 46 > len(cd) or struct.unpack_from("<I", cd, pos)[0] != _CEN:
            raise FormatError(f"{where}: damaged zip directory")
        crc = struct.unpack_from("<I", cd, pos + 16)[0]
        (method, csize, usize, nlen, xlen, clen, lho) = (struct.unpack_from("<H", cd, pos + 10)[0],
                                                        *struct.unpack_from("<II", cd, pos + 20),
                                                        *struct.unpack_from("<HHH", cd, pos + 28),
                                                        struct.unpack_from("<I", cd, pos + 42)[0])
        name = cd[pos + 46:pos + 46 + nlen].decode("utf-8", "replace")
        extra = cd[pos + 46 + nlen:pos + 46 + nlen + xlen]
        csize, usize, lho = _zip64(extra, csize, usize, lho)
        if method != 0 or csize != usize:
            raise FormatError(f"{where}: entry {name!r} is compressed (method {method}); torch.save stores entries "
                              "uncompressed, so this is not a record torch wrote")
        names.append((name, lho, usize, crc))
        pos += 46 + nlen + xlen + clen
    prefix = ""
    for name, *_ in names:
        if name.endswith("/data.pkl") or name == "data.pkl":
            prefix = name[: -len("data.pkl")]
            break
    else:
        raise FormatError(f"{where}: no data.pkl in the record: not a torch.save record")
    crcs: dict[str, int] = {}
    for name, lho, size, crc in names:
        if not name.startswith(prefix):
            continue
        sig, nlen, xlen = struct.unpack("<I22xHH", at(lho, 30))
        if sig != _LOC:
            raise FormatError(f"{where}: entry {name!r}: no local header at byte {lho}")
        start = lho + 30 + nlen + xlen
        if start + size > length:
            raise FormatError(f"{where}: entry {name!r} ({size} bytes at {start}) "
                              f"extends past the record's {length} bytes")
        entries[name[len(prefix):]] = (start, size)
        crcs[name[len(prefix):]] = crc
    return Record(prefix, entries, head, crcs)


def _zip64(extra: bytes, csize: int, usize: int, lho: int) -> tuple[int, int, int]:
    """Apply a zip64 extended-information field (id 1) to the 32-bit values that overflowed."""
    pos = 0
    while pos + 4 <= len(extra):
        hid, n = struct.unpack_from("<HH", extra, pos)
        if hid == 1:
            vals = list(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF and vals:
                usize = vals.pop(0)
            if csize == 0xFFFFFFFF and vals:
                csize = vals.pop(0)
            if lho == 0xFFFFFFFF and vals:
                lho = vals.pop(0)
            break
        pos += 4 + n
    return csize, usize, lho
