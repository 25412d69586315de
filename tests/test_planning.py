"""Save planning: deduplication, balanced writers, validation, and the plan cache."""

from __future__ import annotations

import numpy as np
import pytest

from hyperdcp.errors import MismatchError
from hyperdcp.planning.save_plan import LocalPlan, PlanCache, TensorSpec, plan_global


def plan(specs, rows, values=("step",)):
    tidx = [r[0] for r in rows]
    offs = [r[1] for r in rows]
    lens = [r[2] for r in rows]
    D = max(len(s.shape) for s in specs)
    return LocalPlan(specs, list(values), tidx, np.array(offs).reshape(-1, D), np.array(lens).reshape(-1, D))


W2 = [TensorSpec("w", "F32", (8, 4))]


def hsdp(R, S, rows=8, cols=4):
    """[Replicate, Shard(0)] on an (R, S) mesh: rank r holds row block r % S."""
    step = rows // S
    return [plan(W2, [(0, (step * (r % S), 0), (step, cols))]) for r in range(R * S)]


def test_each_unique_box_has_exactly_one_writer():
    g = plan_global(hsdp(2, 2))
    assert len(g.u_writer) == 2
    assert sorted(np.concatenate(g.assignments).tolist()) == [0, 0]  # each writer writes its one local chunk
    assert g.bytes_per_rank.sum() == 8 * 4 * 4  # unique bytes, not replicated bytes


def test_replicas_are_spread_over_holders_not_piled_on_the_lowest_rank():
    # 8 ranks, 4 replicas of 2 shards, several tensors: every rank should write something
    specs = [TensorSpec(f"t{i}", "F32", (8, 4)) for i in range(8)]
    plans = []
    for r in range(8):
        s = r % 2
        plans.append(plan(specs, [(i, (4 * s, 0), (4, 4)) for i in range(8)]))
    g = plan_global(plans)
    per = g.bytes_per_rank
    assert per.max() <= 1.05 * per.mean()
    assert (per > 0).all()


def test_writer_holds_the_box_it_writes():
    plans = hsdp(4, 2)
    g = plan_global(plans)
    for u, w in enumerate(g.u_writer):
        assert (g.u_offsets[u] == plans[w].offsets[g.assignments[w][g.u_slot[u]]]).all()


def test_singly_held_boxes_are_written_by_their_holder():
    plans = [plan(W2, [(0, (4 * r, 0), (4, 4))]) for r in range(2)]
    g = plan_global(plans)
    assert g.u_writer.tolist() == [0, 1]


def test_partial_overlap_is_refused():
    plans = [plan(W2, [(0, (0, 0), (4, 4))]), plan(W2, [(0, (0, 0), (6, 4))])]
    with pytest.raises(MismatchError, match="partially overlap"):
        plan_global(plans)


def test_overlap_with_different_starts_is_refused():
    plans = [plan(W2, [(0, (0, 0), (5, 4))]), plan(W2, [(0, (4, 0), (4, 4))])]
    with pytest.raises(MismatchError, match="overlap"):
        plan_global(plans)


def test_gap_is_refused():
    plans = [plan(W2, [(0, (0, 0), (3, 4))]), plan(W2, [(0, (4, 0), (4, 4))])]
    with pytest.raises(MismatchError, match="held by no rank"):
        plan_global(plans)


def test_out_of_bounds_box_is_refused():
    plans = [plan(W2, [(0, (0, 0), (4, 4))]), plan(W2, [(0, (4, 0), (8, 4))])]
    with pytest.raises(MismatchError, match="outside the global shape"):
        plan_global(plans)


def test_ranks_must_agree_on_shapes_and_keys():
    a = plan(W2, [(0, (0, 0), (8, 4))])
    b = plan([TensorSpec("w", "F32", (8, 5))], [(0, (0, 0), (8, 5))])
    with pytest.raises(MismatchError, match=r"rank 1 says \[8, 5\]"):
        plan_global([a, b])
    # keys held by some ranks only are allowed (issue 10); a key must not change kind between ranks
    c = plan(W2, [(0, (0, 0), (8, 4))], values=("other",))
    assert plan_global([a, c]).value_keys == ["other", "step"]
    e = LocalPlan([], ["w"], [], np.zeros((0, 0)), np.zeros((0, 0)))
    with pytest.raises(MismatchError, match="'w' is a tensor on rank 0 and a plain value on rank 1"):
        plan_global([a, e])


def test_local_plan_round_trips_through_bytes():
    p = plan(W2, [(0, (0, 0), (8, 4))])
    q = LocalPlan.from_bytes(p.to_bytes())
    assert q.tensors == p.tensors and q.value_keys == p.value_keys
    assert (q.rows == p.rows).all()
    assert q.digest(4) == p.digest(4) != p.digest(8)  # world size is part of the cache key


def test_plan_cache_is_bounded_and_keyed_by_all_digests():
    cache = PlanCache(capacity=2)
    k1, k2, k3 = (PlanCache.key([bytes([i]) * 16, b"x" * 16]) for i in range(3))
    cache.put(k1, "a")
    cache.put(k2, "b")
    assert cache.get(k1) == "a"
    cache.put(k3, "c")
    assert cache.get(k2) is None and cache.get(k1) == "a" and len(cache) == 2


def test_hsdp_on_8_ranks_balances_writers_within_5_percent():
    # a transformer-like state: embeddings, per-layer attention/MLP matrices, norms and biases, plus AdamW
    # moments of each, saved as HSDP mesh (4, 2) [Replicate, Shard(0)] (4 replicas of 2 shards)
    shapes = [(32000, 1024)]
    for _ in range(12):
        shapes += [(3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096), (1024,), (1024,), (4096,), (1024,)]
    shapes = shapes * 3  # parameters, exp_avg, exp_avg_sq
    specs = sorted((TensorSpec(f"t{i:04d}", "F32", s) for i, s in enumerate(shapes)), key=lambda s: s.fqn)
    plans = []
    for rank in range(8):
        shard = rank % 2
        rows = []
        for i, s in enumerate(specs):
            half = -(-s.shape[0] // 2)
            lo = min(shard * half, s.shape[0])
            n = min(half, s.shape[0] - lo)
            rows.append((i, (lo,) + (0,) * (len(s.shape) - 1) + (0,) * (2 - len(s.shape)),
                         (n,) + tuple(s.shape[1:]) + (1,) * (2 - len(s.shape))))
        plans.append(plan(specs, rows))
    g = plan_global(plans)
    per = g.bytes_per_rank
    unique = sum(int(np.prod(s.shape)) * 4 for s in specs)
    assert per.sum() == unique
    print(f"largest writer / mean writer: {per.max() / per.mean():.4f}")
    assert per.max() <= 1.05 * per.mean(), per / per.mean()


def test_huge_dimensions_use_64_bit_plans_and_mix_with_32_bit_ones():
    big = 3_000_000_000  # past int32
    specs = [TensorSpec("big", "U8", (big,)), TensorSpec("small", "F32", (4,))]
    a = LocalPlan(specs, [], [0, 1], [[0], [0]], [[big // 2], [4]])
    b = LocalPlan(specs, [], [0, 1], [[big // 2], [0]], [[big - big // 2], [4]])
    assert b.rows.dtype == np.int64  # the end of its box does not fit in int32
    g = plan_global([LocalPlan.from_bytes(a.to_bytes()), LocalPlan.from_bytes(b.to_bytes())])
    assert sorted(g.u_offsets[:, 0].tolist()) == [0, 0, big // 2]
    assert g.bytes_per_rank.sum() == big + 16
