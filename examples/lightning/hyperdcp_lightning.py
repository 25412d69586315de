"""PyTorch Lightning's distributed checkpoints through hyperdcp: one Strategy for the Trainer.

    from hyperdcp_lightning import HyperdcpModelParallelStrategy

    trainer = L.Trainer(strategy=HyperdcpModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1),
                        callbacks=[ModelCheckpoint(dirpath="ckpt", every_n_train_steps=500, save_last=True)])
    trainer.fit(model, ckpt_path="last")           # on any world size / FSDP2+TP layout

It is Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy` (FSDP2 and tensor parallel
through ``configure_model``, DTensors), with the checkpoint it writes (``save_distributed_checkpoint=True``:
a folder per checkpoint) made a hyperdcp checkpoint:

* ``save_checkpoint``: one :func:`hyperdcp.torch.save` of ``state_dict`` (the model), ``optimizer_<i>``
  (each optimizer's sharded state) and ``lightning``: everything else Lightning puts in a checkpoint
  (``epoch``, ``global_step``, ``loops``, ``callbacks``, ``lr_schedulers``, the precision plugin's state,
  ``hyper_parameters``, a datamodule's state, what ``on_save_checkpoint`` adds) as one plain value in the
  commit record, without pickle (stock Lightning pickles it into ``meta.pt``). The tensors among it
  (``ModelCheckpoint``'s scores, a scheduler's tensor LR) are written as
  ``("hyperdcp_lightning.tensor", dtype, shape, bytes)`` and come back as CPU tensors; anything that is
  neither a tensor nor a plain value (None, bool, int, float, str, bytes, numpy scalars, lists, tuples,
  dicts) is refused by name before anything is written (hparams are checked at setup already). A folder
  that Lightning's own strategy wrote at that path before the switch (torch DCP shards and ``meta.pt``,
  e.g. ``last.ckpt``) is replaced, as Lightning would, and removed only once the new checkpoint committed.
* ``load_checkpoint`` (``trainer.fit(ckpt_path=...)``, ``"last"``, ``"best"``): one :func:`hyperdcp.load`
  into the model's and optimizers' state dicts as this job lays them out (another world size, another
  mesh), then the same ``load_state_dict`` / ``set_optimizer_state_dict`` calls as Lightning's own. When
  the job runs on another number of ranks, every rank takes rank 0's ``lightning`` value, as stock
  Lightning does (it saves rank 0's only). A path that is no hyperdcp checkpoint (a torch DCP folder or
  a ``.ckpt`` file from before the switch) goes to Lightning's own loader.
* ``remove_checkpoint`` (``ModelCheckpoint``'s ``save_top_k`` retention): hyperdcp's crash-safe deletion
  (renamed out of the listing, then removed) and a sweep of what killed saves left in that folder. A
  link (``save_last="link"``) is unlinked, never followed. The save before it returned only once its
  checkpoint committed on every rank, so a removal never runs ahead of the save that replaces it.

Not changed: how Lightning names, schedules and picks checkpoints. ``save_distributed_checkpoint=False``
(gathering full weights into one pickled file) is refused: a hyperdcp checkpoint loads into any layout, and
``hyperdcp convert hyperdcp-to-hf CKPT OUT --include state_dict. --strip-prefix state_dict.`` exports the
full weights. ``LightningModule.load_from_checkpoint`` reads single files only (as for stock folder
checkpoints); use ``trainer.fit/validate(ckpt_path=...)``.
"""

from __future__ import annotations

import os
import secrets
import shutil
from typing import Any

import numpy as np
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

import hyperdcp
import hyperdcp.torch
from hyperdcp.storage.local import LocalStorage

LIGHTNING = "lightning"  #: the key of Lightning's non-tensor state in the checkpoint
TENSOR_TAG = "hyperdcp_lightning.tensor"
_SCALARS = (type(None), bool, int, float, str, bytes)


