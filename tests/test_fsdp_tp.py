"""FSDP2 + tensor parallel (issue 10, part 2): the standard 2-D layout saves and loads.

A small model gets tensor parallelism on the "tp" dim of a (dp=2, tp=2) mesh through
``parallelize_module`` and FSDP2 on the "dp" dim: weights that both shard on dim 0 carry
``_StridedShard``, norms live on the "dp" sub-mesh (a different one on each TP rank). Model and AdamW
state from ``get_state_dict`` are saved and loaded on 1-D FSDP2 (3 ranks), on TP only and on the same
2-D layout, and back, with read-once on and off, and compared bit for bit with the saved state.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from tests.dist import run_ranks  # noqa: E402


class Net(torch.nn.Module):
    """Embedding (11 rows: uneven over 2 x 2 and over 4), MLP, LayerNorm (10: uneven over 3)."""

    def __init__(self, vocab=11, dim=10, hidden=20):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, ids):
        h = self.emb(ids)
        return self.norm(h + self.down(torch.relu(self.up(h))))


def build(kind: str, seed: int, mesh=None):
    """``kind``: "2d" (FSDP2 x TP on a (2, 2) mesh), "fsdp" (1-D FSDP2 on ``mesh``), "tp" (TP only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = Net()
    world = torch.distributed.get_world_size()
    plan = {"emb": RowwiseParallel(input_layouts=Replicate()), "up": ColwiseParallel(), "down": RowwiseParallel()}
    if kind == "2d":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    elif kind == "fsdp":
        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps: int) -> None:
    torch.manual_seed(1234)
    for _ in range(steps):
        model(torch.randint(0, 11, (3, 5))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def full_state(model, opt) -> dict:
    """Every tensor of model and optimizer as a full plain tensor (its bytes), by FQN."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v for k, v in msd.items()}
    for k, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim.{k}.{name}"] = v
    return {k: (str(v.dtype), tuple(v.shape), v.contiguous().view(-1).view(torch.uint8).tolist())
            for k, v in out.items()}


def _placements(msd, osd) -> set[str]:
    out = {type(p).__name__ for v in msd.values() for p in getattr(v, "placements", ())}
    out |= {type(p).__name__ for st in osd["state"].values() for v in st.values() for p in getattr(v, "placements", ())}
    return out


def _save(kind, path, group=None, mesh=None):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = build(kind, seed=0, mesh=mesh)
    train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    hyperdcp.save({"model": msd, "optim": osd, "step": 2}, path, process_group=group)
    return full_state(model, opt), _placements(msd, osd)


def _load(kind, path, ref, group=None, mesh=None) -> list[bool]:
    """Load ``path`` into fresh models of ``kind``, read-once on and off, compare bit for bit with
    ``ref``; per load whether read-once derived the plans from the layouts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import hyperdcp.loading.read_once as X  # where read_once looks build_schedule up

    seen = []
    real = X.build_schedule

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    X.build_schedule = spy
    out = []
    try:
        for read_once in (True, False):
            model, opt = build(kind, seed=99, mesh=mesh)  # other values, no optimizer state yet
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "step": 0}
            seen.clear()
            hyperdcp.load(state, path, read_once=read_once, process_group=group)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            got = full_state(model, opt)
            assert state["step"] == 2
            assert set(got) == set(ref), sorted(set(got) ^ set(ref))
            for k in ref:
                assert got[k] == ref[k], (kind, path, read_once, k)
            train(model, opt, 1)  # training goes on from the restored state
            out.append(bool(seen and seen[-1].derived))
    finally:
        X.build_schedule = real
    return out


def _everything(rank, world, tmp):
    """On 4 ranks: save on 2-D, TP (4 ranks) and 1-D FSDP2 (ranks 0-2), then load across them."""
    import torch.distributed as dist

    ck = {k: os.path.join(tmp, k) for k in ("2d", "tp", "fsdp")}
    from torch.distributed.device_mesh import DeviceMesh

    three = [0, 1, 2]
    g3 = dist.new_group(three)
    mesh3 = DeviceMesh("cpu", three)  # made by every rank (it creates groups); rank 3 is outside it
    refs, placements, derived = {}, {}, {}
    refs["2d"], placements["2d"] = _save("2d", ck["2d"])
    refs["tp"], _ = _save("tp", ck["tp"])
    if rank in three:
        refs["fsdp"], _ = _save("fsdp", ck["fsdp"], group=g3, mesh=mesh3)
    box = [refs.get("fsdp")]
    dist.broadcast_object_list(box, src=0)  # the test's own reference, for rank 3 too
    refs["fsdp"] = box[0]
    for src in ("2d", "tp", "fsdp"):  # -> the 2-D layout (the same one from "2d")
        derived[f"{src}->2d"] = _load("2d", ck[src], refs[src])
    derived["2d->tp"] = _load("tp", ck["2d"], refs["2d"])
    if rank in three:
        derived["2d->fsdp"] = _load("fsdp", ck["2d"], refs["2d"], group=g3, mesh=mesh3)
    return placements["2d"], derived


def test_fsdp2_tp_round_trips_across_layouts(tmp_path):
    """2-D -> 1-D FSDP2 (3 ranks), -> TP only, -> the same 2-D layout, and FSDP2 / TP -> 2-D, bit-exact."""
    res = run_ranks(4, _everything, str(tmp_path), timeout=150)
    placements, derived = res[0]
    assert "_StridedShard" in placements  # the layout this test is about
    meta = hyperdcp.read_metadata(str(tmp_path / "2d"))
    stored = sum(int((t.chunks.end - t.chunks.begin).sum()) for t in meta.tensors.values())
    assert stored == meta.tensor_bytes  # every element stored once: replicas deduplicated, nothing missing
    # the same layout: every rank derives the others' read-once plans itself (norms on the "dp"
    # sub-mesh of each TP rank included); the read-once-off load derives nothing
    assert all(r[1]["2d->2d"] == [True, False] for r in res), [r[1]["2d->2d"] for r in res]
