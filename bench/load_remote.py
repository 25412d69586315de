"""Remote (HTTP) load: hyperdcp (read-once, URL path) vs torch.distributed.checkpoint's FsspecReader.

The experiment of ``bench/load.py`` (same state, same HSDP save on a (R, S) mesh, loads (a) in the same
layout and (b) as 1-D [Shard(1)] over all ranks, element-exact checks), but the ranks load over HTTP
from a server on 127.0.0.1 serving the directory of both checkpoints, so every byte a rank reads is a
request the server answers (no page cache shared between the readers). The server is nginx when
``/usr/sbin/nginx`` exists (its access log records ``$bytes_sent`` and ``$body_bytes_sent`` per
request), else a threaded Python server writing the same log. For every load it reports:

* server-side read amplification: body bytes the server sent for the checkpoint's files (summed over
  ranks, from the access log) / the checkpoint's unique bytes; also with HTTP response headers;
* hyperdcp's own count (``LoadResult.bytes_read``: data bytes requested, excluding file headers);
* requests served, wall time (slowest rank, between barriers), peak extra host memory per rank
  (VmHWM - VmRSS before the load), and the hyperdcp/torch wall-time ratio per case.

Before each load the checkpoint files are evicted from the page cache with posix_fadvise(DONTNEED)
(not the global drop_caches of ``bench/load.py``, so other work on the machine keeps its cache).
torch reads through ``FsspecReader(url)`` with fsspec's defaults for HTTP (row ``torch``: a 5 MiB
read-ahead "bytes" cache per file stream, which torch.load's access pattern -- each item a zip whose
directory is read at its end, several items per file through one stream -- makes re-fetch ranges), and
with ``FsspecReader(url, cache_type="none")`` (row ``torch-nc``: every read its own ranged request).

    python bench/load_remote.py --ranks 8 --mesh 4 2 --mib 1024
    python bench/load_remote.py --mib 256 --server python --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))
sys.path.insert(0, _HERE)

import load as base  # noqa: E402  (bench/load.py: state, checks, cache dropping, memory counters)

NGINX = "/usr/sbin/nginx"


# -- servers -------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen | None = None, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class NginxServer:
    """nginx in the foreground with its configuration, logs and temp paths in a temporary directory."""

    def __init__(self, root: str, workers: int):
        self.root, self.port = root, _free_port()
        self.dir = tempfile.mkdtemp(prefix="hyperdcp-nginx-")
        self.log = os.path.join(self.dir, "access.log")
        tmp = {k: os.path.join(self.dir, k) for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
        user = "user root;\n" if os.geteuid() == 0 else ""  # workers must read the (0700) temp directory
        conf = f"""{user}worker_processes {workers};
