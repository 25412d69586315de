"""Device check of async_save's CUDA staging (pinned shared memory, side stream after the producer).

    python bench/async_save_cuda_check.py [--mib 512]

1. ordering: a long chain of kernels on the current stream produces the parameters, and async_save is
   called right away; the checkpoint must hold the final values (the side stream waits for them);
2. isolation: the parameters are overwritten on the GPU right after async_save returns; the checkpoint
   must not change;
3. timing: blocking time of warm calls against a plain device-to-pinned-host copy of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=64)
    a = ap.parse_args()
    import torch

    import hyperdcp

    assert torch.cuda.is_available(), "no CUDA device"
    dev = torch.device("cuda:0")
    n = a.tensors
    numel = (a.mib << 20) // 4 // n
    params = {f"p{i:04d}": torch.zeros(numel, device=dev) for i in range(n)}
    params["bf16"] = torch.zeros(1000, device=dev, dtype=torch.bfloat16)
    state = {"model": params, "step": 1}
    root = tempfile.mkdtemp(prefix="hyperdcp-cuda-")

    # 1 + 2: produce on the current stream, save immediately, then clobber
    for t in params.values():
        for _ in range(20):
            t.add_(1)  # 20 queued kernels per tensor, not yet finished when async_save is called
    fut = hyperdcp.async_save(state, f"{root}/a")
    for t in params.values():
        t.fill_(-5)
    res = fut.result(timeout=600)
    back = {"model": {k: torch.zeros_like(v, device="cpu") for k, v in params.items()}, "step": 0}
    hyperdcp.load(back, f"{root}/a")
    ok = all(torch.all(v == 20).item() for v in back["model"].values())
    print(f"ordering+isolation: {'OK' if ok else 'FAILED'} "
          f"({res.bytes_written / 2**20:.0f} MiB written, first blocking "
          f"{fut.blocking_seconds * 1e3:.1f} ms)")

    # 3: warm blocking vs a plain D2H copy into pinned memory
    pinned = [torch.empty_like(v, device="cpu").pin_memory() for v in params.values()]
    torch.cuda.synchronize()
    floors = []
    for _ in range(3):
        t0 = time.perf_counter()
        for d, s in zip(pinned, params.values()):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        floors.append(time.perf_counter() - t0)
    blocks = []
    for k in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f = hyperdcp.async_save(state, f"{root}/w{k}")
        blocks.append(time.perf_counter() - t0)
        f.result(timeout=600)
    fl, wb = min(floors), sorted(blocks)[1]
    print(f"D2H pinned copy floor {fl * 1e3:.1f} ms; async_save warm blocking {wb * 1e3:.1f} ms ({wb / fl:.2f}x)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
