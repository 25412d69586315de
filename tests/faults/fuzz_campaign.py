"""Hostile-checkpoint fuzzing of the metadata reader, the data-file header reader and the whole load.

    python -m tests.faults.fuzz_campaign --trials 20000 [--seed 0]

Each trial takes a valid checkpoint and either (a) mutates one node of its metadata JSON (then
re-signs it, so the mutation reaches the validator instead of stopping at the checksum), (b) mutates
raw metadata bytes, (c) rewrites a data file's safetensors header (fixing the length prefix), or
(d) plants hostile file-system objects (a symlink, a FIFO, a directory, a link to a character device)
under a data file's name or the metadata's. Second campaign (issue 11) kinds: (e) ``overflow`` sets box
and shape members to values near 2^61..2^64 (int64 wrap-around) and adds chunks past the tensor,
(f) ``rankfile`` damages a no-collectives checkpoint's rank metadata file (unsigned edits, re-signed
mutations, hostile documents, links, FIFOs), (g) ``bigmeta`` makes a metadata or rank file far larger
than the size cap (sparse). Then it reads the metadata, reads the header, loads the checkpoint, verifies it
and asks ``latest_checkpoint``. Required:

* only hyperdcp.CheckpointError subclasses come out (or a successful load of a re-signed variant);
* a successful load returns exactly the saved tensors (``WRONG`` otherwise), and metadata that
  validates describes boxes inside their tensors, tiling them, sized to their bytes, checked with
  Python integers (``INVALID-ACCEPTED`` otherwise);
* no hang (each trial has a deadline, SIGALRM);
* no file opened outside the checkpoint directory (an audit hook records every open);
* bounded memory (tracemalloc peak per trial), whatever sizes the files declare.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import tracemalloc

import numpy as np
import xxhash

import hyperdcp
from hyperdcp.storage.data_file import read_header
from tests.faults.report import finish

META = "hyperdcp.json"
MEM_LIMIT = 64 << 20

_watch = {"root": None, "outside": [], "dir_opened": False}


def _audit(event, args):
    root = _watch["root"]
    if root is None or event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    name = os.fsdecode(args[0])
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    if os.sep not in name and flags & os.O_NOFOLLOW and _watch["dir_opened"]:
        return  # a plain name opened relative to the checkpoint's directory descriptor (no link followed)
    lexical = os.path.abspath(name)
    if (lexical.endswith((".py", ".pyc", ".so"))
            and any(lexical.startswith(os.path.abspath(d) + os.sep) for d in sys.path if d)):
        return  # lazy imports of modules
    real = os.path.realpath(lexical)
    if lexical == root and flags & getattr(os, "O_DIRECTORY", 0):
        _watch["dir_opened"] = True

    def inside(p):
        return p == root or p.startswith(root + os.sep)

    # violations: naming a path outside the checkpoint, or opening a link that leads outside it
    # (an open with O_NOFOLLOW of a link fails with ELOOP and reads nothing)
    if not inside(lexical) or (not inside(real) and not flags & os.O_NOFOLLOW):
        _watch["outside"].append(f"{lexical} -> {real} flags={flags:#o}")


_hooked = False


def install_audit_hook() -> None:
    global _hooked
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True


def sign(doc: dict) -> bytes:
    """The metadata bytes for ``doc`` with a valid self-checksum (as Metadata.to_json writes it)."""
    body = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    body = body[:-1] + b',"metadata_checksum":"' + b"0" * 16 + b'"}\n'
    digest = b"%016x" % xxhash.xxh3_64_intdigest(body)
    return body[:-19] + digest + b'"}\n'


def make_state() -> dict:
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((8, 6)).astype(np.float32), "b": np.arange(5, dtype=np.int64),
            "s": np.array(1.5), "step": 3, "cfg": {"lr": 0.1, "ids": (1, 2)}}


def zeros(state: dict) -> dict:
    return {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else None) for k, v in state.items()}


HOSTILE_STRINGS = ["../outside.bin", "/etc/passwd", "..", ".", "", "a/b", "x" * 300, "hyperdcp.json", "\x00",
                   "../../../../../../tmp/x", "F32", "BF16", "none", "pickle", "__reduce__", "r00000-00.safetensors"]
HOSTILE_INTS = [0, -1, 1, 2, 7, 8, 2**31, 2**62, 2**63, 2**64, -(2**63), 10**30, 1 << 40]


def random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.35:
        return rng.choice(HOSTILE_INTS + [rng.randrange(-100, 10**6)])
    if r < 0.55:
        return rng.choice(HOSTILE_STRINGS)
    if r < 0.65:
        return rng.choice([None, True, False, 1.5, -0.0, 1e308])
    if r < 0.85 and depth < 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if depth < 3:
        return {rng.choice(HOSTILE_STRINGS + ["dtype", "shape", "chunks"]): random_value(rng, depth + 1)
                for _ in range(rng.randrange(0, 3))}
    return rng.choice([[], {}, [[[[]]]]])


def nodes(doc, path=()):
    yield path
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from nodes(v, path + (i,))


def mutate_doc(doc: dict, rng: random.Random, value_fn=None) -> dict:
    doc = copy.deepcopy(doc)
    paths = [p for p in nodes(doc) if p and p[-1] != "metadata_checksum"]
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        p = rng.choice(paths)
        parent = doc
        for k in p[:-1]:
            parent = parent[k]
        op = rng.random()
        try:
            if op < 0.75:
                parent[p[-1]] = copy.deepcopy(value_fn()) if value_fn else random_value(rng)
            elif op < 0.9:
                del parent[p[-1]]
            elif isinstance(parent, list):
                parent.append(copy.deepcopy(parent[p[-1]]))
            else:
                parent[p[-1] + "_x" if isinstance(p[-1], str) else p[-1]] = random_value(rng)
        except (KeyError, IndexError, TypeError):
            pass
        paths = [q for q in nodes(doc) if q and q[-1] != "metadata_checksum"] or paths
    return doc


def mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randint(1, 8)):
        op = rng.random()
        at = rng.randrange(len(b) + 1)
        if op < 0.4 and b:
            b[min(at, len(b) - 1)] = rng.randrange(256)
        elif op < 0.6:
            b[at:at] = rng.choice([b"[" * 5000, b"{", b"\x00", b'"', b"9" * 5000, b"-", b"\xff\xfe"])
        elif op < 0.8:
            del b[at : at + rng.randint(1, 50)]
        else:
            b = b[:at]
    return bytes(b)


def build(root: str) -> tuple[str, dict]:
    state = make_state()
    path = os.path.join(root, "pristine")
    hyperdcp.save(state, path, checksum_block_bytes=64, files_per_rank=2)
    return path, state


def build_rank_files(root: str, state: dict) -> str:
    """The same state saved in the no-collectives mode: data files plus a rank metadata file, no hyperdcp.json."""
    path = os.path.join(root, "pristine-nc")
    hyperdcp.async_save(state, path, coordination="none", checksum_block_bytes=64).result(timeout=120)
    return path


RANK0 = "hyperdcp.rank-00000.json"
OVERFLOW_INTS = [2**61, 2**61 + 2, 2**62, 2**62 + 4, 2**62 - 1, 2**63 - 1, 2**63 - 4, 2**63, 2**64 - 1, 2**64 + 16]
HOSTILE_RANK_BODIES = [
    b"[1]", b"{}", b'{"deep":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"format":"hyperdcp-rank","version":1,"save_id":"s","rank":0,"world_size":1000000000,"checksum_block_bytes":64,'
    b'"files":[],"tensors":{},"all_tensors":[],"values":{},"user":{}}',
    b'{"format":"hyperdcp-rank","version":1,"save_id":"s","rank":0,"world_size":0,"checksum_block_bytes":64,'
    b'"files":[],"tensors":{},"all_tensors":[],"values":{},"user":{}}',
    b'{"format":"hyperdcp-rank","version":1,"save_id":"s","rank":0,"world_size":NaN,"checksum_block_bytes":64,'
    b'"files":[],"tensors":{},"all_tensors":[],"values":{},"user":{}}',
]


def sign_raw(body: bytes) -> bytes:
    """Any bytes ending in '}' with a valid self-checksum trailer."""
    body = body[:-1] + b',"metadata_checksum":"' + b"0" * 16 + b'"}\n'
    return body[:-19] + b"%016x" % xxhash.xxh3_64_intdigest(body) + b'"}\n'


def mutate_overflow(doc: dict, rng: random.Random) -> dict:
    """Box and shape members near the int64 limits, and chunks past the tensor, consistent in bytes modulo 2^64."""
    doc = copy.deepcopy(doc)
    tensors = doc["tensors"]
    name = rng.choice(sorted(n for n in tensors if tensors[n]["shape"]))
    t = tensors[name]
    c = t["chunks"]
    nd = len(t["shape"])
    d = rng.randrange(nd)
    big = rng.choice(OVERFLOW_INTS)
    op = rng.random()
    if op < 0.4:  # an extra chunk far past the tensor, borrowing another chunk's real bytes
        other = rng.choice(sorted(tensors))
        oc = tensors[other]["chunks"]
        k = rng.randrange(len(oc["begin"]))
        off = [0] * nd
        off[d] = big
        lens = list(t["shape"])
        lens[d] = rng.choice(OVERFLOW_INTS)
        c["offsets"].append(off)
        c["lengths"].append(lens)
        for col in ("file", "begin", "end", "checksums"):
            c[col].append(oc[col][k])
        if rng.random() < 0.5:
            t["shape"][d] *= 2
    elif op < 0.7:  # a shape whose byte size wraps around to the real chunk's size
        t["shape"][d] = big
        c["lengths"][0][d] = big
    else:
        i = rng.randrange(len(c["begin"]))
        target = rng.choice(["offsets", "lengths"])
        c[target][i][d] = big if rng.random() < 0.7 else -big
    return doc


def box_oracle(doc) -> str | None:
    """Independent check, in Python integers, of what a reader that accepted ``doc`` relied on."""
    from hyperdcp.core import dtypes

    for name, t in doc.get("tensors", {}).items():
        shape, c = t["shape"], t["chunks"]
        numel = 1
        for s in shape:
            numel *= s
        vol = 0
        for off, ln, b, e in zip(c["offsets"], c["lengths"], c["begin"], c["end"]):
            if any(o < 0 or n <= 0 or o + n > s for o, n, s in zip(off, ln, shape)):
                return f"tensor {name!r}: box {off}+{ln} outside shape {shape}"
            v = 1
            for n in ln:
                v *= n
            if e - b != v * dtypes.itemsize(t["dtype"]):
                return f"tensor {name!r}: byte range {b}..{e} is not the box's size"
            vol += v
        if vol != numel:
            return f"tensor {name!r}: boxes cover {vol} of {numel} elements"
    return None


def _damage_rank_file(nc: str, path: str, work: str, rng: random.Random, info: dict, value_fn) -> None:
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(nc, path, symlinks=True)
    fp = os.path.join(path, RANK0)
    raw = open(fp, "rb").read()
    how = rng.choice(["edit", "edit", "resign", "resign", "hostile", "fsobj"])
    info["rank_damage"] = how
    if how == "edit":  # no re-signing: a changed digit, a flipped bit
        b = bytearray(raw)
        digits = [i for i, x in enumerate(b) if 0x30 <= x <= 0x39]
        at = rng.choice(digits) if digits and rng.random() < 0.7 else rng.randrange(len(b))
        b[at] = ((b[at] - 0x30 + rng.randint(1, 9)) % 10 + 0x30 if 0x30 <= b[at] <= 0x39
                 else b[at] ^ (1 << rng.randrange(8)))
        open(fp, "wb").write(bytes(b))
    elif how == "resign":
        doc = json.loads(raw)
        doc.pop("metadata_checksum", None)
        open(fp, "wb").write(sign(mutate_doc(doc, rng, value_fn)))
    elif how == "hostile":
        open(fp, "wb").write(sign_raw(rng.choice(HOSTILE_RANK_BODIES)))
    else:
        os.unlink(fp)
        what = rng.choice(["symlink", "fifo", "dir", "chardev"])
        info["fsobj"] = what
        if what == "symlink":
            os.symlink(os.path.join(work, "outside.bin"), fp)
        elif what == "fifo":
            os.mkfifo(fp)
        elif what == "dir":
            os.mkdir(fp)
        else:
            os.symlink("/dev/zero", fp)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def one_trial(pristine: str, state: dict, work: str, rng: random.Random, kind: str | None = None,
              value_fn=None, deadline_s: int = 10, nc: str | None = None) -> dict:
    """One trial; ``nc`` (a no-collectives pristine checkpoint) enables the ``rankfile`` kind."""
    path = os.path.join(work, "trial", "ckpt")  # alone in its parent: latest_checkpoint looks at it only
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(pristine, path, symlinks=True)
    outside = os.path.join(work, "outside.bin")
    with open(outside, "wb") as f:
        f.write(b"\x00" * 4096)
    raw = open(os.path.join(path, META), "rb").read()
    doc = json.loads(raw)
    del doc["metadata_checksum"]
    data_files = sorted(f["name"] for f in doc["files"])
    kinds = ["doc", "doc", "doc", "bytes", "header", "fsobj", "overflow", "overflow", "bigmeta"]
    kind = kind or rng.choice(kinds + (["rankfile", "rankfile"] if nc else []))
    info = {"kind": kind}
    written_doc = None
    env_cap = None
    if kind == "overflow":
        written_doc = mutate_overflow(doc, rng)
        open(os.path.join(path, META), "wb").write(sign(written_doc))
    elif kind == "rankfile":
        _damage_rank_file(nc, path, work, rng, info, value_fn)
    elif kind == "bigmeta":
        env_cap = 1 << 20
        if nc and rng.random() < 0.5:
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(nc, path, symlinks=True)
            victim = RANK0
        else:
            victim = META
        with open(os.path.join(path, victim), "r+b") as f:
            f.truncate(256 << 20)  # sparse: costs nothing unless a reader reads it all
    elif kind == "doc":
        new = sign(mutate_doc(doc, rng, value_fn))
        open(os.path.join(path, META), "wb").write(new)
    elif kind == "bytes":
        new = mutate_bytes(raw, rng)
        if rng.random() < 0.5:  # re-sign what still parses as the trailer's body
            new = new.split(b',"metadata_checksum"')[0]
            new = new + b',"metadata_checksum":"' + b"0" * 16 + b'"}\n'
            new = new[:-19] + b"%016x" % xxhash.xxh3_64_intdigest(new) + b'"}\n'
        open(os.path.join(path, META), "wb").write(new)
    elif kind == "header":
        name = rng.choice(data_files)
        fp = os.path.join(path, name)
        blob = open(fp, "rb").read()
        (n,) = struct.unpack("<Q", blob[:8])
        head = json.loads(blob[8 : 8 + n])
        if rng.random() < 0.7:
            head = mutate_doc(head, rng, value_fn)
            hb = json.dumps(head).encode()
            hb += b" " * (-len(hb) % 8)
        else:
            hb = mutate_bytes(blob[8 : 8 + n], rng)
        prefix = (struct.pack("<Q", len(hb)) if rng.random() < 0.8
                  else struct.pack("<Q", rng.choice([0, 7, 2**63, 2**64 - 1, len(hb) + 10**6])))
        open(fp, "wb").write(prefix + hb + blob[8 + n :])
    else:
        victim = rng.choice(data_files + [META])
        fp = os.path.join(path, victim)
        os.unlink(fp)
        what = rng.choice(["symlink", "fifo", "dir", "symlink-dir", "chardev"])
        info["fsobj"] = what
        if what == "symlink":
            os.symlink(outside, fp)
        elif what == "chardev":
            os.symlink("/dev/zero", fp)
        elif what == "fifo":
            os.mkfifo(fp)
        elif what == "dir":
            os.mkdir(fp)
        else:
            os.symlink(work, fp)
    root = os.path.abspath(path)
    _watch["root"], _watch["outside"], _watch["dir_opened"] = root, [], False
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(deadline_s)
    old_cap = os.environ.get("HYPERDCP_MAX_METADATA_BYTES")
    if env_cap is not None:
        os.environ["HYPERDCP_MAX_METADATA_BYTES"] = str(env_cap)
    tracemalloc.start()
    try:
        try:
            hyperdcp.read_metadata(path)
            info["metadata"] = "valid"
            why = box_oracle(written_doc) if written_doc is not None else None
            if why is not None:
                info["invalid"] = why
        except hyperdcp.CheckpointError as e:
            info["metadata"] = type(e).__name__
        for name in data_files:
            fp = os.path.join(path, name)
            try:
                fd = os.open(fp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if os.path.isfile(fp):
                    read_header(fd, os.fstat(fd).st_size, fp)
            except hyperdcp.CheckpointError:
                pass
            finally:
                os.close(fd)
        out = zeros(state)
        try:
            res = hyperdcp.load(out, path, strict=False)
            info["load"] = "ok"
            wrong = [k for k, v in state.items() if isinstance(v, np.ndarray) and k not in res.missing_keys
                     and out[k].tobytes() != v.tobytes()]
            if kind in ("rankfile", "bigmeta"):  # nothing re-signed could legitimately change a plain value there
                wrong += [k for k, v in state.items()
                          if info.get("rank_damage") == "edit" and not isinstance(v, np.ndarray)
                          and k not in res.missing_keys and out[k] != v]
            if wrong:
                info["wrong"] = wrong
        except hyperdcp.CheckpointError as e:
            info["load"] = type(e).__name__
        try:
            hyperdcp.verify_checkpoint(path, threads=2)
        except hyperdcp.CheckpointError:
            pass
        hyperdcp.latest_checkpoint(os.path.dirname(path))  # never raises for a damaged entry
        info["outcome"] = "WRONG" if info.get("wrong") else "INVALID-ACCEPTED" if info.get("invalid") else "ok"
    except Hang:
        info["outcome"] = "HANG"
    except Exception as e:  # noqa: BLE001
        import traceback

        info["outcome"] = "ESCAPED"
        info["error"] = f"{type(e).__name__}: {e}"[:500]
        info["tb"] = traceback.format_exc()[-1500:]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        if env_cap is not None:
            if old_cap is None:
                os.environ.pop("HYPERDCP_MAX_METADATA_BYTES", None)
            else:
                os.environ["HYPERDCP_MAX_METADATA_BYTES"] = old_cap
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        _watch["root"] = None
    info["peak_bytes"] = peak
    if peak > MEM_LIMIT and info["outcome"] == "ok":
        info["outcome"] = "MEMORY"
    bad = list(_watch["outside"])
    if bad and info["outcome"] == "ok":
        info["outcome"] = "OUTSIDE"
        info["outside"] = bad[:5]
    return info


def campaign(trials: int, seed: int = 0, log=print) -> dict:
    install_audit_hook()
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    failures = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hdcp-fuzz-") as work:
        pristine, state = build(work)
        nc = build_rank_files(work, state)
        for i in range(trials):
            info = one_trial(pristine, state, work, rng, nc=nc)
            for k in ("outcome", "kind"):
                counts[f"{k}:{info[k]}"] = counts.get(f"{k}:{info[k]}", 0) + 1
            counts[f"load:{info.get('load')}"] = counts.get(f"load:{info.get('load')}", 0) + 1
            if info["outcome"] != "ok":
                failures.append(info)
                log(f"trial {i}: {info}")
    return {"trials": trials, "seed": seed, "seconds": round(time.perf_counter() - t0, 1), "counts": counts,
            "failures": failures}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = campaign(a.trials, a.seed)
    return finish(res, a.json, len(res["failures"]))


if __name__ == "__main__":
    sys.exit(main())
