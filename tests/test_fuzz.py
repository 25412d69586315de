"""Hostile checkpoints (issue 5): fuzzed metadata and headers yield only CheckpointError subclasses, never
a hang, an escape from the checkpoint directory, an absurd allocation, or code execution.

The long campaign: ``python -m tests.faults.fuzz_campaign --trials 20000`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hyperdcp
from hyperdcp.format.metadata import Metadata
from hyperdcp.storage.data_file import read_header
from tests.faults import fuzz_campaign as fz

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.sampled_from(fz.HOSTILE_STRINGS) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    fz.install_audit_hook()
    work = tmp_path_factory.mktemp("fuzz")
    path, state = fz.build(str(work))
    return path, state, str(work)


@SETTINGS
@given(st.binary(max_size=2000))
def test_metadata_reader_random_bytes(raw):
    try:
        Metadata.from_json(raw)
    except hyperdcp.CheckpointError:
        pass


@SETTINGS
@given(st.randoms(use_true_random=False), json_values)
def test_metadata_reader_resigned_mutations(pristine, rnd, value):
    path, _, _ = pristine
    doc = json.loads(open(os.path.join(path, "hyperdcp.json"), "rb").read())
    del doc["metadata_checksum"]
    raw = fz.sign(fz.mutate_doc(doc, rnd, lambda: value))
    try:
        Metadata.from_json(raw)
    except hyperdcp.CheckpointError:
        pass


@SETTINGS
@given(st.binary(max_size=600), st.integers(min_value=0, max_value=2**64 - 1) | st.none())
def test_header_reader_random_files(tmp_path_factory, body, declared):
    p = tmp_path_factory.mktemp("h") / "f.safetensors"
    prefix = struct.pack("<Q", len(body) if declared is None else declared)
    p.write_bytes(prefix + body)
    fd = os.open(p, os.O_RDONLY)
    try:
        read_header(fd, os.fstat(fd).st_size, str(p))
    except hyperdcp.CheckpointError:
        pass
    finally:
        os.close(fd)


@SETTINGS
@given(st.randoms(use_true_random=False), st.sampled_from(["doc", "bytes", "header", "fsobj"]), json_values)
def test_hostile_checkpoint_full_load(pristine, rnd, kind, value):
    path, state, work = pristine
    info = fz.one_trial(path, state, work, rnd, kind=kind, value_fn=lambda: value)
    assert info["outcome"] == "ok", info


def _resign(path, edit):
    raw = open(os.path.join(path, "hyperdcp.json"), "rb").read()
    doc = json.loads(raw)
    del doc["metadata_checksum"]
    edit(doc)
    open(os.path.join(path, "hyperdcp.json"), "wb").write(fz.sign(doc))


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", "..", "a/../../x", ".hidden"])
def test_path_traversal_names_rejected(tmp_path, name):
    path, _ = fz.build(str(tmp_path))
    _resign(path, lambda d: d["files"][0].__setitem__("name", name))
    with pytest.raises(hyperdcp.FormatError, match="plain, unique file name"):
        hyperdcp.read_metadata(path)


def test_symlinked_data_file_is_refused(tmp_path):
    path, state = fz.build(str(tmp_path))
    outside = tmp_path / "outside.bin"
    name = hyperdcp.read_metadata(path).files[0].name
    os.replace(os.path.join(path, name), outside)
    os.symlink(outside, os.path.join(path, name))
    with pytest.raises(hyperdcp.FormatError, match="symbolic link"):
        hyperdcp.load(fz.zeros(state), path)


def test_fifo_metadata_does_not_hang(tmp_path):
    path, state = fz.build(str(tmp_path))
    os.unlink(os.path.join(path, "hyperdcp.json"))
    os.mkfifo(os.path.join(path, "hyperdcp.json"))
    with pytest.raises(hyperdcp.FormatError, match="not a regular file"):
        hyperdcp.load(fz.zeros(state), path)


def test_absurd_declared_sizes_are_checked_before_allocation(tmp_path):
    import tracemalloc

    path, state = fz.build(str(tmp_path))

    def huge(d):
        d["files"][0]["bytes"] = 1 << 50
        t = d["tensors"]["w"]
        t["shape"] = [1 << 22, 1 << 20]
        t["chunks"] = {"offsets": [[0, 0]], "lengths": [[1 << 22, 1 << 20]], "file": [0], "begin": [0],
                       "end": [(1 << 42) * 4], "checksums": ["0" * 16 * 16]}  # 16 blocks of 1 TiB
        d["checksum"]["block_bytes"] = 1 << 40
        d["tensors"] = {"w": t}
        d["files"] = d["files"][:1]
        d["values"] = {}

    _resign(path, huge)
    tracemalloc.start()
    try:
        meta = hyperdcp.read_metadata(path)  # consistent on paper: 16 TiB in a 1 PiB file
        assert meta.files[0].nbytes == 1 << 50
        with pytest.raises(hyperdcp.CorruptionError, match="metadata records"):
            _load_slice(path)
        rep = hyperdcp.verify_checkpoint(path)
        assert not rep.ok and "metadata records" in rep.file_errors[0]
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 64 << 20


def _load_slice(path):
    # a rank holding a 1-row shard of the absurd tensor: its read is sized by the metadata, so the file
    # must be checked first
    from hyperdcp.loading import DataFiles, read_chunk
    from hyperdcp.planning.load_plan import ChunkRead

    meta = hyperdcp.read_metadata(path)
    files = DataFiles(path, meta)
    try:
        read_chunk(files, meta, ChunkRead("w", 0, 0, 0, 0, (1 << 42) * 4), verify=True)
    finally:
        files.close()


def test_no_code_in_a_checkpoint_runs_on_load(tmp_path, monkeypatch):
    """Nothing is unpickled or evaluated: the load path has no pickle/eval/exec/torch.load, and a value
    whose tag asks for any of them is a FormatError. The one exception is the opt-in torch DCP source's
    restricted unpickler (``source="torch-dcp"``), which resolves globals through an allow-list only and
    is imported by that source and its converter alone."""
    src = pathlib.Path(hyperdcp.__file__).parent
    restricted = src / "sources" / "torch_dcp_pickle.py"
    writes_torch_format = src / "tools" / "convert_torch_dcp.py"  # pickle.dump of torch's .metadata, never a load
    for f in src.rglob("*.py"):
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if f not in (restricted, writes_torch_format):
                    assert not any(n.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve")
                                   for n in names), f
                if any("torch_dcp_pickle" in n for n in names):
                    assert f.name in ("torch_dcp.py", "convert_torch_dcp.py"), f
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec", "compile", "__import__"), f"{f}:{node.lineno}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                base = node.func.value
                assert not (isinstance(base, ast.Name)
                            and base.id in ("torch", "pickle", "np", "numpy")), f"{f}:{node.lineno}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "loads":
                base = node.func.value
                assert not (isinstance(base, ast.Name) and base.id == "pickle"), f"{f}:{node.lineno}"
    import builtins
    import pickle

    def boom(*a, **k):
        raise AssertionError("code execution attempted during load")

    path, state = fz.build(str(tmp_path))
    for tag in (["pickle", "gASVCAAAAAAAAACMBHRlc3SULg=="], ["eval", "__import__('os').system('true')"],
                ["np", "O", "00"], ["exec", "x"], ["object", "os.system"]):
        _resign(path, lambda d: d["values"].__setitem__("step", tag))
        monkeypatch.setattr(pickle, "loads", boom)
        monkeypatch.setattr(pickle, "load", boom)
        monkeypatch.setattr(builtins, "eval", boom)
        with pytest.raises(hyperdcp.FormatError):
            hyperdcp.load(fz.zeros(state), path)
        monkeypatch.undo()


# -- format 2: the binary chunk index (issue 13) ---------------------------------------------------------
HOSTILE_INTS = [-1, 0, 1, 2**31, 2**40, 2**62, 2**63 - 1, -(2**63), 7]


@pytest.fixture(scope="module")
def pristine_v2(pristine):
    """The fuzz checkpoint's metadata as a format-2 record and index (in memory)."""
    from hyperdcp.format.record_v2 import encode_v2

    path, _, _ = pristine
    meta = hyperdcp.read_metadata(path)
    record, index = encode_v2(meta, "hyperdcp-index-fuzz.safetensors")
    doc = json.loads(record)
    del doc["metadata_checksum"]
    return doc, index


