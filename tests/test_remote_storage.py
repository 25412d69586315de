"""Loading from URLs through fsspec (read side only), without a network.

Protocols: ``file://`` (the local reader), ``memory://`` (fsspec's in-process file system: the remote
reader with no extra package) and ``http://`` from a threaded stdlib server on 127.0.0.1 with Range
support (only when aiohttp, which fsspec's HTTP file system needs, is importable). Checked bit-exact
against the reference tensors, with the bytes read counted by the storage layer and by the server.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

torch = pytest.importorskip("torch")
fsspec = pytest.importorskip("fsspec")

import hyperdcp  # noqa: E402
from hyperdcp.sources.remote import RemoteFiles, is_remote, local_path  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.layouts import GLOBAL, REPLICATED, VALUES, check_state, full, make_state  # noqa: E402

try:
    import aiohttp
except ImportError:
    aiohttp = None
HAS_AIOHTTP = aiohttp is not None
needs_http = pytest.mark.skipif(not HAS_AIOHTTP, reason="fsspec's HTTP file system needs aiohttp")
NAMES = list(GLOBAL) + list(REPLICATED)


# -- a threaded HTTP server with Range support, counting the body bytes it sends per path -----------
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        root = self.server.root  # type: ignore[attr-defined]
        local = os.path.realpath(os.path.join(root, rel))
        if not local.startswith(root + os.sep) or not os.path.isfile(local):
            self.send_error(404)
            return
        size = os.path.getsize(local)
        start, end, status = 0, size, 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if m is None or int(m[1]) >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, end, status = int(m[1]), min(size, int(m[2]) + 1) if m[2] else size, 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if head:
            return
        with open(local, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        self.wfile.write(data)
        with self.server.lock:  # type: ignore[attr-defined]
            self.server.sent[rel] = self.server.sent.get(rel, 0) + len(data)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return os.path.realpath(str(tmp_path_factory.mktemp("remote")))


@pytest.fixture(scope="module")
def server(root):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.root, srv.sent, srv.lock = root, {}, threading.Lock()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def _full_state(zeros: bool = False) -> dict:
    model = {n.split(".", 1)[1]: (torch.zeros_like(full(n)) if zeros else full(n)) for n in NAMES}
    return {"model": model, **{k: (None if zeros else v) for k, v in VALUES.items()}}


def _check_full(state: dict) -> None:
    for n in NAMES:
        got, want = state["model"][n.split(".", 1)[1]], full(n)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), n
    for k, v in VALUES.items():
        assert state[k] == v and type(state[k]) is type(v), k


@pytest.fixture(scope="module")
def ckpt(root) -> str:
    """A checkpoint saved by one process (one chunk per tensor), under the served directory."""
    path = os.path.join(root, "ckpt")
    hyperdcp.save(_full_state(), path)
    return path


def _to_memory(local_dir: str, name: str) -> str:
    """Copy a checkpoint into this process's fsspec memory file system; its memory:// URL."""
    fs = fsspec.filesystem("memory")
    for e in os.listdir(local_dir):
        with open(os.path.join(local_dir, e), "rb") as f:
            fs.pipe_file(f"/{name}/{e}", f.read())
    return f"memory://{name}"


def _copy(ckpt: str, root: str, name: str) -> str:
    dst = os.path.join(root, name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ckpt, dst)
    return dst


def _url(kind: str, ckpt: str, server=None, name: str = "") -> str:
    if kind == "file":
        return "file://" + ckpt
    if kind == "memory":
        return _to_memory(ckpt, name or os.path.basename(ckpt))
    return f"{server.url}/{os.path.relpath(ckpt, server.root)}"


KINDS = ["file", "memory", pytest.param("http", marks=needs_http)]


def test_is_remote_and_local_paths():
    assert is_remote("s3://bucket/ckpt") and is_remote("https://h/ckpt") and is_remote("memory://x")
    assert is_remote("simplecache::s3://bucket/ckpt")
    assert not any(is_remote(p) for p in ("ckpt/step-1", "/abs/ckpt", "file:///abs/ckpt", "local:///abs", "C:\\ckpt"))
    assert local_path("file:///tmp/x") == "/tmp/x" and local_path("ckpt/step-1") == "ckpt/step-1"


@pytest.mark.parametrize("kind", KINDS)
def test_single_process_load_bit_exact(kind, ckpt, request):
    server = request.getfixturevalue("server") if kind == "http" else None
    url = _url(kind, ckpt, server, name=f"single-{kind}")
    assert hyperdcp.read_metadata(url).to_json() == hyperdcp.read_metadata(ckpt).to_json()
    state = _full_state(zeros=True)
    res = hyperdcp.load(state, url)
    _check_full(state)
    assert res.bytes_read == hyperdcp.read_metadata(ckpt).tensor_bytes and res.path == url


@needs_http
def test_http_fetches_only_requested_bytes(ckpt, server):
    """Server side: the data files sent exactly the tensor bytes plus each file's header, once."""
    meta = hyperdcp.read_metadata(ckpt)
    headers = 0
    for f in meta.files:
        with open(os.path.join(ckpt, f.name), "rb") as fh:
            headers += 8 + int.from_bytes(fh.read(8), "little")
    with server.lock:
        server.sent.clear()
    hyperdcp.load(_full_state(zeros=True), _url("http", ckpt, server))
    with server.lock:
        sent = dict(server.sent)
    data = sum(n for p, n in sent.items() if p.endswith(".safetensors"))
    assert data == meta.tensor_bytes + headers
    assert sent["ckpt/hyperdcp.json"] == os.path.getsize(os.path.join(ckpt, "hyperdcp.json"))


