"""The ``hyperdcp`` logger: silent unless the application enables it.

    import logging
    logging.basicConfig()                                  # or any handler of your own
    logging.getLogger("hyperdcp").setLevel(logging.INFO)

Then every save and load logs one INFO line per rank (bytes, seconds, GB/s; for loads the read
amplification: bytes read from storage over the bytes of state this rank asked for), and the CLI's
long commands (``convert``, ``verify``, with ``-v``) log their progress. Nothing is logged by default:
the library only installs a :class:`logging.NullHandler`.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("hyperdcp")
logger.addHandler(logging.NullHandler())


def size(nbytes: float) -> str:
    """``1234567`` -> ``"1.23 MB"`` (decimal units)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    return ""


def _rate(nbytes: int, seconds: float) -> str:
    return f"{size(nbytes)} in {seconds:.3f} s ({nbytes / 1e9 / max(seconds, 1e-9):.2f} GB/s)"


def log_save(result: Any, asynchronous: bool = False) -> None:
    """One INFO line for a committed save (``result``: a SaveResult)."""
    if result is None or not logger.isEnabledFor(logging.INFO):
        return
    logger.info("%s %s: rank %d/%d wrote %s, %d file(s)%s", "async-saved" if asynchronous else "saved", result.path,
                result.rank, result.world_size, _rate(result.bytes_written, result.seconds), len(result.files_written),
                ", plan cached" if result.plan_cache_hit else "")


def log_load(result: Any, pieces: Any = (), meta: Any = None) -> None:
    """One INFO line for a load (``result``: a LoadResult; ``pieces``: this rank's planned pieces)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    from .core import dtypes

    wanted = 0
    if meta is not None:
        for p in pieces:
            if getattr(p, "dst", True) is None:  # read-once: a piece this rank reads for another rank
                continue
            wanted += p.box.numel * dtypes.itemsize(meta.tensors[p.fqn].dtype)
    amp = f"{result.bytes_read / wanted:.2f}x" if wanted else "n/a"
    logger.info("loaded %s: read %s from storage for %s of state (read amplification %s); %d missing, "
                "%d unused key(s)", result.path, _rate(result.bytes_read, result.seconds), size(wanted), amp,
                len(result.missing_keys), len(result.unused_keys))


__all__ = ["logger", "log_save", "log_load"]
