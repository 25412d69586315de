"""Object storage (issue 14): hyperdcp vs torch.distributed.checkpoint's FsspecWriter/FsspecReader over s3fs,
against a local S3 API server (moto's server mode on 127.0.0.1), requests and bytes counted server-side.

Every request goes through a counting HTTP proxy in front of the server (tests/faults/http_proxy.py with
no faults), so the request and byte counts are the server's, not the clients'. Cases, on ``--ranks``
spawned gloo ranks with an HSDP ``--mesh`` state of ``--mib`` MiB (bench/load.py's state):

* save: hyperdcp.save to ``s3://bench/hyperdcp``; torch ``dcp.save(storage_writer=FsspecWriter(url))``;
  floor: every rank uploads its share of the unique bytes (one object per rank) as a plain parallel
  multipart upload with the chosen client (s3fs's aiobotocore, ``--part-mib`` parts, 4 in flight);
* load, same layout and 1-D [Shard(1)]: hyperdcp.load (read-once); ``dcp.load(FsspecReader(url))``;
  floor: every rank downloads its share with parallel ranged GETs of ``--part-mib``;
* per case: wall time (slowest rank), bytes read from / written to the store over the unique bytes,
  requests, and peak extra memory per rank (VmHWM - VmRSS before the case).

``--clients`` also compares the two clients on one process (s3fs vs obstore through ObjectStorage): upload
and download throughput of ``--client-mib`` MiB and the peak extra memory.

    python bench/object_store.py --ranks 8 --mesh 4 2 --mib 256
    python bench/object_store.py --ranks 2 --mesh 1 2 --mib 32 --clients     # a quick look
    python bench/object_store.py --libs hyperdcp,floor --profile /tmp/s3prof   # where the time goes
    python bench/object_store.py --libs hyperdcp --loads same_layout --phases   # read-once phase times

``--profile DIR``: every rank runs each case under cProfile (DIR/<case>-<lib>-r<rank>.prof, main thread)
and the proxy logs every request of the case (DIR/<case>-<lib>-requests.json: start, end, method, path,
bytes in, bytes out; times relative to the case's start); a request timeline per case is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, _HERE)

import load as base  # noqa: E402  (bench/load.py: state, checks, memory counters)


def _stats(endpoint: str) -> dict:
    from tests.faults.http_proxy import STATS_PATH

    return json.loads(urllib.request.urlopen(endpoint + STATS_PATH, timeout=10).read())


def _proxy_log(endpoint: str) -> list:
    from tests.faults.http_proxy import LOG_PATH

    return json.loads(urllib.request.urlopen(endpoint + LOG_PATH, timeout=10).read())


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def _cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of process ``pid`` so far."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _minflt(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (first touches of fresh memory among them)."""
    return int(_stat(pid)[7])


def _kind(method: str, path: str) -> str:
    """A request's kind for the timeline: GET-range, PUT-part, POST-create, ..."""
    q = path.partition("?")[2]
    if method == "PUT":
        return "PUT part" if "partNumber" in q else "PUT object"
    if method == "POST":
        return "POST create" if "uploads" in q else ("POST complete" if "uploadId" in q else "POST delete")
    if method == "GET":
        return "GET list" if ("list-type" in q or "uploads" in q or "delimiter" in q) else "GET object"
    return method


def timeline(log: list, t0: float) -> str:
    """Per request kind: count, first start, last end (s after t0), summed duration, bytes."""
    rows: dict[str, list] = {}
    for start, end, method, path, nin, nout in log:
        r = rows.setdefault(_kind(method, path), [0, 1e9, 0.0, 0.0, 0])
        r[0] += 1
        r[1] = min(r[1], start - t0)
        r[2] = max(r[2], end - t0)
        r[3] += end - start
        r[4] += nin + nout
    return "\n".join(f"    {k:<14}{n:>4} requests, {lo:6.2f}..{hi:6.2f} s, busy {busy:6.2f} s, {b / 2**20:7.1f} MiB"
                     for k, (n, lo, hi, busy, b) in sorted(rows.items(), key=lambda kv: kv[1][1]))


