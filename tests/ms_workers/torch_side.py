"""The torch half of the cross-framework MindSpore tests, run on gloo ranks by tests/dist.run_ranks.

Kept apart from the test module so the spawned torch ranks never import MindSpore.
"""

from __future__ import annotations

import numpy as np

#: the model both frameworks hold: torch nn.Linear and MindSpore nn.Dense store weight as (out, in)
SHAPES = {"0.weight": (8, 3), "0.bias": (8,), "2.weight": (2, 8), "2.bias": (2,)}


def bf16_words(n: int, seed: int) -> np.ndarray:
    """``n`` bf16 bit patterns: random finite ones plus NaN payloads, -0 and infinities."""
    special = np.array([0x7FC1, 0xFFFF, 0x8000, 0x7F80, 0xFF80, 0x0001], np.uint16)
    rnd = np.random.RandomState(seed).randint(0, 0x7F00, size=n - len(special)).astype(np.uint16)
    rnd[::2] |= 0x8000
    return np.concatenate([special, rnd]).view(np.int16)


def torch_round(rank: int, world: int, ms_ckpt: str, torch_ckpt: str, want_ms: dict) -> dict:
    """Load the MindSpore checkpoint into FSDP2-sharded torch state and compare; then train one step of a
    torch model under FSDP2 (bf16 buffer included) and save it. Returns what torch holds and saved."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import hyperdcp

    mesh = init_device_mesh("cpu", (world,))
    # 1. MindSpore -> torch: FSDP2 parameters (Shard(0) DTensors) and a bf16 DTensor, all zero first
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    bf = distribute_tensor(torch.zeros(want_ms["bf"].shape, dtype=torch.bfloat16), mesh, [Shard(0)])
    hyperdcp.load({"model": model.state_dict(), "bf": bf}, ms_ckpt)
    got = {k: v.full_tensor().detach().numpy().copy() for k, v in model.state_dict().items()}
    loaded_ok = all(isinstance(v, DTensor) for v in model.state_dict().values()) and all(
        got[k].tobytes() == want_ms[k].tobytes() for k in SHAPES) and \
        bf.full_tensor().view(torch.int16).numpy().tobytes() == want_ms["bf"].tobytes()
    # 2. torch -> MindSpore: one training step under FSDP2, then save parameters and a bf16 tensor
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()
    opt.step()
    words = torch.from_numpy(bf16_words(24, seed=5).reshape(6, 4))
    bf_out = distribute_tensor(words.view(torch.bfloat16), mesh, [Shard(0)])
    hyperdcp.save({"model": model.state_dict(), "bf": bf_out}, torch_ckpt)
    saved = {k: v.full_tensor().detach().numpy().copy() for k, v in model.state_dict().items()}
    return {"loaded_ok": loaded_ok, "saved": saved, "bf": words.numpy().copy()}
