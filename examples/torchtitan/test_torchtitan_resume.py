"""A new user's scenario: torchtitan's debug Llama trained on 2 CPU ranks (FSDP2) with torchtitan's own
CheckpointManager, optimizer and LR scheduler containers, checkpointed through HyperdcpCheckpointManager;
the job is killed, resumes on 1 rank (another world size) and matches the uninterrupted run.

CPU shims (the test's, not the integration's): torchtitan's Trainer assumes CUDA devices and ships its
tokenizer/dataset assets only in its source tree, so the loop below builds the same components the
Trainer builds (model from ``model_registry("debugmodel")``, ``default_adamw``, ``LRSchedulersContainer``,
the checkpointer from its Config) and feeds seeded random tokens; FlexAttention has no backward on CPU,
so it is replaced by causal SDPA (the same attention for one document per row).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
from spawn import run_ranks

import hyperdcp

STEPS, INTERVAL, KILLED_AFTER = 8, 2, 6
SEQ, BATCH = 32, 2


def cpu_shims() -> None:
    import torch.nn.functional as F
    from torchtitan.models.common import attention

    def causal_sdpa(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, out_transform=None, **kw):
        assert out_transform is None
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    attention.FlexAttention.forward = causal_sdpa


def build(folder: str):
    """torchtitan's debug model (FSDP2 over the ranks when several), its optimizer, scheduler and checkpointer."""
    cpu_shims()
    from hyperdcp_torchtitan import HyperdcpCheckpointManager
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_registry("debugmodel").model.build()
    model.to_empty(device="cpu")
    model.init_states()
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                 min_lr_factor=0.0).build(optimizers=optimizers, training_steps=10)
    train_state = TrainState()
    checkpointer = HyperdcpCheckpointManager.Config(enable=True, folder="checkpoint", interval=INTERVAL,
                                                    keep_latest_k=2).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder=folder)
    return model, optimizers, lr_schedulers, checkpointer, train_state


class TrainState:
    """The Trainer's own stateful part: the step (torchtitan saves it as ``train_state``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def train(folder: str, last: int, kill_after: int | None = None) -> list[float]:
    model, optimizers, lr_schedulers, checkpointer, state = build(folder)
    checkpointer.load()  # resumes from the newest committed step, if any
    losses = []
    vocab = model.lm_head.weight.shape[0]
    while state.step < last:
        state.step += 1
        ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(state.step))
        logits = model(ids[:, :-1], positions=torch.arange(SEQ).expand(BATCH, SEQ))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
        checkpointer.save(state.step, last_step=state.step == last)
        if state.step == kill_after and torch.distributed.get_rank() == 0:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # the whole job at once: no close, no cleanup
    checkpointer.close()
    return losses


def _ranks(rank, world, folder, last):
    return train(folder, last)


def test_killed_run_resumes_on_another_world_size_and_matches(tmp_path):
    reference = run_ranks(2, _ranks, str(tmp_path / "reference"), STEPS)[0]

    run = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", f"import test_torchtitan_resume as t; t._killed({run!r})"],
                            env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=600,
                            start_new_session=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = os.path.join(run, "checkpoint")
    assert hyperdcp.latest_checkpoint(ckpts).endswith(f"step-{KILLED_AFTER}")
    assert sorted(os.listdir(ckpts)) == ["step-4", "step-6"]  # keep_latest_k=2: step 2 went once step 6 committed

    resumed = run_ranks(1, _ranks, run, STEPS)[0]  # one rank now: the FSDP2 state of 2 ranks, resharded
    assert len(resumed) == STEPS - KILLED_AFTER
    assert resumed == reference[KILLED_AFTER:]  # the same batches on every rank: the same losses, bit for bit
    # the last step's save (torchtitan's _save_last_step) does not purge, as in torchtitan
    assert sorted(os.listdir(ckpts)) == ["step-4", "step-6", f"step-{STEPS}"]


def _killed(run: str) -> None:
    """2 ranks train and save; the job (this process and its ranks) is killed -9 right after step 6's save."""
    import spawn

    spawn.run_ranks(2, _ranks_killed, run, STEPS)


def _ranks_killed(rank, world, folder, last):
    return train(folder, last, kill_after=KILLED_AFTER)