def _diff(a: dict, b: dict) -> dict:
    return {"requests": b.get("requests", 0) - a.get("requests", 0),
            "up": b.get("bytes_in_PUT", 0) + b.get("bytes_in_POST", 0)
            - a.get("bytes_in_PUT", 0) - a.get("bytes_in_POST", 0),
            "down": b.get("bytes_out_GET", 0) - a.get("bytes_out_GET", 0)}


def _floor_up(rank: int, nbytes: int, part: int) -> None:
    from hyperdcp.storage.object_store import ObjectStorage

    # the floor: plain parallel multipart uploads (single_put_bytes=0: multipart past one part)
    st = ObjectStorage("s3://bench/floor", {"single_put_bytes": 0}, part_bytes=part)
    data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20) + bytearray(nbytes % (1 << 20)))
    with st.begin_in_place(rank).create(f"r{rank:05d}-000000000000-00.safetensors") as w:
        w.write(data)  # the writer sends 4 parts at a time, as hyperdcp's saves do
    st.close()


def _floor_down(rank: int, part: int) -> None:
    from hyperdcp.storage.object_store import ObjectStorage

    st = ObjectStorage("s3://bench/floor", part_bytes=part)
    name = f"r{rank:05d}-000000000000-00.safetensors"
    buf = bytearray(st.size(name))
    st.read_into(name, 0, buf)  # ranged GETs of ``part`` bytes, 4 at a time
    st.close()


def _watch_phases(marks: list) -> None:
    """Note the time.monotonic() of a read-once load's phase boundaries in ``marks`` (this process only): the
    wrapped methods are hyperdcp's own, unchanged."""
    from hyperdcp.loading import read_once as ro

    def wrap(cls, name: str, before: str | None, after: str | None) -> None:
        fn = getattr(cls, name)

        def timed(*a, **kw):
            if before:
                marks.append((before, time.monotonic()))
            try:
                return fn(*a, **kw)
            finally:
                if after:
                    marks.append((after, time.monotonic()))
        setattr(cls, name, timed)

    wrap(ro._Exchange, "run", "planned", None)  # record, plan exchanges and schedule before it
    wrap(ro._Exchange, "_map_segments", None, "mapped")  # shared memory reserved and mapped
    wrap(ro._Exchange, "prepare", None, "read")  # this rank's GETs of a batch done and verified
    wrap(ro._Exchange, "transfer", "checked", "copied")  # the batch's check passed; pieces copied and moved
    wrap(ro._Exchange, "close", None, "closed")  # segments unmapped


