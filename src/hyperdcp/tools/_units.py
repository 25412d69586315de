"""Units and pacing for offline tools: sizes and dtypes as users type them, a byte budget across
threads, a progress counter (a tqdm bar on a terminal, else log lines)."""

from __future__ import annotations

import re
import sys
import threading
import time

FLOAT_CODES = ("F16", "BF16", "F32", "F64")
_DTYPE_ALIASES = {"bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "f16": "F16", "float16": "F16", "half": "F16",
                  "fp32": "F32", "f32": "F32", "float32": "F32", "float": "F32", "fp64": "F64", "f64": "F64",
                  "float64": "F64", "double": "F64"}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*$", re.I)


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5*10**9, ``"512MiB"`` -> 512*2**20, plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    num, unit = float(m.group(1)), m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("IB")[:1]]
    size = int(num * base ** power)
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def parse_dtype(text: str) -> str:
    code = _DTYPE_ALIASES.get(text.lower(), text.upper())
    if code not in FLOAT_CODES:
        raise ValueError(f"unsupported --dtype {text!r}; use one of bf16, f16, f32, f64")
    return code


class ByteBudget:
    """Bounds bytes in flight across threads; one oversized request may always proceed alone."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._cv = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cv:
            while self.used and self.used + n > self.limit:
                self._cv.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()


class Progress:
    """A thread-safe byte counter: a tqdm bar on a terminal (unless quiet), else, when the ``hyperdcp``
    logger is enabled for INFO, a log line every 10% of the work or 10 seconds."""

    def __init__(self, total: int, desc: str, quiet: bool = False):
        from ..logs import logger

        self._lock = threading.Lock()
        self._bar = None
        self._total, self._desc, self._done = total, desc, 0
        self._log = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
        elif logger.isEnabledFor(20):  # logging.INFO
            self._log = logger
            self._t0 = self._last_t = time.monotonic()
            self._last_done = 0

    def update(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)
        elif self._log is not None:
            with self._lock:
                self._done += n
                now = time.monotonic()
                if (self._done - self._last_done) * 10 < self._total and now - self._last_t < 10:
                    return
                self._last_done, self._last_t = self._done, now
                done, total, secs = self._done, self._total, now - self._t0
            self._log.info("%s: %.1f%% (%.3f of %.3f GB, %.2f GB/s)", self._desc, 100 * done / max(total, 1),
                           done / 1e9, total / 1e9, done / 1e9 / max(secs, 1e-9))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

