"""A small Llama trained with transformers' own FSDP2 / tensor parallel setup, checkpointed with hyperdcp.

The hyperdcp part is the few lines of :func:`checkpoint_state` / :func:`restore`: the model and optimizer
state as torch builds it (``get_state_dict``: DTensors under FSDP2 or TP, plain tensors on one process),
saved and restored by a :class:`hyperdcp.CheckpointManager` on whatever layout the job runs with now.

    python train_llama.py PRETRAINED RUN_DIR --layout fsdp|tp|single --steps 6     # under torchrun for fsdp/tp

Export the weights for ``from_pretrained`` afterwards:

    hyperdcp convert hyperdcp-to-hf RUN_DIR/step-6 EXPORT --include model. --strip-prefix model.
    cp PRETRAINED/config.json EXPORT/
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import hyperdcp

VOCAB, SEQ, BATCH = 128, 16, 4


# -- the hyperdcp integration ---------------------------------------------------------------------------
def checkpoint_state(model, optimizer, step: int) -> dict:
    """What a checkpoint holds: model and AdamW state in the current layout, and the step."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def restore(mgr: hyperdcp.CheckpointManager, model, optimizer) -> int:
    """Load the newest checkpoint into ``model``/``optimizer`` whatever their layout; the step to continue from."""
    state = checkpoint_state(model, optimizer, 0)
    step = mgr.restore(state)
    if step is None:
        return 0
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step


# -- an ordinary transformers training loop ----------------------------------------------------------------
def make_pretrained(path: str, seed: int = 0) -> None:
    """A randomly initialised small Llama, saved as a HuggingFace directory (the run's starting point)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(path)


def build(pretrained: str, layout: str):
    """The model in ``layout``: ``fsdp`` / ``tp`` through transformers' DistributedConfig, or ``single``."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if layout == "fsdp":
        model = LlamaForCausalLM.from_pretrained(pretrained, distributed_config=DistributedConfig(fsdp_size=world),
                                                 device_map="cpu")
    elif layout == "tp":
        model = LlamaForCausalLM.from_pretrained(pretrained, distributed_config=DistributedConfig(tp_size=world))
    else:
        model = LlamaForCausalLM.from_pretrained(pretrained)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int) -> torch.Tensor:
    """The same batch for step ``step`` on every rank and in every run."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def train(model, optimizer, first: int, last: int, mgr: hyperdcp.CheckpointManager | None = None) -> list[float]:
    """Steps ``first..last``; saves through ``mgr`` when given. The losses, one per step."""
    losses = []
    for step in range(first, last + 1):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if mgr is not None:
            mgr.save(step, checkpoint_state(model, optimizer, step), metrics={"loss": losses[-1]})
    return losses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("pretrained")
    p.add_argument("run_dir")
    p.add_argument("--layout", default="single", choices=("fsdp", "tp", "single"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=3)
    a = p.parse_args()
    if a.layout != "single":
        torch.distributed.init_process_group("gloo")
    if not os.path.isdir(a.pretrained) and (a.layout == "single" or torch.distributed.get_rank() == 0):
        make_pretrained(a.pretrained)
    if a.layout != "single":
        torch.distributed.barrier()
    model, optimizer = build(a.pretrained, a.layout)
    mgr = hyperdcp.CheckpointManager(a.run_dir, keep_last=2, save_interval_steps=a.save_every)
    start = restore(mgr, model, optimizer)
    print("losses", train(model, optimizer, start + 1, a.steps, mgr))
    mgr.close()


if __name__ == "__main__":
    main()
