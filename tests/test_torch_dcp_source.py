"""Checkpoints written by torch.distributed.checkpoint (torch 2.13) load with ``source="torch-dcp"``, under
another world size and layout, bit for bit.

Four torch ranks write every kind of checkpoint once (module fixture): DTensors on a 1-D mesh (FSDP2-style
Shard(0), uneven), tensor-parallel Shard(1), HSDP and FSDP2+TP on a 2x2 mesh, ``dcp.async_save`` in thread
and process mode, ``single_file_per_rank=False``, torch's safetensors serialization
(``HuggingFaceStorageWriter(save_distributed=True)``), and an FSDP2 model + AdamW from ``get_state_dict``.
Three ranks then load each into other layouts, and one process loads them as plain tensors.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import hyperdcp
from tests.dist import outcome, run_ranks, run_scenarios
from tests.layouts import GLOBAL, REPLICATED, VALUES, check_state, full, make_state
from tests.test_torch_training import build, full_state, train

LAYOUTS = ["fsdp", "tp", "hsdp", "fsdp_tp", "async_thread", "async_process", "per_item"]


def _placements(kind: str):
    from torch.distributed.tensor import Replicate, Shard

    if kind == "tp":
        return lambda name, nd: [Shard(min(1, nd - 1))]
    if kind == "hsdp":
        return lambda name, nd: [Replicate(), Shard(0)]
    if kind == "fsdp_tp":
        return lambda name, nd: [Shard(0), Shard(min(1, nd - 1))]
    return lambda name, nd: [Shard(0)]


def _mesh(kind: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    two_d = kind in ("hsdp", "fsdp_tp")
    return init_device_mesh("cpu", (2, world // 2) if two_d else (world,))


def _save_all(rank, world, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    warnings.simplefilter("ignore")
    for kind in LAYOUTS:
        state = make_state(_mesh(kind, world), _placements(kind))
        path = os.path.join(tmp, kind)
        if kind == "async_thread":
            dcp.async_save(state, checkpoint_id=path).result(timeout=60)
        elif kind == "async_process":
            import multiprocessing

            # torch's checkpoint process is a child of this rank, which tests/dist.py starts as a daemon
            # (so that a hang cannot outlive the test); multiprocessing refuses children of daemons
            multiprocessing.current_process()._config["daemon"] = False
            fut = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result(timeout=90)
        elif kind == "per_item":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=False))
        else:
            dcp.save(state, checkpoint_id=path)
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors = make_state(_mesh("fsdp", world), _placements("fsdp"))["model"]
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(os.path.join(tmp, "safetensors"), save_distributed=True))
    model, opt = build("fsdp", seed=0)
    train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=os.path.join(tmp, "training"))
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, os.path.join(tmp, "training-ref.pt"))  # the test's own reference, written here
    return True


def _load_layouts(rank, world, tmp):
    read = {}
    for saved in LAYOUTS:
        # another world size (3) and another layout: Shard(1) for what was saved sharded on dim 0, and back
        for kind in (["fsdp"] if saved in ("tp", "fsdp_tp") else ["tp"]):
            state = make_state(_mesh(kind, world), _placements(kind), zeros=True)
            res = hyperdcp.load(state, os.path.join(tmp, saved), source="torch-dcp")
            check_state(state)
            assert res.missing_keys == []
            read[f"{saved}->{kind}"] = res.bytes_read
    return read


def _load_safetensors(rank, world, tmp):
    state = make_state(_mesh("tp", world), _placements("tp"), zeros=True)
    hyperdcp.load(state["model"], os.path.join(tmp, "safetensors"), source="torch-dcp")
    for name in GLOBAL:
        got = state["model"][name.split(".", 1)[1]].full_tensor()
        assert torch.equal(got.view(torch.uint8), full(name).view(torch.uint8)), name
    return True


def _load_training(rank, world, tmp):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = build("fsdp", seed=99)
    train(model, opt, 1)  # optimizer state exists, with other values
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    hyperdcp.load(state, os.path.join(tmp, "training"), source="torch-dcp")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ref = torch.load(os.path.join(tmp, "training-ref.pt"), weights_only=True)
    got = full_state(model, opt)
    assert state["step"] == 2 and set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v, k
    assert opt.param_groups[0]["lr"] == 1e-2
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("torch-dcp"))
    run_ranks(4, _save_all, tmp, timeout=240)
    return tmp


@pytest.fixture(scope="module")
def loaded(saved):
    return saved, run_ranks(3, run_scenarios, saved, [_load_layouts, _load_safetensors, _load_training], timeout=240)


def test_every_torch_layout_loads_on_three_ranks_in_other_layouts_reading_each_byte_once(loaded):
    per_rank = outcome(loaded[1], "_load_layouts")
    unique = sum(full(n).numel() * full(n).element_size() for n in {**GLOBAL, **REPLICATED})
    for case in per_rank[0]:
        assert sum(r[case] for r in per_rank) == unique, f"{case}: the ranks together read each stored byte once"


def test_torch_safetensors_serialization_loads_resharded(loaded):
    assert all(outcome(loaded[1], "_load_safetensors"))


def test_fsdp2_model_and_adamw_state_from_get_state_dict_resume_on_three_ranks(loaded):
    assert all(outcome(loaded[1], "_load_training"))


@pytest.mark.parametrize("saved_kind", ["hsdp", "per_item", "async_process"])
def test_one_process_loads_plain_tensors_reading_each_byte_once(saved, saved_kind):
    state = {"model": {n.split(".", 1)[1]: torch.zeros_like(full(n)) for n in {**GLOBAL, **REPLICATED}},
             **{k: None for k in VALUES}}
    res = hyperdcp.load(state, os.path.join(saved, saved_kind), source="torch-dcp")
    check_state(state)
    unique = sum(full(n).numel() * full(n).element_size() for n in {**GLOBAL, **REPLICATED})
    assert res.bytes_read == unique, "only the tensors' own bytes are read (records located on open)"


def test_metadata_lists_tensors_chunks_and_values(saved):
    meta = hyperdcp.read_metadata(os.path.join(saved, "hsdp"), source="torch-dcp")
    assert meta.tensors["model.w1"].shape == (10, 6) and meta.tensors["model.w1"].dtype == "F32"
    assert len(meta.tensors["model.w1"].chunks) == 2  # HSDP: replicas are stored once, two shards
    assert meta.values["step"] == 42 and meta.values["meta"] == VALUES["meta"]


def test_default_paths_never_open_a_torch_dcp_checkpoint(saved):
    with pytest.raises(hyperdcp.FormatError, match='torch.distributed.checkpoint.*source="torch-dcp"'):
        hyperdcp.read_metadata(os.path.join(saved, "safetensors"))  # torch's sharded safetensors: named, not read
    with pytest.raises(hyperdcp.FormatError, match='source="torch-dcp"'):
        hyperdcp.load({"step": 0}, os.path.join(saved, "fsdp"))
    with pytest.raises(hyperdcp.FormatError, match='source="torch-dcp"'):
        hyperdcp.read_metadata(os.path.join(saved, "fsdp"))


def test_a_sharded_torch_checkpoint_converts_to_hyperdcp_and_back_for_dcp_load(saved, tmp_path):
    import torch.distributed.checkpoint as dcp

    from hyperdcp.tools.convert_torch_dcp import hyperdcp_to_torch_dcp, torch_dcp_to_hyperdcp

    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    torch_dcp_to_hyperdcp(os.path.join(saved, "fsdp_tp"), ours)
    assert hyperdcp.verify_checkpoint(ours).ok
    assert len(hyperdcp.read_metadata(ours).tensors["model.w1"].chunks) == 4  # the 2x2 mesh's shards, kept
    hyperdcp_to_torch_dcp(ours, back)
    state = {"model": {n.split(".", 1)[1]: torch.zeros_like(full(n)) for n in {**GLOBAL, **REPLICATED}},
             "step": None, "meta": {"name": None, "ids": None, "lr": None}}  # torch matches flattened keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=back)  # torch's own reader, in one process
    for n in {**GLOBAL, **REPLICATED}:
        got = state["model"][n.split(".", 1)[1]]
        assert torch.equal(got.view(torch.uint8), full(n).view(torch.uint8)), n
    assert state["step"] == 42 and state["meta"] == VALUES["meta"]