# -- Lightning's checkpoint dict (less model and optimizers) <-> one plain value ---------------------------------
def to_plain(value: Any, where: str = LIGHTNING) -> Any:
    """``value`` as a plain value: tensors as tagged tuples, dict subclasses (OrderedDict...) as dicts."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise TypeError(f"cannot checkpoint {where!r}: a {type(value).__name__} outside the model and "
                            "optimizer state; keep only plain tensors there")
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return (TENSOR_TAG, str(t.dtype).removeprefix("torch."), list(t.shape), raw)
    if type(value) in _SCALARS or isinstance(value, np.generic):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if type(k) not in _SCALARS:
                raise TypeError(f"cannot checkpoint {where!r}: its key {k!r} is a {type(k).__name__}")
            out[k] = to_plain(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    t = type(value)
    raise TypeError(
        f"cannot checkpoint {where!r}: a {t.__module__}.{t.__qualname__}, neither a tensor nor a plain value "
        "(None, bool, int, float, str, bytes, numpy scalars, lists/tuples/dicts of them); hyperdcp never pickles. "
        "Convert it (a hyper-parameter: save_hyperparameters(ignore=[...]) or a plain type), or drop it"
    )


def from_plain(value: Any, where: str = LIGHTNING) -> Any:
    """The inverse of :func:`to_plain` (tensors come back on the CPU)."""
    if type(value) is tuple and len(value) == 4 and value[0] == TENSOR_TAG:
        _, name, shape, raw = value
        dtype = getattr(torch, name, None) if type(name) is str else None
        if not isinstance(dtype, torch.dtype) or type(shape) is not list or type(raw) is not bytes:
            raise hyperdcp.FormatError(f"{where}: malformed stored tensor {value[:3]!r}")
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if len(raw) != n * dtype.itemsize:
            raise hyperdcp.FormatError(f"{where}: stored tensor of shape {shape} {name} holds {len(raw)} bytes")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)
    if type(value) is dict:
        return {k: from_plain(v, f"{where}.{k}") for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(from_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    return value


class HyperdcpModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2 / TP) whose checkpoints are hyperdcp checkpoints.

    Takes ModelParallelStrategy's arguments. See the module docstring for what it changes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is not True or len(args) > 2 and args[2] is not True:
            raise ValueError(
                f"{type(self).__name__}(save_distributed_checkpoint=False) is not supported: a hyperdcp checkpoint "
                "loads into any layout already; for full weights use `hyperdcp convert hyperdcp-to-hf`"
            )
        super().__init__(*args, **kwargs)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        hparams = getattr(self.lightning_module, "hparams", None)
        if hparams:  # fail now, not at the first checkpoint hours later
            to_plain(dict(hparams), f"{LIGHTNING}.hyper_parameters")

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        path = self.broadcast(os.fspath(filepath))  # rank 0's path for every rank
        state: dict[str, Any] = {"state_dict": checkpoint["state_dict"]}
        for i, optim_state in enumerate(checkpoint.get("optimizer_states", [])):
            state[f"optimizer_{i}"] = optim_state
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        state[LIGHTNING] = to_plain(rest)
        aside = None
        if self.is_global_zero:
            if os.path.islink(path) or os.path.isfile(path):
                os.remove(path)  # a save_last="link" link or a single-file checkpoint: never write through it
            elif _is_stock_folder(path):  # Lightning's own torch DCP folder, from before the switch
                aside = os.path.join(os.path.dirname(path),
                                     f".{os.path.basename(path)}.replaced-{secrets.token_hex(4)}")
                os.rename(path, aside)  # replaced, as Lightning would, but removed only once the new one committed
        self.barrier()
        try:
            hyperdcp.torch.save(state, checkpoint_id=path)  # returns once committed on every rank
        except BaseException as e:
            if aside:
                e.add_note(f"the checkpoint that was at {path!r} is at {aside!r}")
            raise
        if aside:
            shutil.rmtree(aside)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = self.broadcast(os.fspath(checkpoint_path))
        if not hyperdcp.is_checkpoint(path):  # torch DCP folder or .ckpt file written before the switch
            return super().load_checkpoint(path, weights_only=weights_only)
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        model_sd = get_model_state_dict(self.model)
        optim_sds = [get_optimizer_state_dict(self.model, opt) for opt in self.optimizers]
        state: dict[str, Any] = {"state_dict": model_sd, LIGHTNING: {}}
        state.update({f"optimizer_{i}": sd for i, sd in enumerate(optim_sds)})
        res = hyperdcp.load(state, path, strict=False, per_rank="rank0")
        missing = set(res.missing_keys)
        if LIGHTNING in missing:
            raise ValueError(f"{path!r} is a hyperdcp checkpoint but not one of {type(self).__name__} (it has no "
                             f"{LIGHTNING!r} entry); load its weights with hyperdcp.load instead")
        model_missing = sorted(k for k in missing if k.startswith("state_dict."))
        if strict and model_missing:
            raise KeyError(f"{path!r} lacks model keys {model_missing[:5]}{' ...' if len(model_missing) > 5 else ''}"
                           " (LightningModule.strict_loading=False to load anyway)")
        self.model.load_state_dict(model_sd, strict=strict)
        saved = res.metadata.keys() if res.metadata is not None else []
        for i, (opt, sd) in enumerate(zip(self.optimizers, optim_sds)):
            if not any(k.startswith(f"optimizer_{i}.") for k in saved):
                continue  # a weights-only checkpoint: Lightning reports that itself (no lr_schedulers either)
            lost = [k for k in missing if k.startswith(f"optimizer_{i}.")]
            if lost:
                raise KeyError(f"{path!r} lacks part of optimizer {i}'s state: {sorted(lost)[:5]}")
            set_optimizer_state_dict(self.model, opt, optim_state_dict=sd, options=StateDictOptions(cpu_offload=True))
        return from_plain(state[LIGHTNING])

    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.is_global_zero:
            return
        path = os.fspath(filepath)
        if "://" in path:  # object storage: Lightning's own (fsspec) removal
            return super().remove_checkpoint(path)
        path = os.path.abspath(path)
        if os.path.islink(path) or os.path.isfile(path):
            os.remove(path)
        elif os.path.isdir(path):
            root = LocalStorage(os.path.dirname(path))
            try:
                root.delete(os.path.basename(path))
                root.sweep()
            finally:
                root.close()


def _is_stock_folder(path: str) -> bool:
    """A folder that Lightning's ModelParallelStrategy / FSDPStrategy wrote (torch DCP shards and meta.pt)."""
    return (os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, "meta.pt"))
            and not hyperdcp.is_checkpoint(path))
