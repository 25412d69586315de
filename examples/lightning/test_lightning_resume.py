"""A new user's scenario: a LightningModule with FSDP2 (``configure_model``) trains on 2 ranks with
``HyperdcpModelParallelStrategy`` and ``ModelCheckpoint``, the job dies, and a job on 1 rank resumes with
``trainer.fit(ckpt_path="last")``: the same losses as an uninterrupted run, bit for bit, and the same
retention. Then, on 1 rank: the switch itself (a run checkpointed by Lightning's own
``ModelParallelStrategy``, torch DCP folders with a pickled ``meta.pt``, resumes with the hyperdcp strategy,
which replaces them); a resume through a ``save_last="link"`` link; what the non-tensor state may hold
and what is refused (a custom object among the hparams: at ``setup``, before the first step).

Exact equality holds because every rank sees the same batch (``use_distributed_sampler=False``): FSDP2
averages identical gradients (``(g + g) / 2 == g``), and each rank computes on the same all-gathered
weights as the single rank does; with different batches per rank the losses would agree only to float
rounding (another summation order).

No CPU shim is needed: ``ModelParallelStrategy`` runs FSDP2 on CPU gloo ranks with ``accelerator="cpu"``.
The ranks are started by ``spawn.run_ranks`` (process group already initialized, ``LOCAL_RANK`` set), so
Lightning launches nothing itself. Lightning is imported in the ranks only (the pytest process needs
hyperdcp alone), which keeps the test within its time budget.
"""

from __future__ import annotations

import os

import torch
from spawn import run_ranks

import hyperdcp

EPOCHS = 3  # 2 steps each; ModelCheckpoint saves at the end of every epoch (steps 2, 4, 6)
CRASH_AT_EPOCH = 2  # the interrupted job dies when epoch 2 starts: its last checkpoint is step 4


class Preempted(Exception):
    pass


def _module_class():
    import lightning.pytorch as pl

    class MLP(pl.LightningModule):
        def __init__(self, lr: float = 1e-2):
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                           torch.nn.GELU(), torch.nn.Linear(64, 4))
            self.losses: list[float] = []

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2], self.net[4]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # its state must resume too
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            data = torch.utils.data.TensorDataset(torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=8)  # the same 2 batches on every rank

    return MLP


def _trainer(world, root, checkpoints=None, callbacks=(), epochs=EPOCHS, stock=False, top_k=2, save_last=True):
    import hyperdcp_lightning
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    callbacks = list(callbacks)
    if checkpoints:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, monitor="step", mode="max", save_top_k=top_k,
                                         save_last=save_last))
    strategy = (ModelParallelStrategy if stock else hyperdcp_lightning.HyperdcpModelParallelStrategy)(
        data_parallel_size=world, tensor_parallel_size=1)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=epochs, callbacks=callbacks,
                      enable_checkpointing=bool(checkpoints), use_distributed_sampler=False, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)