daemon off;
pid {self.dir}/nginx.pid;
error_log {self.dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    log_format hdcp '$request_method $uri $status $bytes_sent $body_bytes_sent';
    access_log {self.log} hdcp;
    client_body_temp_path {tmp['client_body']};
    proxy_temp_path {tmp['proxy']};
    fastcgi_temp_path {tmp['fastcgi']};
    uwsgi_temp_path {tmp['uwsgi']};
    scgi_temp_path {tmp['scgi']};
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    server {{
        listen 127.0.0.1:{self.port};
        root {root};
        location / {{ autoindex off; }}
    }}
}}
"""
        self.conf = os.path.join(self.dir, "nginx.conf")
        with open(self.conf, "w") as f:
            f.write(conf)
        open(self.log, "w").close()
        version = subprocess.run([NGINX, "-v"], capture_output=True, text=True).stderr.strip()
        self.name = f"{version.replace('nginx version: ', '')} ({workers} workers, sendfile)"
        self.proc = subprocess.Popen([NGINX, "-p", self.dir, "-e", os.path.join(self.dir, "error.log"),
                                      "-c", self.conf],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait_listening(self.port, self.proc)
        except RuntimeError as e:
            err = self.proc.stderr.read().decode() if self.proc.poll() is not None else ""
            self.close()
            raise RuntimeError(f"nginx did not start: {e} {err}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class _Handler(BaseHTTPRequestHandler):
    """GET/HEAD of files under the server's root with single byte ranges; one log line per request."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _log(self, status: int, header_bytes: int, body: int) -> None:
        with self.server.lock:  # type: ignore[attr-defined]
            self.server.logf.write(f"{self.command} {self.uri} {status} {header_bytes + body} {body}\n")  # type: ignore[attr-defined]
            self.server.logf.flush()  # type: ignore[attr-defined]

    def _headers(self, status: int, fields: dict[str, str]) -> int:
        self.send_response(status)
        for k, v in fields.items():
            self.send_header(k, v)
        n = sum(len(b) for b in getattr(self, "_headers_buffer", []))
        self.end_headers()
        return n + 2

    def _serve(self, head: bool) -> None:
        self.uri = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        root = self.server.root  # type: ignore[attr-defined]
        local = os.path.realpath(os.path.join(root, self.uri.lstrip("/")))
        if not local.startswith(root + os.sep) or not os.path.isfile(local):
            h = self._headers(404, {"Content-Length": "0"})
            self._log(404, h, 0)
            return
        size = os.path.getsize(local)
        start, end, status = 0, size, 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if m is None or int(m[1]) >= size:
                h = self._headers(416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"})
                self._log(416, h, 0)
                return
            start, end, status = int(m[1]), min(size, int(m[2]) + 1) if m[2] else size, 206
        fields = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                  "Content-Length": str(end - start)}
        if status == 206:
            fields["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        h = self._headers(status, fields)
        sent = 0
        if not head and end > start:
            with open(local, "rb") as f:
                sent = self.connection.sendfile(f, start, end - start)
        self._log(status, h, sent)


class PythonServer:
    """A threaded stdlib HTTP server (sendfile for bodies) in this process, logging like the nginx one."""

    def __init__(self, root: str):
        self.dir = tempfile.mkdtemp(prefix="hyperdcp-httpd-")
        self.log = os.path.join(self.dir, "access.log")
        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.srv.daemon_threads = True
        self.srv.root, self.srv.lock, self.srv.logf = os.path.realpath(root), threading.Lock(), open(self.log, "w")
        self.port = self.srv.server_address[1]
        self.name = "python http.server (threaded, sendfile)"
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()
        _wait_listening(self.port)

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()
        self.srv.logf.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def read_log(log: str, offset: int) -> tuple[dict[str, dict[str, int]], int]:
    """Per top-level directory (checkpoint): body bytes, bytes with headers and requests logged after ``offset``."""
    out: dict[str, dict[str, int]] = {}
    with open(log, "rb") as f:
        f.seek(offset)
        data = f.read()
    for line in data.decode().splitlines():
        _, uri, _, total, body = line.split()
        top = uri.lstrip("/").split("/", 1)[0]
        s = out.setdefault(top, {"body": 0, "total": 0, "requests": 0})
        s["body"] += int(body)
        s["total"] += int(total)
        s["requests"] += 1
    return out, offset + len(data)


def evict(dirs: list[str]) -> str:
    """Drop the checkpoints' files from the page cache (posix_fadvise DONTNEED): only our files, so
    other work on the machine keeps its cache (``bench/load.py`` drops every cache where permitted)."""
    os.sync()
    base.evict_files(dirs)
    return "fadvise(DONTNEED) of the checkpoint files"


# -- ranks ---------------------------------------------------------------------------------------------
def _rank(rank, world, args, root, base_url, log):
    import fsspec.core
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # not re-exported in 2.13
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import hyperdcp

    R, S = args.mesh
    shapes = [(args.rows, args.cols)] * args.tensors
    hsdp = init_device_mesh("cpu", (R, S))
    flat = init_device_mesh("cpu", (world,))
    hp, tp = os.path.join(root, "hyperdcp"), os.path.join(root, "torch")
    src = base._state(hsdp, [Replicate(), Shard(0)], shapes, fill=True)
    hyperdcp.save(src, hp)
    dcp.save(src, checkpoint_id=tp)
    del src
    dist.barrier()
    urls = {"hyperdcp": f"{base_url}/hyperdcp", "torch": f"{base_url}/torch", "torch-nc": f"{base_url}/torch"}
    # warm-up outside the timed loads: aiohttp's import, fsspec's event loop and HTTP session (shared by both)
    fsspec.core.url_to_fs(base_url)[0].info(f"{urls['hyperdcp']}/hyperdcp.json")
    cases = {"a_same_layout": (hsdp, [Replicate(), Shard(0)]), "b_1d_shard1": (flat, [Shard(1)])}
    results = {}
    for case, (mesh, placements) in cases.items():
        for lib in ["hyperdcp", "torch"] + ([] if args.no_torch_nocache else ["torch-nc"]):
            state = base._state(mesh, placements, shapes, fill=False)
            dist.barrier()
            method, offset = "", 0
            if rank == 0:
                method = evict([hp, tp])
                offset = os.path.getsize(log)
            dist.barrier()
            peak_ok = base._reset_peak()
            rss0 = base._status_kib("VmRSS")
            dist.barrier()
            t0 = time.perf_counter()
            counted = None
            if lib == "hyperdcp":
                counted = hyperdcp.load(state, urls[lib], read_once=True,
                                        read_once_batch_bytes=args.batch_mib << 20).bytes_read
            elif lib == "torch":
                dcp.load(state, storage_reader=FsspecReader(urls[lib]))
            else:  # no read-ahead cache: every read of torch.load is its own ranged request
                dcp.load(state, storage_reader=FsspecReader(urls[lib], cache_type="none"))
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            peak = (base._status_kib("VmHWM") - rss0) * 1024 if peak_ok else -1
            base._check(state, shapes)
            server = None
            if rank == 0:
                time.sleep(0.5)  # the server logs a request once its response is out
                top = "hyperdcp" if lib == "hyperdcp" else "torch"
                server = read_log(log, offset)[0].get(top, {"body": 0, "total": 0, "requests": 0})
            results[(case, lib)] = {"seconds": t1 - t0, "seconds_to_barrier": t2 - t0, "counted": counted,
                                    "peak_extra": peak, "cache": method, "server": server}
            del state
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    base.add_experiment_args(ap)
    ap.add_argument("--server", choices=("auto", "nginx", "python"), default="auto",
                    help=f"auto: nginx if {NGINX} exists, else the Python server")
    ap.add_argument("--workers", type=int, default=4, help="nginx worker processes")
    ap.add_argument("--no-torch-nocache", action="store_true",
                    help="skip the torch-nc row (FsspecReader with cache_type='none')")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    base.set_rows(args)
    import importlib.util

    if importlib.util.find_spec("aiohttp") is None:
        sys.exit("bench/load_remote.py needs aiohttp for fsspec's HTTP file system: pip install aiohttp")
    root = os.path.realpath(tempfile.mkdtemp(prefix="hyperdcp-bench-remote-", dir=args.dir))
    sys.path.insert(0, os.path.join(_HERE, ".."))
    from tests.dist import run_ranks

    use_nginx = args.server == "nginx" or (args.server == "auto" and os.path.exists(NGINX))
    server = NginxServer(root, args.workers) if use_nginx else PythonServer(root)
    try:
        t = time.perf_counter()
        res = run_ranks(args.ranks, _rank, args, root, f"http://127.0.0.1:{server.port}", server.log,
                        timeout=args.timeout)
        import hyperdcp

        unique = hyperdcp.read_metadata(os.path.join(root, "hyperdcp")).tensor_bytes
        first = res[0][next(iter(res[0]))]
        print(f"{args.ranks} ranks, HSDP mesh {tuple(args.mesh)} save, {args.tensors} x ({args.rows}, {args.cols}) "
              f"float32 = {unique / 2**20:.0f} MiB unique; over HTTP from {server.name} on 127.0.0.1; server cache: "
              f"{first['cache']}; hyperdcp read-once, read_once_batch_bytes {args.batch_mib} MiB; torch: FsspecReader "
              "(fsspec defaults: 5 MiB read-ahead), torch-nc: FsspecReader(cache_type='none'); total run "
              f"{time.perf_counter() - t:.0f} s")
        print(f"{'case':<16}{'library':<11}{'ampl(server)':>13}{'ampl(+hdrs)':>12}{'ampl(counted)':>14}{'requests':>9}"
              f"{'wall s':>8}{'peak extra MiB (max/rank)':>27}")
        report, walls = {}, {}
        for key in res[0]:
            case, lib = key
            rows = [r[key] for r in res]
            srv = rows[0]["server"]
            counted = sum(r["counted"] for r in rows) / unique if rows[0]["counted"] is not None else float("nan")
            wall = max(r["seconds_to_barrier"] for r in rows)
            peak = max(r["peak_extra"] for r in rows) / 2**20
            walls[key] = wall
            print(f"{case:<16}{lib:<11}{srv['body'] / unique:>13.3f}{srv['total'] / unique:>12.3f}{counted:>14.3f}"
                  f"{srv['requests']:>9}{wall:>8.2f}{peak:>27.0f}")
            report[f"{case}/{lib}"] = {"ampl_server": srv["body"] / unique,
                                       "ampl_server_with_headers": srv["total"] / unique,
                                       "ampl_counted": counted, "requests": srv["requests"], "wall_s": wall,
                                       "peak_extra_mib_max": peak, "per_rank": rows}
        for case in dict.fromkeys(c for c, _ in res[0]):
            print(f"{case}: wall time " + ", ".join(f"hyperdcp/{t} = {walls[(case, 'hyperdcp')] / walls[(case, t)]:.3f}"
                                                   for t in ("torch", "torch-nc") if (case, t) in walls))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
    finally:
        server.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
