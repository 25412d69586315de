"""What one S3 data-file upload costs the writing process: peak traced memory, minor page faults, CPU.

One process writes one data file to a local S3 server (moto's server mode on 127.0.0.1) through
``ObjectStorage``'s writer, in three ways:

* ``borrowed``: a few large chunks through ``write_borrowed``, as a save writes its staged chunks;
* ``small``: many 32 KiB pieces through ``write_borrowed`` (copied: under ``SMALL_PIECE``), as a file of
  many small tensors;
* ``copied``: the same large chunks through plain ``write``, as a conversion does.

Peak traced memory is what Python allocated beyond the chunks themselves (``tracemalloc``; the client's
and the socket layer's buffers included). ``--src`` runs another checkout's ``src`` (an A/B), and its
writers without ``write_borrowed`` fall back to ``write``.

    python bench/upload_memory.py --mib 64
    python bench/upload_memory.py --mib 64 --src /tmp/old/src     # e.g. a worktree of an older commit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

_CASE = r"""
import json, os, sys, time, tracemalloc
sys.path.insert(0, {src!r})
import numpy as np
from hyperdcp.storage.object_store import ObjectStorage
MiB = 1 << 20
case, n = {case!r}, {mib} * MiB
st = ObjectStorage('s3://bench/' + case, {{'part_bytes': {part}}})
st.client  # the session, outside the figures
big = [np.random.default_rng(i).integers(0, 255, n // 4, dtype=np.uint8) for i in range(4)]
small = [a[j:j + (32 << 10)] for a in big for j in range(0, a.size, 32 << 10)]
def faults():
    with open('/proc/self/stat') as f:
        return int(f.read().rpartition(')')[2].split()[7])
w = st.begin_in_place(0).create('r00000-00.safetensors')
put = getattr(w, 'write_borrowed', w.write) if case != 'copied' else w.write
tracemalloc.start()
f0, c0, t0 = faults(), time.process_time(), time.perf_counter()
for piece in (small if case == 'small' else big):
    put(piece)
w.close()
wall, cpu, flt = time.perf_counter() - t0, time.process_time() - c0, faults() - f0
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
print(json.dumps({{'case': case, 'wall_s': wall, 'cpu_s': cpu, 'minor_faults': flt, 'peak_MiB': peak / MiB}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="the data file's size")
    ap.add_argument("--part-mib", type=int, default=16, help="part_bytes (single PUT up to 4 parts)")
    ap.add_argument("--src", default=os.path.join(_HERE, "..", "src"), help="the hyperdcp src directory to run")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(_HERE, ".."))
    from tests.s3_server import S3Server

    server = S3Server.start()
    try:
        server.make_bucket("bench")
        env = {**os.environ, **server.env}
        print(f"one {args.mib} MiB data file, {args.part_mib} MiB parts, src {os.path.abspath(args.src)}")
        for case in ("borrowed", "small", "copied"):
            for _ in range(args.repeat):
                code = _CASE.format(src=os.path.abspath(args.src), case=case, mib=args.mib, part=args.part_mib << 20)
                r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
                if r.returncode:
                    raise SystemExit(r.stderr[-2000:])
                res = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"{res['case']:<9} wall {res['wall_s']:.2f} s  CPU {res['cpu_s']:.2f} s  "
                      f"minor faults {res['minor_faults']:>7d}  peak traced {res['peak_MiB']:6.1f} MiB")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
