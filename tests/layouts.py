"""Shared fixtures for multi-rank tests: deterministic global tensors and DTensor layouts."""

from __future__ import annotations

import zlib

import torch

GLOBAL = {
    "model.w1": ((10, 6), torch.float32),
    "model.w2": ((7, 5), torch.bfloat16),
    "model.b": ((9,), torch.float32),
    "model.emb": ((4, 3, 5), torch.float32),
    "model.count": ((5,), torch.int64),
}
REPLICATED = {"model.norm": ((6,), torch.float32)}
VALUES = {"step": 42, "meta": {"name": "m", "ids": (1, 2), "lr": 3e-4}}


def full(name: str) -> torch.Tensor:
    shape, dtype = {**GLOBAL, **REPLICATED}[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=g) * 100
    return t.to(dtype)


def make_state(mesh, placements_for, zeros: bool = False) -> dict:
    """A nested state dict of DTensors on ``mesh`` (placements per tensor), plus replicated and plain values."""
    from torch.distributed.tensor import distribute_tensor

    model = {}
    for name in GLOBAL:
        t = full(name)
        if zeros:
            t = torch.zeros_like(t)
        model[name.split(".", 1)[1]] = distribute_tensor(t, mesh, placements_for(name, t.dim()))
    for name in REPLICATED:
        model[name.split(".", 1)[1]] = torch.zeros_like(full(name)) if zeros else full(name)
    state = {"model": model}
    state.update({k: (None if zeros else v) for k, v in VALUES.items()})
    return state


def check_state(state) -> None:
    """Every tensor equals its global reference bit for bit; every value round-tripped with its type."""
    from torch.distributed.tensor import DTensor

    for name in {**GLOBAL, **REPLICATED}:
        t = state["model"][name.split(".", 1)[1]]
        got = t.full_tensor() if isinstance(t, DTensor) else t
        want = full(name)
        assert got.dtype == want.dtype, name
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                           want.view(torch.uint8) if want.dtype == torch.bfloat16 else want), f"{name} differs"
    for k, v in VALUES.items():
        assert state[k] == v and type(state[k]) is type(v), (k, state[k])
    assert type(state["meta"]["ids"]) is tuple
