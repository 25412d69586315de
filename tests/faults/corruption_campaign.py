"""Corruption campaign: flip, zero, overwrite or truncate random bytes of a checkpoint, then load it.

Every trial must end in a hyperdcp.CheckpointError that names the damaged file (and the tensor, when
the damage is inside a chunk's bytes) -- never in wrong values, never in another exception -- and
``hyperdcp verify`` must report the damage.

    python -m tests.faults.corruption_campaign --trials 200 [--seed 0] [--json out.json]

Second campaign (issue 11): a quarter of the trials damage a checkpoint saved in the no-collectives mode
(``async_save(coordination="none")``: data files plus a rank metadata file ``hyperdcp.rank-00000.json``,
no ``hyperdcp.json``), so damage to rank files -- a changed digit of a value included -- is covered too.

Outcomes per trial: ``detected`` (the required result), ``benign`` (the load succeeded bit-exact:
the damaged bytes are ones no reader depends on; counted, allowed only with --allow-benign),
``silent`` (wrong values: a failure), ``crash`` (a non-CheckpointError exception: a failure),
``unnamed`` (an error not naming the file: a failure).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np

import hyperdcp
from tests.faults.report import finish

MODES = ("flip", "zero", "random", "truncate")


def make_state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": rng.standard_normal((64, 48)).astype(np.float32),
            "b": rng.standard_normal(48).astype(np.float16),
            "emb": rng.integers(-1000, 1000, (40, 8), dtype=np.int64),
            "scalar": np.array(3.5, dtype=np.float64),
        },
        "step": 7,
        "sched": {"lr": 1e-3, "milestones": (10, 20)},
    }


def zeros_like(state):
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, np.ndarray):
        return np.zeros_like(state)
    return None


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return a == b and type(a) is type(b)


def build(root: str) -> tuple[str, dict]:
    state = make_state()
    path = os.path.join(root, "pristine")
    # small checksum blocks and several files, so damage is pinned to a block of a chunk of a file
    hyperdcp.save(state, path, checksum_block_bytes=1024, files_per_rank=3)
    return path, state


def build_rank_files(root: str, state: dict) -> str:
    path = os.path.join(root, "pristine-nc")
    hyperdcp.async_save(state, path, coordination="none", checksum_block_bytes=1024,
                        files_per_rank=3).result(timeout=120)
    return path


def corrupt(path: str, rng: random.Random) -> dict:
    names = sorted(os.listdir(path))
    meta_name = "hyperdcp.json" if "hyperdcp.json" in names else "hyperdcp.rank-00000.json"
    target = meta_name if rng.random() < 0.25 else rng.choice([n for n in names if n != meta_name])
    p = os.path.join(path, target)
    data = bytearray(open(p, "rb").read())
    mode = rng.choice(MODES)
    for _ in range(100):
        new = bytearray(data)
        at = rng.randrange(len(data))
        if mode == "flip":
            new[at] ^= 1 << rng.randrange(8)
        elif mode == "zero":
            n = rng.randint(1, 64)
            new[at : at + n] = bytes(len(new[at : at + n]))
        elif mode == "random":
            new[at] = rng.randrange(256)
        else:
            new = new[:at]
        if new != data:
            break
    with open(p, "wb") as f:
        f.write(new)
    return {"file": target, "mode": mode, "at": at, "size": len(data)}


def one_trial(pristine: str, state: dict, work: str, rng: random.Random, nc: str | None = None) -> dict:
    """One trial; with ``nc`` (a no-collectives pristine checkpoint) a quarter of the trials damage that one."""
    path = os.path.join(work, "ckpt")
    shutil.rmtree(path, ignore_errors=True)
    use_nc = nc is not None and rng.random() < 0.25
    shutil.copytree(nc if use_nc else pristine, path)
    info = corrupt(path, rng)
    info["layout"] = "rank-files" if use_nc else "committed"
    out = zeros_like(state)
    try:
        hyperdcp.load(out, path)
    except hyperdcp.CheckpointError as e:
        msg = str(e)
        info["error"] = f"{type(e).__name__}: {msg}"
        info["outcome"] = "detected" if info["file"] in msg else "unnamed"
        if "checksum mismatch" in msg and "tensor" not in msg:
            info["outcome"] = "unnamed"
    except Exception as e:  # noqa: BLE001
        info["error"] = f"{type(e).__name__}: {e}"
        info["outcome"] = "crash"
    else:
        info["outcome"] = "benign" if equal(out, state) else "silent"
    try:
        rep = hyperdcp.verify_checkpoint(path, threads=2)
        info["verify_ok"] = rep.ok
    except hyperdcp.CheckpointError:
        info["verify_ok"] = False
    except Exception as e:  # noqa: BLE001 - verify must report damage, never crash on it
        info["verify_ok"] = False
        info["error"] = f"verify: {type(e).__name__}: {e}"
        info["outcome"] = "crash"
    if info["outcome"] == "detected" and info["verify_ok"]:
        info["outcome"] = "verify-missed"
    return info


def campaign(trials: int, seed: int = 0, log=print, rank_files: bool = True) -> dict:
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    failures = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hdcp-corrupt-") as root:
        pristine, state = build(root)
        nc = build_rank_files(root, state) if rank_files else None
        for i in range(trials):
            info = one_trial(pristine, state, root, rng, nc)
            counts[info["outcome"]] = counts.get(info["outcome"], 0) + 1
            key = f"{'meta' if info['file'].startswith('hyperdcp.') else 'data'}:{info['mode']}"
            if info["layout"] == "rank-files":
                key = "rank-files:" + key
            counts[key] = counts.get(key, 0) + 1
            if info["outcome"] not in ("detected", "benign"):
                failures.append(info)
                log(f"trial {i}: {info['outcome']}: {info}")
    return {"trials": trials, "seed": seed, "seconds": round(time.perf_counter() - t0, 2), "counts": counts,
            "failures": failures}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--allow-benign", action="store_true")
    a = ap.parse_args(argv)
    res = campaign(a.trials, a.seed)
    bad = len(res["failures"]) + (0 if a.allow_benign else res["counts"].get("benign", 0))
    return finish(res, a.json, bad, "trial(s) not detected")


if __name__ == "__main__":
    sys.exit(main())
