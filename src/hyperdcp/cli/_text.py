"""Text the CLI prints and parses.

Checkpoint content (tensor names, file names, values) is untrusted, so every control character and
every code point that cannot be encoded is escaped before it reaches a terminal (:func:`safe`).
Sizes and dtypes as users type them (``parse_size``, ``parse_dtype``) and the progress counter
(``Progress``) live with the tools that take them (:mod:`hyperdcp.tools._units`) and are re-exported
here for the commands.
"""

from __future__ import annotations

import re

from ..tools._units import Progress, parse_dtype, parse_size

__all__ = ["safe", "safe_lines", "human_size", "parse_size", "parse_dtype", "Progress"]

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


def human_size(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"``: a byte count in binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
