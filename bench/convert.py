"""Benchmark HuggingFace <-> hyperdcp conversion against safetensors load_file + save_file.

    python bench/convert.py --size-gb 1 [--dir /tmp/hyperdcp-bench] [--threads 4] [--keep]

Generates a model of about ``--size-gb`` GB (F32 and BF16 matrices) as one model.safetensors, then
runs each step in a fresh subprocess and reports seconds, GB/s of tensor bytes and peak RSS (VmHWM
from /proc/self/status):

* ``hf-to-dcp``     hyperdcp.hf.hf_to_dcp (streaming, checksummed, fsynced, committed)
* ``dcp-to-hf``     hyperdcp.hf.dcp_to_hf (verified reads, 5GB shards + index, fsynced)
* ``st-load+save``  safetensors.torch.load_file + save_file of the same data (no fsync)
* ``st-load+save+fsync``  the same, then fsync of the output (hyperdcp always fsyncs)

Files are in the page cache (written just before); the numbers measure the copy paths, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def generate(path: str, size_gb: float, seed: int = 0) -> int:
    """Write a safetensors file of ~size_gb GB tensor by tensor (bounded memory); return tensor bytes."""
    rng = np.random.default_rng(seed)
    specs, total, i = [], 0, 0
    target = int(size_gb * 1e9)
    while total < target:
        rows = 4096 if i % 4 else 8192
        code, isz = ("BF16", 2) if i % 3 == 2 else ("F32", 4)
        n = rows * 4096 * isz
        specs.append((f"model.layers.{i // 4}.w{i % 4}", code, [rows, 4096], n))
        total += n
        i += 1
    specs.append(("model.norm.weight", "F32", [4096], 4096 * 4))
    total += 4096 * 4
    doc, pos = {"__metadata__": {"format": "pt"}}, 0
    for name, code, shape, n in specs:
        doc[name] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    head = json.dumps(doc, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _, _code, _shape, n in specs:
            a = rng.standard_normal(n // 4, dtype=np.float32)
            f.write(a.tobytes())  # BF16 tensors get random bit patterns of the same size
    return total


def _child(mode: str, src: str, dst: str, threads: int) -> None:
    t0 = time.perf_counter()
    if mode == "hf-to-dcp":
        from hyperdcp import hf

        r = hf.hf_to_dcp(src, dst, threads=threads)
        nbytes = r.tensor_bytes
    elif mode == "dcp-to-hf":
        from hyperdcp import hf

        r = hf.dcp_to_hf(src, dst, threads=threads)
        nbytes = r.tensor_bytes
    else:
        from safetensors.torch import load_file, save_file

        sd = load_file(src)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        os.makedirs(dst, exist_ok=True)
        save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        if mode.endswith("+fsync"):
            fd = os.open(os.path.join(dst, "model.safetensors"), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    dt = time.perf_counter() - t0
    print(json.dumps({"mode": mode, "seconds": dt, "bytes": nbytes, "gb_per_s": nbytes / 1e9 / dt,
                      "peak_rss_mb": peak_rss_mb()}))


def run(mode: str, src: str, dst: str, threads: int) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    out = subprocess.run([sys.executable, __file__, "--child", mode, src, dst, str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/hyperdcp-bench-convert")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="runs per step (best is reported)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        mode, src, dst, threads = a.child
        _child(mode, src, dst, int(threads))
        return
    os.makedirs(a.dir, exist_ok=True)
    src = os.path.join(a.dir, "hf", "model.safetensors")
    os.makedirs(os.path.dirname(src), exist_ok=True)
    total = generate(src, a.size_gb)
    print(f"model: {total / 1e9:.2f} GB tensor bytes, largest tensor {8192 * 4096 * 4 / 1e6:.0f} MB, "
          f"{a.threads} threads, cpus={os.cpu_count()}")
    steps = [("hf-to-dcp", src, os.path.join(a.dir, "dcp")),
             ("dcp-to-hf", os.path.join(a.dir, "dcp"), os.path.join(a.dir, "hf-back")),
             ("st-load+save", src, os.path.join(a.dir, "st-copy")),
             ("st-load+save+fsync", src, os.path.join(a.dir, "st-copy"))]
    print(f"{'step':<18} {'seconds':>8} {'GB/s':>6} {'peak RSS MB':>12}")
    for mode, s, d in steps:
        best = min((run(mode, s, d, a.threads) for _ in range(a.repeat)), key=lambda r: r["seconds"])
        print(f"{mode:<18} {best['seconds']:8.2f} {best['gb_per_s']:6.2f} {best['peak_rss_mb']:12.0f}", flush=True)
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
