"""A new user's scenario: accelerate with FSDP2 on 2 ranks saves its state through hyperdcp, a job on another
world size loads it with ``load_state`` and continues with the same losses.

Accelerate runs FSDP only on accelerators; :func:`fsdp2_on_cpu` is the test's shim that makes it take the
FSDP2 path on CPU ranks (it is not part of the integration, which is hyperdcp_accelerate.checkpoints()).
"""

from __future__ import annotations

import os

import hyperdcp_accelerate
import torch
from spawn import run_ranks

import hyperdcp

STEPS, SAVED = 6, 3


def fsdp2_on_cpu():
    """An Accelerator on FSDP2 over gloo CPU ranks (accelerate picks DDP on CPU otherwise)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    AcceleratorState._shared_state.update(fsdp_plugin=plugin, distributed_type=DistributedType.FSDP)
    PartialState._shared_state.update(distributed_type=DistributedType.FSDP)
    assert acc.is_fsdp2
    return acc


def model_and_optim(acc):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return acc.prepare(model, opt)


def train(acc, model, opt, first, last, save_at=None, out=None):
    losses = []
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step)  # the same batch on every rank and in every run
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == save_at:
            with hyperdcp_accelerate.checkpoints():
                acc.save_state(out)
    return losses


def _run(rank, world, out):
    acc = fsdp2_on_cpu()
    model, opt = model_and_optim(acc)
    return train(acc, model, opt, 1, STEPS, save_at=SAVED, out=out)


def _resume(rank, world, out):
    acc = fsdp2_on_cpu()
    model, opt = model_and_optim(acc)
    with hyperdcp_accelerate.checkpoints():
        acc.load_state(out)
    return train(acc, model, opt, SAVED + 1, STEPS)


def test_save_state_on_two_ranks_load_state_on_one(tmp_path):
    out = str(tmp_path / "state")
    reference, reference1 = run_ranks(2, _run, out)
    assert reference == reference1
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert hyperdcp.is_checkpoint(os.path.join(out, part)), part  # hyperdcp's format, not torch DCP's
        assert not os.path.exists(os.path.join(out, part, ".metadata"))
    [resumed] = run_ranks(1, _resume, out)
    assert resumed == reference[SAVED:]
