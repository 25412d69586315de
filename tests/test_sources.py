"""Sources: every kind of checkpoint that hyperdcp reads (a hyperdcp directory or URL, a HuggingFace
``.safetensors`` file, model directory or hub cache snapshot) opens through ``open_source`` and works
with ``read_metadata``, ``verify_checkpoint``, ``load`` and the ``inspect``/``verify``/``diff`` commands.

States are numpy arrays written with the safetensors library (HF) or ``hyperdcp.save``; URLs are served
by a loopback HTTP server with Range support (tests/test_remote_storage.py's handler).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from http.server import ThreadingHTTPServer

import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

import hyperdcp  # noqa: E402
from hyperdcp.cli import main as cli_main  # noqa: E402
from hyperdcp.sources import open_source, source_from_bytes  # noqa: E402


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "embed.weight": rng.standard_normal((7, 4)).astype(np.float32),
        "head.bias": np.arange(5, dtype=np.int64),
        "ln.scale": rng.standard_normal(3).astype(np.float16),
    }


WEIGHTS = _weights()
SHARDS = [["embed.weight"], ["head.bias", "ln.scale"]]


def _zeros() -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) for k, v in WEIGHTS.items()}


def _assert_weights(state: dict) -> None:
    assert sorted(state) == sorted(WEIGHTS)
    for k, v in WEIGHTS.items():
        assert state[k].dtype == v.dtype and state[k].shape == v.shape and np.array_equal(state[k], v), k


def _write_sharded(d: str) -> dict[str, str]:
    """The two shards and an index under ``d``; the file names."""
    os.makedirs(d, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-00002.safetensors" for i in range(2)]
    for name, part in zip(names, SHARDS):
        safetensors_numpy.save_file({k: WEIGHTS[k] for k in part}, os.path.join(d, name), metadata={"format": "np"})
    wm = {k: names[i] for i, part in enumerate(SHARDS) for k in part}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return {n: os.path.join(d, n) for n in [*names, "model.safetensors.index.json"]}


def _hub_snapshot(cache: str, repo: str = "models--org--tiny", rev: str = "0123abcd") -> str:
    """The hub cache layout: files in ``<repo>/blobs/<sha256>``, ``snapshots/<rev>/<name>`` links to them."""
    staging = os.path.join(cache, ".staging")
    files = _write_sharded(staging)
    blobs, snap = os.path.join(cache, repo, "blobs"), os.path.join(cache, repo, "snapshots", rev)
    os.makedirs(blobs)
    os.makedirs(snap)
    for name, path in files.items():
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
        os.rename(path, os.path.join(blobs, digest))
        os.symlink(os.path.join("..", "..", "blobs", digest), os.path.join(snap, name))  # relative, as the hub does
    shutil.rmtree(staging)
    return snap


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Range-capable HTTP server on 127.0.0.1 serving a fresh directory; (root, base URL)."""
    from tests.test_remote_storage import HAS_AIOHTTP, _Handler

    if not HAS_AIOHTTP:
        pytest.skip("fsspec's HTTP file system needs aiohttp")
    root = os.path.realpath(str(tmp_path_factory.mktemp("served")))
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.root, srv.sent, srv.lock = root, {}, threading.Lock()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _source(kind: str, tmp_path, served=None) -> str:
    """A checkpoint of ``kind`` holding WEIGHTS; its path or URL."""
    if kind == "hf-file":
        path = str(tmp_path / "one.safetensors")
        safetensors_numpy.save_file(WEIGHTS, path, metadata={"format": "np"})
        return path
    if kind == "hf-dir":
        d = tmp_path / "hf"
        d.mkdir()
        safetensors_numpy.save_file(WEIGHTS, str(d / "model.safetensors"), metadata={"format": "np"})
        return str(d)
    if kind == "hf-sharded":
        _write_sharded(str(tmp_path / "hf-sharded"))
        return str(tmp_path / "hf-sharded")
    if kind == "hub-snapshot":
        return _hub_snapshot(str(tmp_path / "hub"))
    if kind == "hyperdcp":
        hyperdcp.save(dict(WEIGHTS), str(tmp_path / "ck"))
        return str(tmp_path / "ck")
    assert kind == "http"
    root, url = served
    name = f"ck-{tmp_path.name}"
    hyperdcp.save(dict(WEIGHTS), os.path.join(root, name))
    return f"{url}/{name}"


KINDS = ["hyperdcp", "http", "hf-file", "hf-dir", "hf-sharded", "hub-snapshot"]


@pytest.fixture
def make(tmp_path, request):
    def make(kind: str) -> str:
        return _source(kind, tmp_path, request.getfixturevalue("served") if kind == "http" else None)

    return make


