"""A real HTTP proxy in front of the S3 server that counts traffic and injects faults.

    proxy = FaultProxy("127.0.0.1", upstream_port, fault_rate=0.2, seed=1).start()   # its own thread
    proxy.endpoint                  # http://127.0.0.1:<port>: give it to the client as AWS_ENDPOINT_URL
    proxy.stats                     # requests and body bytes per method, faults injected per kind
    proxy.stop()

For a fraction ``fault_rate`` of requests (deterministic for a seed; the kinds in turn) it answers 503 SlowDown or 500
InternalError without forwarding, resets the connection before forwarding, forwards and then resets
(the request took effect, the answer is lost), or sends half of the answer's body and resets. The rest
is forwarded unchanged (``kinds=("stall",)``, never among the defaults: held unanswered instead). Bodies
are read whole (``Content-Length`` or chunked) and forwarded with a
``Content-Length``. ``match(method, path)`` limits the faults to some requests (one part of an upload).
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: GET this path on the proxy for its counters as JSON
STATS_PATH = "/__proxy_stats"
#: GET this path for the request log as JSON (and clear it): [start, end, method, path, bytes in, bytes out],
#: times from time.time(); kept only while ``FaultProxy.keep_log`` is set (benchmark profiles)
LOG_PATH = "/__proxy_log"
KINDS = ("503", "500", "reset_before", "reset_after", "cut_body")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _handle(self) -> None:
        px = self.server.proxy
        body = self._body()
        if self.path == STATS_PATH:  # the counters, for benchmark ranks in other processes (not forwarded)
            with px.lock:
                data = json.dumps(dict(px.stats)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if self.path == LOG_PATH:
            with px.lock:
                data, px.log = json.dumps(px.log).encode(), []
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        t_start = time.time()
        fault = px.pick(self.command, self.path)
        with px.lock:
            px.stats["requests"] += 1
            px.stats[f"requests_{self.command}"] += 1
            px.stats[f"bytes_in_{self.command}"] += len(body)
            if fault:
                px.stats[f"fault_{fault}"] += 1
        if fault in ("503", "500"):
            code, err = (503, "SlowDown") if fault == "503" else (500, "InternalError")
            msg = f"<?xml version='1.0'?><Error><Code>{err}</Code><Message>injected</Message></Error>".encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        if fault == "reset_before":
            return self._reset()
        if fault == "stall":  # never answer (a hung server or a lost connection): until stop() or stall_seconds
            px._stopped.wait(px.stall_seconds)
            return self._reset()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(px.upstream_host, px.upstream_port, timeout=60)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        with px.lock:
            px.stats[f"bytes_out_{self.command}"] += len(data)
            if px.keep_log:
                px.log.append([t_start, time.time(), self.command, self.path, len(body), len(data)])
        if fault == "reset_after" or (fault == "cut_body" and len(data) < 2):  # nothing to cut: lose the answer
            return self._reset()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if fault == "cut_body":
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            return self._reset()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: "FaultProxy"


class FaultProxy:
    """See the module docstring. ``kinds``: which faults to inject (default: all)."""

    def __init__(self, upstream_host: str, upstream_port: int, fault_rate: float = 0.0, seed: int = 0,
                 kinds: tuple[str, ...] = KINDS, match=None):
        self.upstream_host, self.upstream_port = upstream_host, upstream_port
        self.fault_rate, self.kinds = fault_rate, kinds
        #: ``match(method, path) -> bool``: only matching requests may be faulted (None: every request)
        self.match = match
        #: fault every n-th (matching) request instead of a random fraction (0: use ``fault_rate``)
        self.fault_every = 0
        self._seen = 0
        self._rng = random.Random(seed)
        self._faults = 0
        self.lock = threading.Lock()
        self.stats: Counter = Counter()
        #: how long a "stall" fault holds the request without an answer (opt-in: ``kinds=("stall",)``)
        self.stall_seconds = 30.0
        self._stopped = threading.Event()
        #: keep a log of the forwarded requests (served at LOG_PATH)
        self.keep_log = False
        self.log: list[list] = []
        self._srv = _Server(("127.0.0.1", 0), _Handler)
        self._srv.proxy = self
        self.port = self._srv.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._srv.serve_forever, name="fault-proxy", daemon=True)

    def pick(self, method: str = "", path: str = "") -> str | None:
        if self.match is not None and not self.match(method, path):
            return None
        with self.lock:
            self._seen += 1
            hit = (self._seen % self.fault_every == 0) if self.fault_every else self._rng.random() < self.fault_rate
            if hit and (self.fault_rate or self.fault_every):
                self._faults += 1
                return self.kinds[self._faults % len(self.kinds)]  # in turn: a few faults meet every kind
        return None

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def reset_stats(self) -> None:
        with self.lock:
            self.stats.clear()

    def stop(self) -> None:
        self._stopped.set()
        self._srv.shutdown()
        self._srv.server_close()
