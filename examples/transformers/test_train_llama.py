"""A new user's scenario: train a small Llama with transformers' FSDP2 on 2 ranks, checkpoint with hyperdcp,
resume on 1 process and under tensor parallelism, continue with the same losses, and export the weights
for ``from_pretrained``.

    python -m pytest -q examples/transformers    (in the examples venv, see dev/test_examples.sh)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch
from spawn import run_ranks
from train_llama import build, make_pretrained, restore, train

import hyperdcp

STEPS, SAVED = 6, 3


def _two_rank_runs(rank, world, pretrained, run_dir):
    """FSDP2 on 2 ranks: the uninterrupted reference run, then a run saved at step 3 that stops there."""
    model, opt = build(pretrained, "fsdp")
    reference = train(model, opt, 1, STEPS)
    model, opt = build(pretrained, "fsdp")
    mgr = hyperdcp.CheckpointManager(run_dir, keep_last=2, save_interval_steps=SAVED)
    first = train(model, opt, 1, SAVED, mgr)
    mgr.close()
    return reference, first


def test_fsdp2_checkpoint_resumes_on_one_process_and_under_tp_then_exports(tmp_path):
    pretrained, run_dir = str(tmp_path / "pretrained"), str(tmp_path / "run")
    make_pretrained(pretrained)
    (reference, first), (reference1, first1) = run_ranks(2, _two_rank_runs, pretrained, run_dir)
    assert reference == reference1 and first == first1 == reference[:SAVED]
    assert hyperdcp.CheckpointManager(run_dir).steps() == [SAVED]

    # another world size: one process, plain tensors; training continues with exactly the same losses
    model, opt = build(pretrained, "single")
    mgr = hyperdcp.CheckpointManager(run_dir, keep_last=2, save_interval_steps=SAVED)
    start = restore(mgr, model, opt)
    assert start == SAVED
    assert train(model, opt, start + 1, STEPS, mgr) == reference[SAVED:]
    assert mgr.steps() == [SAVED, STEPS]
    mgr.close()

    # another layout: transformers' tensor parallel plan on 2 ranks, from the FSDP2 checkpoint of step 3; the
    # losses match the reference up to TP's different summation order
    for losses in run_ranks(2, _resume_tp_from, pretrained, run_dir, SAVED):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[SAVED:]), rtol=1e-5, atol=1e-6)

    # the model weights only, as a HuggingFace directory; from_pretrained gives identical logits
    export = str(tmp_path / "export")
    subprocess.run([sys.executable, "-m", "hyperdcp", "convert", "hyperdcp-to-hf", os.path.join(run_dir, f"step-{STEPS}"),
                    export, "--include", "model.", "--strip-prefix", "model."], check=True)
    shutil.copy(os.path.join(pretrained, "config.json"), export)
    from transformers import LlamaForCausalLM

    reloaded = LlamaForCausalLM.from_pretrained(export)
    ids = torch.arange(2 * 16).reshape(2, 16) % 128
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def _resume_tp_from(rank, world, pretrained, run_dir, step):
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from train_llama import checkpoint_state

    model, opt = build(pretrained, "tp")
    mgr = hyperdcp.CheckpointManager(run_dir)
    state = checkpoint_state(model, opt, 0)
    assert mgr.restore(state, step=step) == step and state["step"] == step
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return train(model, opt, step + 1, STEPS)
