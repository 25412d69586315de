"""CUDA paths: device tensors saved and loaded (host staging, copies back), NCCL process groups,
and async-save staging from device memory. Skipped where no GPU is present (CI); run on a GPU machine.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import hyperdcp  # noqa: E402


def _state(dev="cuda"):
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(256, 128, generator=g).to(dev),
        "h": torch.randn(64, 64, generator=g).to(torch.bfloat16).to(dev),
        "t": torch.randn(32, 48, generator=g).to(dev).t(),  # non-contiguous
        "step": 5,
    }


def _same(a, b):
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def test_device_tensors_round_trip(tmp_path):
    sd = _state()
    hyperdcp.save(sd, tmp_path / "c")
    back = {k: torch.zeros_like(v) if torch.is_tensor(v) else 0 for k, v in sd.items()}
    back["t"] = torch.zeros(32, 48, device="cuda").t()  # non-contiguous destination of the saved shape
    hyperdcp.load(back, tmp_path / "c")
    for k in ("w", "h", "t"):
        assert back[k].device.type == "cuda" and _same(back[k], sd[k]), k
    assert back["step"] == 5


def test_dtensor_on_an_nccl_group(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        full = torch.randn(64, 32, device="cuda")
        sd = {"w": distribute_tensor(full, mesh, [Shard(0)])}
        hyperdcp.save(sd, tmp_path / "d")
        back = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
        hyperdcp.load(back, tmp_path / "d")
        assert _same(back["w"].to_local(), full)
    finally:
        dist.destroy_process_group()


def test_async_save_stages_device_tensors_before_returning(tmp_path):
    if not hasattr(hyperdcp, "async_save"):
        pytest.skip("async_save not available")
    sd = {f"p{i}": torch.randn(1024, 1024, device="cuda") for i in range(8)}
    want = {k: v.clone() for k, v in sd.items()}
    for k in sd:  # producer work queued on the current stream right before the save
        sd[k].mul_(1.0)
    fut = hyperdcp.async_save(sd, tmp_path / "a")
    for v in sd.values():  # the next "optimizer step" must not leak into the checkpoint
        v.add_(1.0)
    fut.result(timeout=300)
    back = {k: torch.zeros(1024, 1024) for k in sd}
    hyperdcp.load(back, tmp_path / "a")
    for k in sd:
        assert _same(back[k], want[k]), k


def test_report_staging_time_against_the_copy_floor(tmp_path):
    """Prints blocking time of async_save vs a device-to-pinned-host copy of the same bytes."""
    if not hasattr(hyperdcp, "async_save"):
        pytest.skip("async_save not available")
    n = int(os.environ.get("HYPERDCP_CUDA_BENCH_MIB", "2048"))
    sd = {f"p{i}": torch.randn(n // 16, 1 << 18, device="cuda") for i in range(16)}
    dst = {k: torch.empty(v.shape, pin_memory=True) for k, v in sd.items()}
    torch.cuda.synchronize()
    t = time.perf_counter()
    for k, v in sd.items():
        dst[k].copy_(v, non_blocking=True)
    torch.cuda.synchronize()
    floor = time.perf_counter() - t
    times = []
    for i in range(3):
        t = time.perf_counter()
        fut = hyperdcp.async_save(sd, tmp_path / f"s{i}")
        times.append(time.perf_counter() - t)
        fut.result(timeout=600)
    print(f"\nCUDA staging of {n} MiB: floor (D2H into pinned) {floor:.3f}s; async_save blocking "
          f"first {times[0]:.3f}s, warm {min(times[1:]):.3f}s ({min(times[1:]) / floor:.2f}x floor)")
    assert times[-1] < 60