def _v2_reader(doc, index: bytes):
    import xxhash

    d = json.loads(json.dumps(doc))
    d["index"]["bytes"] = d["files"][-1]["bytes"] = len(index)
    d["index"]["xxh3_64"] = "%016x" % xxhash.xxh3_64_intdigest(index)
    return fz.sign(d)


@SETTINGS
@given(st.randoms(use_true_random=False), st.integers(min_value=1, max_value=8))
def test_chunk_index_byte_mutations(pristine_v2, rnd, edits):
    doc, index = pristine_v2
    raw = bytearray(index)
    for _ in range(edits):
        what = rnd.random()
        if what < 0.7:
            raw[rnd.randrange(len(raw))] = rnd.randrange(256)
        elif what < 0.85:
            del raw[rnd.randrange(len(raw)):]
        else:
            raw[rnd.randrange(len(raw)):rnd.randrange(len(raw))] = rnd.randbytes(rnd.randrange(16))
        if not raw:
            break
    try:
        Metadata.from_json(_v2_reader(doc, bytes(raw)), index=bytes(raw))
    except hyperdcp.CheckpointError:
        pass


@SETTINGS
@given(st.randoms(use_true_random=False), st.sampled_from(HOSTILE_INTS))
def test_chunk_index_array_mutations(pristine_v2, rnd, value):
    import numpy as np
    from safetensors.numpy import load, save

    doc, index = pristine_v2
    arrays = {k: v.copy() for k, v in load(index).items()}
    name = rnd.choice(sorted(arrays))
    a = arrays[name]
    if a.size and rnd.random() < 0.8:
        a.reshape(-1)[rnd.randrange(a.size)] = np.array(value).astype(a.dtype)
    else:
        arrays[name] = np.ascontiguousarray(a.reshape(-1)[: rnd.randrange(a.size + 1)] if a.ndim == 1 else a[:, :0])
    raw = save(arrays, metadata={"format": "hyperdcp-chunk-index", "version": "2"})
    try:
        Metadata.from_json(_v2_reader(doc, raw), index=raw)
    except hyperdcp.CheckpointError:
        pass