# -- read_metadata, load, verify on every kind ------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_reads_loads_and_verifies(make, kind):
    path = make(kind)
    src = open_source(path)
    assert src.kind == ("hyperdcp" if kind in ("hyperdcp", "http") else "huggingface")
    assert src.verifiable == (src.kind == "hyperdcp")
    meta = hyperdcp.read_metadata(path)
    assert {k: (t.dtype, tuple(t.shape)) for k, t in meta.tensors.items()} == {
        "embed.weight": ("F32", (7, 4)), "head.bias": ("I64", (5,)), "ln.scale": ("F16", (3,))}
    state = _zeros()
    res = hyperdcp.load(state, path)
    _assert_weights(state)
    assert res.bytes_read == meta.tensor_bytes
    rep = hyperdcp.verify_checkpoint(path, threads=2)
    assert rep.ok, (rep.file_errors, rep.bad_chunks)
    assert rep.kind == src.kind and rep.checksums == src.verifiable and rep.files == len(meta.files)
    # hyperdcp sources: every stored byte hashed; HF sources carry no checksums: structure and sizes only
    assert rep.bytes_checked == (meta.tensor_bytes if src.verifiable else 0)


def test_verify_reports_damage_over_http(make, served):
    url = make("http")
    root, base = served
    local = os.path.join(root, url[len(base) + 1:])
    meta = hyperdcp.read_metadata(local)
    f = os.path.join(local, meta.files[0].name)
    t = meta.tensors["embed.weight"]
    with open(f, "r+b") as fh:  # flip one byte inside embed.weight
        fh.seek(int(t.chunks.begin[0]) + 5)
        b = fh.read(1)
        fh.seek(int(t.chunks.begin[0]) + 5)
        fh.write(bytes([b[0] ^ 0xFF]))
    rep = hyperdcp.verify_checkpoint(url, threads=2)
    assert not rep.ok and [b.tensor for b in rep.bad_chunks] == ["embed.weight"]


def test_verify_reports_a_truncated_hf_shard(make):
    d = make("hf-sharded")
    shard = os.path.join(d, "model-00002-of-00002.safetensors")
    os.truncate(shard, os.path.getsize(shard) - 3)
    rep = hyperdcp.verify_checkpoint(d)
    assert not rep.ok and len(rep.file_errors) == 1 and "model-00002-of-00002.safetensors" in rep.file_errors[0]


