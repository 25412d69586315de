"""Text the CLI prints: checkpoint content (tensor names, file names, values) is untrusted, so every
control character and every code point that cannot be encoded is escaped before it reaches a terminal."""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, lone surrogates, and the bidirectional overrides that reorder what a terminal shows
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def safe(text: object) -> str:
    """``text`` with control characters and lone surrogates escaped (``\\x1b``, ``\\ud800``): one printable line."""
    return _UNSAFE.sub(_escape, str(text))


def safe_lines(text: object) -> str:
    """Like :func:`safe` but keeps newlines (for multi-line messages such as errors)."""
    return "\n".join(safe(line) for line in str(text).split("\n"))