def _hsdp(name, nd):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate(), Shard(0)]


def _rank_loads(rank, world, urls, ckpt):
    """Per URL: a same-layout HSDP load and a column reshard, both read-once; bytes read per load."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    out = {}
    hsdp, flat = init_device_mesh("cpu", (2, 2)), init_device_mesh("cpu", (world,))
    for kind, url in urls.items():
        if kind == "memory":
            url = _to_memory(ckpt, "ranks")  # each rank's own in-process copy
        state = make_state(hsdp, _hsdp, zeros=True)
        out[(kind, "same")] = hyperdcp.load(state, url, read_once=True).bytes_read
        check_state(state)
        state = make_state(flat, lambda name, nd: [Shard(nd - 1)], zeros=True)
        out[(kind, "cols")] = hyperdcp.load(state, url, read_once=True).bytes_read
        check_state(state)
    return out


def test_multi_rank_read_once_from_urls(ckpt, request):
    urls = {"memory": "", "file": _url("file", ckpt)}
    if HAS_AIOHTTP:
        urls["http"] = _url("http", ckpt, request.getfixturevalue("server"))
    res = run_ranks(4, _rank_loads, urls, ckpt, timeout=120)
    unique = hyperdcp.read_metadata(ckpt).tensor_bytes
    for key in res[0]:
        assert sum(r[key] for r in res) == unique, key  # each stored byte read once cluster-wide


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_or_missing_data_file(kind, ckpt, root, request):
    server = request.getfixturevalue("server") if kind == "http" else None
    meta = hyperdcp.read_metadata(ckpt)
    name = meta.files[0].name
    bad = _copy(ckpt, root, f"truncated-{kind}")
    with open(os.path.join(bad, name), "r+b") as f:
        f.truncate(meta.files[0].nbytes - 4)
    with pytest.raises(hyperdcp.CorruptionError, match=re.escape(name) + ".*truncated"):
        hyperdcp.load(_full_state(zeros=True), _url(kind, bad, server, name=f"truncated-{kind}"))
    os.unlink(os.path.join(bad, name))
    with pytest.raises(hyperdcp.CorruptionError, match=re.escape(name) + " is missing"):
        hyperdcp.load(_full_state(zeros=True), _url(kind, bad, server, name=f"missing-{kind}"))


def test_short_read_after_the_size_check(ckpt, root):
    """A file cut short between its check and a read: CorruptionError naming the file, bytes counted."""
    bad = _copy(ckpt, root, "shrinking")
    meta = hyperdcp.read_metadata(bad)
    url = _to_memory(bad, "shrinking")
    files = RemoteFiles(url, meta, max_request_bytes=64)
    t = meta.tensors["model.w1"]
    fidx, begin, end = int(t.chunks.file[0]), int(t.chunks.begin[0]), int(t.chunks.end[0])
    files.fd(fidx)  # size and header checked
    fsspec.filesystem("memory").pipe_file(f"/shrinking/{meta.files[fidx].name}", b"x" * (begin + 100))
    buf = bytearray(end - begin)
    with pytest.raises(hyperdcp.CorruptionError, match=re.escape(files.path(fidx)) + ": unexpected end of file"):
        files.read_into(fidx, begin, buf, "model.w1")
    assert files.bytes_read == 100 and files.requests == 4  # header checks (8 bytes, the header) + 64 + 36 bytes
    files.close()


@pytest.mark.parametrize("kind", ["memory", pytest.param("http", marks=needs_http)])
def test_missing_or_incomplete_checkpoint_url(kind, ckpt, root, request):
    server = request.getfixturevalue("server") if kind == "http" else None
    with pytest.raises(hyperdcp.CheckpointNotFoundError, match="hyperdcp.json does not exist"):
        hyperdcp.read_metadata(_url(kind, os.path.join(root, "nowhere"), server) if kind == "http" else "memory://nowhere")
    if kind == "memory":
        inc = _copy(ckpt, root, "incomplete")
        os.unlink(os.path.join(inc, "hyperdcp.json"))
        with pytest.raises(hyperdcp.IncompleteCheckpointError, match="memory://incomplete"):
            hyperdcp.load(_full_state(zeros=True), _url(kind, inc))


@needs_http
def test_unreachable_server_is_a_storage_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    url = f"http://127.0.0.1:{port}/ckpt"
    with pytest.raises(hyperdcp.StorageError, match=re.escape(url) + ".*check the URL, the network"):
        hyperdcp.read_metadata(url)


def test_save_to_url_is_refused(tmp_path):
    for url in ("http://127.0.0.1:1/ckpt", "memory://ckpt"):  # s3:// URLs save (issue 14: tests/test_s3_*.py)
        with pytest.raises(hyperdcp.UnsupportedStorageError, match="not supported yet.*upload"):
            hyperdcp.save(_full_state(), url)
        with pytest.raises(hyperdcp.UnsupportedStorageError, match="not supported yet"):
            hyperdcp.async_save(_full_state(), url)
    assert issubclass(hyperdcp.UnsupportedStorageError, hyperdcp.StorageError)
    # file:// URLs are local paths
    hyperdcp.save(_full_state(), "file://" + str(tmp_path / "c"))
    state = _full_state(zeros=True)
    hyperdcp.load(state, str(tmp_path / "c"))
    _check_full(state)
