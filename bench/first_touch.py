"""What touching fresh memory costs on this machine, against copying into memory already touched.

A load that receives bytes into new buffers pays for their pages on the first write (a page fault, and
the kernel zeroing the page), besides the copy itself. This copies ``--mib`` MiB of resident bytes:

* into a new numpy array, ``--repeat`` times in one process (the first time the process has never
  touched those pages; later times the allocator may hand back pages it already has);
* into the same array again (warm memory: the copy alone);
* into a new ``/dev/shm`` file mapped shared, as read-once's slots are (tmpfs pages are new each time).

and prints the seconds and minor page faults of each.

    python bench/first_touch.py --mib 128
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import tempfile
import time

import numpy as np


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(label: str, fn) -> None:
    f0, t0 = _faults(), time.perf_counter()
    fn()
    print(f"{label:<34}{time.perf_counter() - t0:8.3f} s {_faults() - f0:9d} minor faults")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.mib << 20
    src = np.ones(n, np.uint8)  # resident before any timing
    dst = None
    for i in range(args.repeat):
        def fresh() -> None:
            nonlocal dst
            dst = np.empty(n, np.uint8)
            np.copyto(dst, src)
        _timed(f"new array, copy {i + 1}", fresh)
    _timed("same array again (warm)", lambda: np.copyto(dst, src))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for i in range(args.repeat):
        fd, path = tempfile.mkstemp(dir=shm, prefix="first-touch-")
        try:
            os.ftruncate(fd, n)
            with mmap.mmap(fd, n) as m:
                view = np.frombuffer(m, np.uint8)
                _timed(f"new {shm} file, copy {i + 1}", lambda v=view: np.copyto(v, src))
                del view
        finally:
            os.close(fd)
            os.unlink(path)


if __name__ == "__main__":
    main()