def _crash_at(epoch):
    import lightning.pytorch as pl

    class Crash(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == epoch:
                raise Preempted

    return Crash()


def _first_job(rank, world, root, checkpoints):
    MLP = _module_class()
    reference = MLP()
    _trainer(world, root).fit(reference)  # uninterrupted, no checkpoints
    job = MLP()
    try:
        _trainer(world, root, checkpoints, [_crash_at(CRASH_AT_EPOCH)]).fit(job)
    except Preempted:
        pass
    else:
        raise AssertionError("the job was not interrupted")
    return {"reference": reference.losses, "job": job.losses}


def _one_rank_jobs(rank, world, root, checkpoints, stock_dir, link_dir):
    MLP = _module_class()
    module = MLP()
    trainer = _trainer(world, root, checkpoints)
    trainer.fit(module, ckpt_path="last")
    cb = trainer.checkpoint_callback
    resumed = {"losses": module.losses, "global_step": trainer.global_step, "ckpt_path": trainer.ckpt_path,
               "best": os.path.basename(cb.best_model_path), "best_k": sorted(map(os.path.basename, cb.best_k_models))}

    # the switch: epoch 0 checkpointed by Lightning's own strategy, epoch 1 resumed with hyperdcp's
    _trainer(world, root, stock_dir, epochs=1, stock=True, top_k=1).fit(MLP())
    stock_names = sorted(os.listdir(stock_dir))
    module_switched = MLP()
    _trainer(world, root, stock_dir, epochs=2, top_k=1).fit(module_switched, ckpt_path="last")

    # save_last="link": last.ckpt is a link to the newest top-k checkpoint, and resuming follows it
    _trainer(world, root, link_dir, epochs=2, top_k=1, save_last="link").fit(MLP())
    module = MLP()
    _trainer(world, root, link_dir, epochs=3, top_k=1, save_last="link").fit(module, ckpt_path="last")

    _plain_state_checks(world, root)
    return {"resumed": resumed, "stock_names": stock_names, "switched_losses": module_switched.losses,
            "linked_losses": module.losses}


def _plain_state_checks(world, root):
    """What Lightning's non-tensor state may hold, and what is refused (and when)."""
    import collections
    import json

    import pytest
    from hyperdcp_lightning import from_plain, to_plain

    from hyperdcp.format.values import decode, encode

    tensors = [torch.tensor(float("inf")), torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
               torch.tensor([True, False]), torch.empty(0, 3), torch.arange(4.0)[::2]]
    state = {"sched": collections.OrderedDict(last_epoch=3, _last_lr=[0.5]), "betas": (0.9, 0.999), 7: None,
             "t": tensors}
    back = from_plain(decode(json.loads(json.dumps(encode(to_plain(state))))))  # as the commit record stores it
    assert back["sched"] == {"last_epoch": 3, "_last_lr": [0.5]} and back["betas"] == (0.9, 0.999) and back[7] is None
    for a, b in zip(tensors, back["t"]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    with pytest.raises(TypeError, match=r"'lightning\.callbacks\.cb\.path'.*pathlib"):
        import pathlib

        to_plain({"callbacks": {"cb": {"path": pathlib.Path("x")}}})
    module = _module_class()()
    module.hparams["config"] = object()  # refused at setup, before any training step
    with pytest.raises(TypeError, match=r"lightning\.hyper_parameters\.config"):
        _trainer(world, root).fit(module)
    assert module.losses == []


def _is_hyperdcp(path):
    return hyperdcp.is_checkpoint(path) and not {".metadata", "meta.pt"} & set(os.listdir(path))


def test_fsdp2_two_ranks_resume_on_one(tmp_path):
    root, ckpts, stock, link = (str(tmp_path / n) for n in ("root", "ckpt", "stock", "link"))
    first = run_ranks(2, _first_job, root, ckpts, timeout=120)
    assert first[0] == first[1]
    reference, job = first[0]["reference"], first[0]["job"]
    assert len(reference) == 2 * EPOCHS and job == reference[:4]

    names = sorted(os.listdir(ckpts))
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"], names
    assert all(_is_hyperdcp(os.path.join(ckpts, n)) for n in names)  # not torch DCP's .metadata, no pickled meta.pt
    meta = hyperdcp.read_metadata(os.path.join(ckpts, "last.ckpt"))
    state = meta.values["lightning"]  # Lightning's loops, callbacks, schedulers...: one plain value, no pickle
    assert state["global_step"] == 4 and state["epoch"] == 1 and state["hyper_parameters"] == {"lr": 1e-2}
    assert state["lr_schedulers"][0]["last_epoch"] == 4 and "fit_loop" in state["loops"]
    [mc] = [v for k, v in state["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert mc["best_k_models"][os.path.join(ckpts, "epoch=1-step=4.ckpt")] == ("hyperdcp_lightning.tensor", "int64",
                                                                              [], (4).to_bytes(8, "little"))
    assert any(k.startswith("state_dict.") for k in meta.tensors)
    assert any(k.startswith("optimizer_0.state.") for k in meta.tensors)

    out = run_ranks(1, _one_rank_jobs, root, ckpts, stock, link, timeout=120)[0]
    resumed = out["resumed"]
    assert resumed["ckpt_path"] == os.path.join(ckpts, "last.ckpt")
    assert resumed["losses"] == reference[4:]  # exactly: see the module docstring
    assert resumed["global_step"] == 2 * EPOCHS
    # ModelCheckpoint's top-2 by step resumed too: step 6 saved, step 2 removed (crash-safely), last replaced
    assert resumed["best_k"] == ["epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"]
    assert resumed["best"] == "epoch=2-step=6.ckpt"
    assert sorted(os.listdir(ckpts)) == ["epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"]
    assert hyperdcp.read_metadata(os.path.join(ckpts, "last.ckpt")).values["lightning"]["global_step"] == 6

    # the switch: Lightning's own folders were read, then replaced and removed by hyperdcp checkpoints
    assert out["stock_names"] == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert out["switched_losses"] == reference[2:4]
    assert sorted(os.listdir(stock)) == ["epoch=1-step=4.ckpt", "last.ckpt"]  # no hidden leftovers either
    assert all(_is_hyperdcp(os.path.join(stock, n)) for n in os.listdir(stock))
    assert sorted(os.listdir(link)) == ["epoch=2-step=6.ckpt", "last.ckpt"]
    assert os.readlink(os.path.join(link, "last.ckpt")) == "epoch=2-step=6.ckpt"
    assert out["linked_losses"] == reference[4:]
