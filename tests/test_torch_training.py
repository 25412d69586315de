"""Real training state: FSDP2 and tensor-parallel models with their AdamW optimizers.

State is taken with torch.distributed.checkpoint.state_dict.get_state_dict and restored with
set_state_dict, across parallelisms and world sizes, and compared bit for bit.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from tests.dist import run_ranks  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, dim=12, hidden=20):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


def build(kind: str, seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = Block()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train(model, opt, steps: int):
    torch.manual_seed(1234)
    for _ in range(steps):
        x = torch.randn(4, 12)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def full_state(model, opt) -> dict:
    """Every tensor of model and optimizer as a full plain tensor, by FQN."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.clone() for k, v in msd.items()}
    for k, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim.{k}.{name}"] = v.clone() if torch.is_tensor(v) else v
    return out


def _save(rank, world, kind, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = build(kind, seed=0)
    train(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    hyperdcp.save({"model": msd, "optim": osd, "step": 3}, path)
    ref = full_state(model, opt)
    return {k: v.tolist() if torch.is_tensor(v) else v for k, v in ref.items()} if rank == 0 else None


def _load_and_compare(rank, world, kind, path, ref):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = build(kind, seed=99)  # different initial values
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    hyperdcp.load(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_state(model, opt)
    assert state["step"] == 3
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    for k, v in ref.items():
        g = got[k]
        if torch.is_tensor(g):
            assert torch.equal(g, torch.tensor(v, dtype=g.dtype)), k
        else:
            assert g == v, k
    train(model, opt, 1)  # training continues from the restored state
    return True


@pytest.mark.parametrize(
    "save_kind,save_world,load_kind,load_world",
    [("fsdp", 2, "fsdp", 2), ("tp", 2, "fsdp", 3)],
)
def test_model_and_optimizer_round_trip_across_parallelisms(tmp_path, save_kind, save_world, load_kind, load_world):
    path = str(tmp_path / "ckpt")
    ref = run_ranks(save_world, _save, save_kind, path, timeout=180)[0]
    run_ranks(load_world, _load_and_compare, load_kind, path, ref, timeout=180)
