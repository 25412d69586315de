"""Per-rank state (issue 10): values and plain tensors that differ between ranks, and keys only some ranks
hold, come back to each rank exactly as it saved them; identical ones are stored once."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")

import hyperdcp  # noqa: E402
from hyperdcp.errors import MismatchError  # noqa: E402
from tests.dist import run_ranks  # noqa: E402


class DataLoaderLike:
    """Shaped like torchtitan's ParallelAwareDataloader: its state is ``{"dp_rank_<i>": bytes}``."""

    def __init__(self, rank: int, samples: int = 100):
        self.rank, self.samples, self.pos = rank, samples, 0

    def __iter__(self):
        while self.pos < self.samples:
            self.pos += 1
            yield self.rank * 1000 + self.pos

    def state_dict(self) -> dict:
        return {f"dp_rank_{self.rank}": json.dumps({"pos": self.pos}).encode()}

    def load_state_dict(self, sd: dict) -> None:
        mine = sd[f"dp_rank_{self.rank}"]  # torchtitan: a missing own key is an error
        self.pos = json.loads(mine)["pos"]


def _training_state(rank: int, steps: int) -> tuple[dict, object]:
    """A training loop's state after ``steps`` steps on ``rank``, and its data iterator."""
    torch.manual_seed(1234 + rank)  # per-rank RNG, as data-parallel augmentation does
    random.seed(99 + rank)
    dl = DataLoaderLike(rank)
    it = iter(dl)
    for _ in range(steps + rank):  # ranks are at different positions of their streams
        next(it)
        torch.rand(3)
        random.random()
    state = {
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},  # identical on every rank
        "dataloader": dl,
        "counter": 10 + rank,
        "step": steps,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    return state, it