# -- hub cache snapshots: links into the repository's own blobs, and nowhere else ------------------
def test_hub_snapshot_links_resolve_into_its_blobs(tmp_path):
    snap = _hub_snapshot(str(tmp_path / "hub"))
    assert all(os.path.islink(os.path.join(snap, n)) for n in os.listdir(snap))
    src = open_source(snap)
    blobs = os.path.realpath(str(tmp_path / "hub" / "models--org--tiny" / "blobs"))
    assert sorted(src.links) == sorted(os.listdir(snap)) and all(p.startswith(blobs + os.sep)
                                                                 for p in src.links.values())
    assert [f.name for f in src.metadata.files] == ["model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize("where", ["outside the cache", "another repository"])
def test_hub_snapshot_link_leaving_its_repository_is_refused(tmp_path, where):
    snap = _hub_snapshot(str(tmp_path / "hub"))
    other = (str(tmp_path / "outside.safetensors") if where == "outside the cache"
             else str(tmp_path / "hub" / "models--evil--repo" / "blobs" / "x"))
    os.makedirs(os.path.dirname(other), exist_ok=True)
    safetensors_numpy.save_file({"head.bias": WEIGHTS["head.bias"], "ln.scale": WEIGHTS["ln.scale"]}, other)
    link = os.path.join(snap, "model-00002-of-00002.safetensors")
    os.unlink(link)
    os.symlink(other, link)
    with pytest.raises(hyperdcp.FormatError, match="outside its hub cache repository"):
        hyperdcp.read_metadata(snap)
    with pytest.raises(hyperdcp.FormatError, match="outside its hub cache repository"):
        hyperdcp.load(_zeros(), snap)


def test_links_stay_refused_outside_hub_snapshots(tmp_path):
    """The same layout under a folder not named like a hub repository: its links are not followed."""
    snap = _hub_snapshot(str(tmp_path / "hub"), repo="not-a-hub-repo")
    with pytest.raises(hyperdcp.FormatError, match="symbolic link"):
        hyperdcp.read_metadata(snap)
    with pytest.raises(hyperdcp.FormatError, match="symbolic link"):
        hyperdcp.load(_zeros(), snap)


@pytest.mark.parametrize("kind", ["hyperdcp", "hub-snapshot"])
def test_a_link_leaving_the_checkpoint_is_refused_by_every_reader(make, tmp_path, kind, capsys):
    """A data file replaced by a link to an identical copy outside the checkpoint directory (or, in a hub
    snapshot, outside its repository folder): load, verify_checkpoint and the verify, inspect and diff
    commands all refuse to read through it."""
    path, ref = make(kind), make("hyperdcp") if kind != "hyperdcp" else None
    name = hyperdcp.read_metadata(path).files[-1].name
    outside = str(tmp_path / "outside.safetensors")
    shutil.copyfile(os.path.join(path, name), outside)  # the same bytes: only where they live is wrong
    os.unlink(os.path.join(path, name))
    os.symlink(outside, os.path.join(path, name))
    why = "symbolic link" if kind == "hyperdcp" else "outside its hub cache repository"
    with pytest.raises(hyperdcp.FormatError, match=why):
        hyperdcp.load(_zeros(), path)
    rep = hyperdcp.verify_checkpoint(path)  # reports, never raises, for damage
    assert not rep.ok and any(why in e and name in e for e in rep.file_errors), rep.file_errors
    if kind == "hub-snapshot":  # its metadata comes from the files' headers: it does not open at all
        with pytest.raises(hyperdcp.FormatError, match=why):
            hyperdcp.read_metadata(path)
        capsys.readouterr()
        assert cli_main(["inspect", path]) != 0
        assert why in capsys.readouterr().err
    capsys.readouterr()
    assert cli_main(["verify", path]) != 0
    assert why in "".join(capsys.readouterr())
    assert cli_main(["diff", path, ref or make("hf-file")]) != 0
    assert why in "".join(capsys.readouterr())


# -- open_source: kinds, and why none matched --------------------------------------------------------
def test_open_source_says_why_no_kind_matched(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(hyperdcp.IncompleteCheckpointError,
                       match=r"has no hyperdcp\.json.*not huggingface: no \*\.safetensors file"):
        open_source(str(empty))
    with pytest.raises(hyperdcp.CheckpointNotFoundError,
                       match="does not exist.*not huggingface: the path does not exist"):
        hyperdcp.read_metadata(str(tmp_path / "nowhere"))
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"\x80\x04.")  # never unpickled: only its presence is looked at
    (dcp / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(hyperdcp.FormatError, match="torch DCP.*not huggingface: no \\*\\.safetensors"):
        open_source(str(dcp))


def test_open_source_of_one_kind(make):
    ck, hf_dir = make("hyperdcp"), make("hf-dir")
    assert open_source(ck, kind="hyperdcp").kind == "hyperdcp"
    with pytest.raises(hyperdcp.FormatError, match="is a hyperdcp checkpoint, not a HuggingFace directory"):
        open_source(ck, kind="huggingface")
    with pytest.raises(hyperdcp.IncompleteCheckpointError, match="has no hyperdcp.json"):
        open_source(hf_dir, kind="hyperdcp")
    with pytest.raises(ValueError, match="unknown source kind 'zarr'"):
        open_source(ck, kind="zarr")


@pytest.mark.parametrize("kind", ["hyperdcp", "hub-snapshot"])
def test_a_source_travels_to_other_ranks_as_bytes(make, kind):
    """What rank 0 broadcasts rebuilds the same source on another rank, links included."""
    src = open_source(make(kind))
    other = source_from_bytes(src.to_bytes())
    assert type(other) is type(src) and other.root == src.root
    assert other.metadata.keys() == src.metadata.keys() and other.metadata.files == src.metadata.files
    assert getattr(other, "links", None) == getattr(src, "links", None)
    files = other.reader()
    try:
        t = other.metadata.tensors["head.bias"]
        out = bytearray(t.nbytes)
        files.read_into(int(t.chunks.file[0]), int(t.chunks.begin[0]), out, "head.bias")
    finally:
        files.close()
    assert np.array_equal(np.frombuffer(bytes(out), np.int64), WEIGHTS["head.bias"])


def test_conversions_read_any_source(make, tmp_path):
    """A hub snapshot converts to hyperdcp; a hyperdcp checkpoint behind a URL converts to HF files."""
    from hyperdcp.tools.convert import hf_to_hyperdcp, hyperdcp_to_hf

    ck = str(tmp_path / "from-hub")
    hf_to_hyperdcp(make("hub-snapshot"), ck)
    state = _zeros()
    hyperdcp.load(state, ck)
    _assert_weights(state)
    out = str(tmp_path / "exported")
    r = hyperdcp_to_hf(make("http"), out)
    assert r.files == ["model.safetensors"]
    _assert_weights(safetensors_numpy.load_file(os.path.join(out, "model.safetensors")))


# -- the commands on every kind ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hyperdcp", "http", "hf-dir", "hf-sharded", "hf-file", "hub-snapshot"])
def test_inspect_verify_and_diff_commands(make, kind, capsys):
    path, ref = make(kind), (make("hyperdcp") if kind != "hyperdcp" else make("hf-file"))
    assert cli_main(["inspect", "--json", path]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["kind"] == ("hyperdcp" if kind in ("hyperdcp", "http") else "huggingface-safetensors")
    assert {t["name"]: t["shape"] for t in rep["tensors"]} == {k: list(v.shape) for k, v in WEIGHTS.items()}
    assert cli_main(["verify", path]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("OK: ")
    assert ("NO CHECKSUMS" in out) == (kind not in ("hyperdcp", "http"))
    assert cli_main(["diff", path, ref]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("EQUAL: 3 tensors compared")


# -- old import paths ------------------------------------------------------------------------------
def test_old_paths_name_the_new_ones():
    from hyperdcp import hf, verify
    from hyperdcp.loading import DataFiles
    from hyperdcp.sources import ChunkReader

    assert verify.verify_checkpoint is hyperdcp.verify_checkpoint and DataFiles is ChunkReader
    assert hf.hf_to_hyperdcp is hyperdcp.tools.convert.hf_to_hyperdcp
    with pytest.raises(AttributeError, match="HuggingFaceSource"):
        hf.HFMetadata  # noqa: B018