def _rank(rank, world, args, endpoint, pids=()):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import hyperdcp

    R, S = args.mesh
    shapes = [(args.rows, args.cols)] * args.tensors
    hsdp = init_device_mesh("cpu", (R, S))
    flat = init_device_mesh("cpu", (world,))
    unique = sum(r * c * 4 for r, c in shapes)
    part = args.part_mib << 20
    results = {}

    libs = set(args.libs.split(","))
    marks: list = []  # (phase, time.monotonic()) of this rank's current case, with --phases
    if args.phases:
        _watch_phases(marks)

    def timed(key, fn, *a, **kw):
        if key[1] not in libs:
            return
        dist.barrier()
        before = _stats(endpoint) if rank == 0 else None
        cpu0 = [_cpu(p) for p in pids] if rank == 0 else []
        my0, flt0 = _cpu(os.getpid()), _minflt(os.getpid())
        if rank == 0 and args.profile:
            _proxy_log(endpoint)  # clear it
        peak_ok = base._reset_peak()
        rss0 = base._status_kib("VmRSS")
        prof = None
        if args.profile:
            import cProfile

            prof = cProfile.Profile()
        dist.barrier()
        marks.clear()
        t0, wall0, mono0 = time.perf_counter(), time.time(), time.monotonic()
        if prof is not None:
            prof.enable()
        fn(*a, **kw)
        if prof is not None:
            prof.disable()
        t_done = time.perf_counter() - t0
        my_cpu, my_flt = _cpu(os.getpid()) - my0, _minflt(os.getpid()) - flt0
        dist.barrier()
        wall = time.perf_counter() - t0
        peak = (base._status_kib("VmHWM") - rss0) * 1024 if peak_ok else -1
        server = _diff(before, _stats(endpoint)) if rank == 0 else None
        results[key] = {"wall": wall, "peak_extra": peak, "server": server, "done": t_done, "cpu": my_cpu,
                        "minflt": my_flt,
                        "cpu_others": [_cpu(p) - c for p, c in zip(pids, cpu0)],
                        "window": (mono0, mono0 + t_done), "phases": [(k, t - mono0) for k, t in marks]}
        if args.profile:
            tag = f"{key[0].replace(' ', '_')}-{key[1]}"
            prof.dump_stats(os.path.join(args.profile, f"{tag}-r{rank}.prof"))
            if rank == 0:
                log = _proxy_log(endpoint)
                with open(os.path.join(args.profile, f"{tag}-requests.json"), "w") as f:
                    json.dump([[a - wall0, b - wall0, *rest] for a, b, *rest in log], f)
                results[key]["timeline"] = timeline(log, wall0)

    src = base._state(hsdp, [Replicate(), Shard(0)], shapes, fill=True)
    # client sessions outside the timings, on every rank (a rank with nothing to write in a warm-up save
    # never makes its client; it would make it inside the timed save, 0.3-2 s on a loaded machine)
    from hyperdcp.storage.object_store import ObjectStorage

    ObjectStorage("s3://bench/warm").client  # noqa: B018 - made and cached for this process
    warm = {"warm": src[next(iter(src))]}
    hyperdcp.save(warm, "s3://bench/warm")
    hyperdcp.load(warm, "s3://bench/warm")  # and the load path's first imports
    if "torch" in libs:  # every rank writes its own file in torch's save: its s3fs session is made
        dcp.save(warm, storage_writer=FsspecWriter("s3://bench/warm-torch"))
        dcp.load(warm, storage_reader=FsspecReader("s3://bench/warm-torch"))
    timed(("save", "hyperdcp"), hyperdcp.save, src, "s3://bench/hyperdcp")
    timed(("save", "torch"), dcp.save, src, storage_writer=FsspecWriter("s3://bench/torch"))
    timed(("save", "floor"), _floor_up, rank, unique // world, part)
    del src
    cases = {"same_layout": (hsdp, [Replicate(), Shard(0)]), "1d_shard1": (flat, [Shard(1)])}
    cases = {k: v for k, v in cases.items() if k in args.loads.split(",")}
    for case, (mesh, placements) in cases.items():
        for lib in ("hyperdcp", "torch"):
            if lib not in libs:
                continue
            state = base._state(mesh, placements, shapes, fill=False)
            if lib == "hyperdcp":
                timed((f"load {case}", lib), hyperdcp.load, state, "s3://bench/hyperdcp",
                      read_once_batch_bytes=args.batch_mib << 20)
            else:
                timed((f"load {case}", lib), dcp.load, state, storage_reader=FsspecReader("s3://bench/torch"))
            base._check(state, shapes)
            del state
    timed(("load", "floor"), _floor_down, rank, part)
    return results


_CLIENT = r"""
import os, sys, time, json
sys.path.insert(0, {src!r})
from hyperdcp.storage.object_store import ObjectStorage
from hyperdcp.storage.object_client import make_client
def hwm(k):
    return int([l for l in open('/proc/self/status') if l.startswith(k + ':')][0].split()[1]) * 1024
n = {mib} << 20
data = memoryview(bytearray(os.urandom(1 << 20)) * {mib})
st = ObjectStorage('s3://bench/clients-{kind}', {{'client': '{kind}'}}, part_bytes={part})
c = st.client
open('/proc/self/clear_refs', 'w').write('5'); rss = hwm('VmRSS')
t = time.perf_counter()
with st.begin_in_place(0).create('r00000-000000000000-00.safetensors') as w:
    for i in range(0, n, 4 << 20):
        w.write(data[i:i + (4 << 20)])
up = time.perf_counter() - t
buf = bytearray(n); t = time.perf_counter()
st.read_into('r00000-000000000000-00.safetensors', 0, buf)
down = time.perf_counter() - t
assert buf == data
print(json.dumps({{'up_MBps': n / up / 1e6, 'down_MBps': n / down / 1e6,
                  'peak_extra_MiB': (hwm('VmHWM') - rss) / 2**20 - {mib}}}))
"""


def compare_clients(args, env) -> dict:
    out = {}
    for kind in ("s3fs", "obstore"):
        code = _CLIENT.format(src=os.path.join(_HERE, "..", "src"), mib=args.client_mib, kind=kind,
                              part=args.part_mib << 20)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                           timeout=600)
        out[kind] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-400:]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    base.add_experiment_args(ap)
    ap.add_argument("--part-mib", type=int, default=16, help="multipart part and ranged-GET size (MiB)")
    ap.add_argument("--clients", action="store_true", help="also compare the s3fs and obstore clients")
    ap.add_argument("--client-mib", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--libs", default="hyperdcp,torch,floor", help="which of hyperdcp,torch,floor to run")
    ap.add_argument("--loads", default="same_layout,1d_shard1", help="which loads to run")
    ap.add_argument("--profile", default=None, metavar="DIR", help="cProfile every rank and log every request into DIR")
    ap.add_argument("--phases", action="store_true",
                    help="print each case's time window and every rank's read-once phase times (s after its start)")
    args = ap.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    base.set_rows(args)
    from tests.dist import run_ranks
    from tests.faults.http_proxy import FaultProxy
    from tests.s3_server import S3Server

    server = S3Server.start()
    proxy = FaultProxy("127.0.0.1", server.port).start()
    proxy.keep_log = bool(args.profile)
    env = {**server.env_for(proxy.endpoint), "HYPERDCP_S3_PART_BYTES": str(args.part_mib << 20)}
    try:
        server.make_bucket("bench")
        load = os.getloadavg()
        t = time.perf_counter()
        res = run_ranks(args.ranks, _rank, args, proxy.endpoint, (server.proc.pid, os.getpid()), timeout=args.timeout,
                        env=env)
        unique = args.tensors * args.rows * args.cols * 4
        print(f"{args.ranks} ranks, HSDP mesh {tuple(args.mesh)}, "
              f"{args.tensors} x ({args.rows}, {args.cols}) float32 = "
              f"{unique / 2**20:.0f} MiB unique; moto {server.proc.args[2:]} behind a counting proxy on 127.0.0.1; "
              f"parts / ranged GETs of {args.part_mib} MiB; load average before: {load[0]:.1f}; run "
              f"{time.perf_counter() - t:.0f} s")
        print(f"{'case':<22}{'library':<10}{'wall s':>8}{'MB/s':>8}{'up/unique':>10}{'down/unique':>12}"
              f"{'requests':>9}{'peak extra MiB/rank':>21}")
        for key in res[0]:
            rows = [r[key] for r in res]
            wall = max(r["wall"] for r in rows)
            srv = rows[0]["server"]
            peak = max(r["peak_extra"] for r in rows) / 2**20
            print(f"{key[0]:<22}{key[1]:<10}{wall:>8.2f}{unique / wall / 1e6:>8.1f}{srv['up'] / unique:>10.3f}"
                  f"{srv['down'] / unique:>12.3f}{srv['requests']:>9d}{peak:>21.0f}")
            moto, px = rows[0]["cpu_others"]
            print(f"    CPU s: ranks {sum(r['cpu'] for r in rows):.2f} (max {max(r['cpu'] for r in rows):.2f}), "
                  f"moto {moto:.2f}, proxy {px:.2f}; ranks' minor page faults {sum(r['minflt'] for r in rows)}")
            if args.phases:
                print(f"    window (CLOCK_MONOTONIC, for perf report --time): "
                      f"{min(r['window'][0] for r in rows):.6f},{max(r['window'][1] for r in rows):.6f}")
                for rank, r in enumerate(rows):
                    if r["phases"]:
                        print(f"    rank {rank}: " + " ".join(f"{k} {t:.3f}" for k, t in r["phases"]))
            if rows[0].get("timeline"):
                done = sorted(r["done"] for r in rows)
                print(f"    ranks returned after {done[0]:.2f}..{done[-1]:.2f} s\n" + rows[0]["timeline"])
        if args.clients:
            for kind, r in compare_clients(args, env).items():
                print(f"client {kind:<8} {args.client_mib} MiB, one process: "
                      + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    finally:
        proxy.stop()
        server.stop()


if __name__ == "__main__":
    main()