def _resume(rank, world, root):
    state, it = _training_state(rank, steps=5)
    res = hyperdcp.save(state, f"{root}/ckpt")
    want = [next(it) for _ in range(3)] + torch.rand(2).tolist() + [random.random()]  # the run going on
    # the fresh job: other seeds, data loaders at the start
    torch.manual_seed(0)
    random.seed(0)
    dl = DataLoaderLike(rank)
    back = {"model": {"w": torch.zeros(2, 3)}, "dataloader": dl, "counter": 0, "step": 0,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
    hyperdcp.load(back, f"{root}/ckpt")
    torch.set_rng_state(back["rng"]["torch"])
    random.setstate(back["rng"]["python"])
    it = iter(dl)
    got = [next(it) for _ in range(3)] + torch.rand(2).tolist() + [random.random()]
    return got, want, back["counter"], back["step"], res.bytes_written


def test_resume_restores_every_ranks_own_data_loader_counter_and_rng(tmp_path):
    outs = run_ranks(2, _resume, str(tmp_path))
    for rank, (got, want, counter, step, _) in enumerate(outs):
        assert got == want, f"rank {rank} did not resume its own data stream / RNG"
        assert counter == 10 + rank and step == 5
    meta = hyperdcp.read_metadata(tmp_path / "ckpt")
    # what differs is stored per rank, what is equal once
    assert sorted(meta.per_rank_values) == ["counter", "dataloader", "rng.python"]
    assert meta.per_rank_values["counter"] == {0: 10, 1: 11}
    assert meta.per_rank_values["dataloader"] == {0: {"dp_rank_0": b'{"pos": 5}'}, 1: {"dp_rank_1": b'{"pos": 6}'}}
    assert meta.values == {"step": 5}
    assert meta.per_rank_tensors == {"rng.torch": (0, 1)}
    assert meta.tensors["rng.torch"].shape == (2,) + tuple(torch.get_rng_state().shape)
    assert meta.tensors["model.w"].shape == (2, 3) and len(meta.tensors["model.w"].chunks) == 1
    # a torch RNG state stored twice plus the model once: nothing else on disk but headers
    rng_bytes = torch.get_rng_state().numel()
    assert meta.tensor_bytes == 2 * rng_bytes + 6 * 4


def _save_mixed(rank, world, root):
    state = {
        "shared": torch.full((4,), 3.0),  # a plain tensor equal on every rank: stored once
        "bias": torch.full((3,), float(rank)),  # a plain tensor that differs: stored per rank
        "counter": 10 + rank,
        f"only{rank}": {"rank": rank},  # a key only this rank holds
        "lr": 0.5,
    }
    if rank == 0:
        state["zero_only"] = torch.tensor([7, 8])  # a tensor only rank 0 holds
    hyperdcp.save(state, f"{root}/mixed")
    back = {"shared": torch.zeros(4), "bias": torch.zeros(3), "counter": 0, f"only{rank}": None, "lr": 0.0}
    if rank == 0:
        back["zero_only"] = torch.zeros(2, dtype=torch.int64)
    hyperdcp.load(back, f"{root}/mixed")
    assert back[f"only{rank}"] == {"rank": rank}
    assert back["counter"] == 10 + rank and back["lr"] == 0.5
    assert torch.equal(back["bias"], torch.full((3,), float(rank)))
    assert torch.equal(back["shared"], torch.full((4,), 3.0))
    if rank == 0:
        assert torch.equal(back["zero_only"], torch.tensor([7, 8]))
    # a key this rank did not save is missing for it, even if another rank saved it
    other = {f"only{1 - rank}": None}
    with pytest.raises(MismatchError, match=f"only{1 - rank}"):
        hyperdcp.load(other, f"{root}/mixed")
    res = hyperdcp.load(other, f"{root}/mixed", strict=False)
    assert res.missing_keys == [f"only{1 - rank}"] and other[f"only{1 - rank}"] is None
    return True


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A checkpoint saved by 2 ranks with values and tensors that differ, or that one rank holds only."""
    root = tmp_path_factory.mktemp("mixed")
    run_ranks(2, _save_mixed, str(root))
    return root


def test_values_and_tensors_differing_or_held_by_some_ranks(mixed):
    tmp_path = mixed
    meta = hyperdcp.read_metadata(tmp_path / "mixed")
    assert meta.values == {"lr": 0.5}
    assert meta.per_rank_values == {"counter": {0: 10, 1: 11}, "only0": {0: {"rank": 0}}, "only1": {1: {"rank": 1}}}
    assert meta.per_rank_tensors == {"bias": (0, 1)}
    assert "zero_only" in meta.tensors and "zero_only" not in meta.per_rank_tensors
    assert len(meta.tensors["shared"].chunks) == 1

    # another number of ranks: per-rank entries need to be told how to map
    one = {"bias": torch.zeros(3), "counter": 0, "lr": 0.0, "shared": torch.zeros(4)}
    with pytest.raises(MismatchError, match=r"'bias' was saved per rank .* per_rank='rank0'"):
        hyperdcp.load(one, tmp_path / "mixed")
    assert one["counter"] == 0 and one["lr"] == 0.0  # a failed load sets nothing
    hyperdcp.load(one, tmp_path / "mixed", per_rank="rank0")
    assert one["counter"] == 10 and torch.equal(one["bias"], torch.zeros(3)) and one["lr"] == 0.5
    seen = []

    def take_last(key, rank, world, saved):
        seen.append((key, rank, world, saved))
        return saved[-1]

    one = {"bias": torch.zeros(3), "counter": 0}
    hyperdcp.load(one, tmp_path / "mixed", per_rank=take_last, strict=False)
    assert one["counter"] == 11 and torch.equal(one["bias"], torch.ones(3))
    assert sorted(seen) == [("bias", 0, 1, (0, 1)), ("counter", 0, 1, (0, 1))]
    one = {"bias": torch.full((3,), 9.0), "counter": -1, "shared": torch.zeros(4)}
    res = hyperdcp.load(one, tmp_path / "mixed", per_rank="drop", strict=False)
    assert one["counter"] == -1 and torch.equal(one["bias"], torch.full((3,), 9.0))
    assert torch.equal(one["shared"], torch.full((4,), 3.0))
    assert {"bias", "counter"} <= set(res.unused_keys)
    with pytest.raises(MismatchError, match="per_rank returned 5 for 'counter'"):
        hyperdcp.load({"counter": 0}, tmp_path / "mixed", per_rank=lambda *a: 5)
    # renamed keys keep their per-rank copies
    renamed = {"ctr": 0, "b": torch.zeros(3)}
    names = {"counter": "ctr", "bias": "b"}
    hyperdcp.load(renamed, tmp_path / "mixed", key_map=lambda k: names.get(k, k), per_rank=take_last, strict=False)
    assert renamed["ctr"] == 11 and torch.equal(renamed["b"], torch.ones(3))
    with pytest.raises(TypeError, match="per_rank must be None, 'rank0', 'drop' or fn"):
        hyperdcp.load({"counter": 0}, tmp_path / "mixed", per_rank="first")


def _load_on_three(rank, world, root):
    back = {"bias": torch.zeros(3), "counter": 0}
    with pytest.raises(MismatchError, match="saved per rank"):
        hyperdcp.load(back, f"{root}/mixed")
    hyperdcp.load(back, f"{root}/mixed", per_rank=lambda key, r, w, saved: saved[r % len(saved)])
    return back["counter"], back["bias"].tolist()


def test_load_per_rank_entries_on_more_ranks_with_a_mapping(mixed):
    outs = run_ranks(3, _load_on_three, str(mixed))
    assert outs == [(10, [0.0] * 3), (11, [1.0] * 3), (10, [0.0] * 3)]


def _cache_rounds(rank, world, root):
    """Saves of one structure: values and a plain tensor turn per-rank and back; nothing is cached away."""
    out = []
    rounds = [(5, 1.0), (5 + rank, 1.0), (5 + rank, 1.0 + rank), (7, 2.0)]
    for i, (counter, fill) in enumerate(rounds):
        state = {"w": torch.full((2,), fill), "counter": counter, "m": torch.arange(4.0)}
        res = hyperdcp.save(state, f"{root}/s{i}")
        back = {"w": torch.zeros(2), "counter": 0, "m": torch.zeros(4)}
        hyperdcp.load(back, f"{root}/s{i}")
        assert back["counter"] == counter and torch.equal(back["w"], torch.full((2,), fill)), (i, rank)
        out.append(res.plan_cache_hit)
    return out


def test_plan_cache_still_detects_values_turning_per_rank_and_back(tmp_path):
    hits = run_ranks(2, _cache_rounds, str(tmp_path))
    # values never enter the plan (round 1 reuses round 0's); a tensor turning per-rank changes it
    assert hits[0] == hits[1] == [False, True, False, True]
    metas = [hyperdcp.read_metadata(tmp_path / f"s{i}") for i in range(4)]
    assert metas[0].values == {"counter": 5} and not metas[0].per_rank_values and not metas[0].per_rank_tensors
    assert metas[1].per_rank_values == {"counter": {0: 5, 1: 6}} and not metas[1].per_rank_tensors
    assert metas[2].per_rank_tensors == {"w": (0, 1)}
    assert metas[3].values == {"counter": 7} and not metas[3].per_rank_values and not metas[3].per_rank_tensors


def _async_none(rank, world, root):
    state = {"m": torch.arange(4.0), "counter": 10 + rank, "step": 3, f"only{rank}": b"x" * (rank + 1)}
    hyperdcp.async_save(state, f"{root}/a", coordination="none").result(timeout=60)
    back = {"m": torch.zeros(4), "counter": 0, "step": 0, f"only{rank}": None}
    hyperdcp.load(back, f"{root}/a")
    # a plain tensor that differs cannot be compared without communication: refused, never collapsed
    hyperdcp.async_save({"bias": torch.full((2,), float(rank))}, f"{root}/b", coordination="none").result(timeout=60)
    with pytest.raises(hyperdcp.CheckpointError,
                       match=r"tensor 'bias' whole with different contents.*coordination='gloo'"):
        hyperdcp.load({"bias": torch.zeros(2)}, f"{root}/b")
    return back["counter"], back["step"], back[f"only{rank}"]


def test_no_collectives_async_save_keeps_per_rank_values(tmp_path):
    outs = run_ranks(2, _async_none, str(tmp_path))
    assert outs == [(10, 3, b"x"), (11, 3, b"xx")]
    from hyperdcp.async_save.rank_files import merge

    meta = merge(str(tmp_path / "a"))
    assert meta.values == {"step": 3}
    assert meta.per_rank_values == {"counter": {0: 10, 1: 11}, "only0": {0: b"x"}, "only1": {1: b"xx"}}


def test_per_rank_member_is_validated(tmp_path):
    """A damaged per_rank member is refused naming the key, like any other metadata damage."""
    from hyperdcp.errors import FormatError
    from hyperdcp.format.metadata import Metadata

    meta = Metadata(world_size=2, files=[], tensors={}, values={"a": 1}, per_rank_values={"c": {0: 1, 1: 2}})
    assert Metadata.from_json(meta.to_json()).per_rank_values == {"c": {0: 1, 1: 2}}
    for bad, why in [({"c": {0: 1, 2: 2}}, "'c': ranks must be"), ({"a": {0: 1}}, "'a' is both")]:
        raw = Metadata(world_size=2, files=[], tensors={}, values={"a": 1}, per_rank_values=bad).to_json()
        with pytest.raises(FormatError, match=why):
            Metadata.from_json(raw)
    # a checkpoint without per-rank entries is written exactly as before (no new member)
    assert b"per_rank" not in Metadata(world_size=2, files=[], tensors={}, values={"a": 1}).to_json()


def test_planner_stores_differing_whole_tensors_as_rows_and_refuses_partial_holders():
    """At the planner: what differs becomes per rank, and a per-rank tensor must be held whole."""
    import numpy as np

    from hyperdcp.planning.save_plan import LocalPlan, TensorSpec, classify_per_rank, content_table, plan_global

    w = TensorSpec("w", "F32", (4,))
    # ranks 0 and 2 hold w whole with one content, rank 1 with another; "step" equal; "pos" differs
    tables = [content_table(["w"], [d], ["pos", "step"], [p, 5]) for d, p in [(1, 10), (2, 11), (1, 10)]]
    pr = classify_per_rank(tables, 3)
    assert pr.values == ["pos"] and {k: v.tolist() for k, v in pr.tensors.items()} == {"w": [0, 1, 2]}
    # a key only ranks 0 and 1 hold, even with equal values, is per rank; a tensor only some hold is not
    tables = [content_table(["w"], [1], ["only"], [7]), content_table(["w"], [1], ["only"], [7]),
              content_table([], [], [], [])]
    pr = classify_per_rank(tables, 3)
    assert pr.values == ["only"] and not pr.tensors

    whole = [LocalPlan([w], [], [0], np.array([[0]]), np.array([[4]])) for _ in range(3)]
    g = plan_global(whole, {"w": np.array([0, 1, 2])})
    assert g.tensors == [TensorSpec("w", "F32", (3, 4))] and g.per_rank == {"w": (0, 1, 2)}
    assert g.u_offsets.tolist() == [[0, 0], [1, 0], [2, 0]] and g.u_writer.tolist() == [0, 1, 2]
    partial = whole[:2] + [LocalPlan([w], [], [0], np.array([[0]]), np.array([[2]]))]
    with pytest.raises(MismatchError,
                       match="'w' differs between the ranks holding it whole, but rank 2 holds only a part"):
        plan_global(partial, {"w": np.array([0, 1])})
