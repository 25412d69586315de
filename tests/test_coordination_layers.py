"""The coordination layer and the read-once split (issue 12): checked steps, Transport, and the layering
rules the split exists for (read-once imports no framework; its pure half no I/O or collectives)."""

from __future__ import annotations

import ast
import os

import numpy as np
import pytest

from tests.dist import run_ranks

SRC = os.path.join(os.path.dirname(__file__), "..", "src", "hyperdcp")


def _imports(relpath: str) -> set[str]:
    """Every module a source file imports, function-level imports included, as absolute dotted names."""
    path = os.path.join(SRC, relpath)
    package = "hyperdcp." + os.path.dirname(relpath).replace(os.sep, ".") if os.path.dirname(relpath) else "hyperdcp"
    tree = ast.parse(open(path).read(), path)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("relpath", ["loading/read_once.py", "loading/reads.py", "loading/targets.py",
                                     "loading/flow.py", "planning/read_once.py", "coordination/checked.py",
                                     "coordination/base.py", "coordination/shm.py", "coordination/files.py"])
def test_read_once_and_coordination_import_no_framework(relpath):
    """Read-once talks to other ranks through Coordinator + Transport only, so it can serve any framework."""
    bad = sorted(m for m in _imports(relpath) if m.split(".")[0] in ("torch", "jax", "mindspore"))
    assert not bad, f"{relpath} imports {bad}"


def test_pure_read_once_planning_does_no_io_and_no_collectives():
    mods = _imports("planning/read_once.py")
    bad = sorted(m for m in mods if m.startswith(("hyperdcp.coordination", "hyperdcp.loading",
                                                  "hyperdcp.storage.reader",
                                                 "hyperdcp.exchange")) or m in ("os", "mmap", "socket"))
    assert not bad, bad


def test_the_bottom_of_loading_imports_nothing_above_it():
    """reads.py is what read-once and the flow share: it must not import them back (the old cycle)."""
    for rel in ("loading/reads.py", "loading/targets.py"):
        up = sorted(m for m in _imports(rel) if m.startswith(("hyperdcp.loading", "hyperdcp.exchange", "hyperdcp.hf")))
        assert not up, (rel, up)
    assert not any(m.startswith(("hyperdcp.loading.flow", "hyperdcp.exchange"))
                   for m in _imports("loading/read_once.py"))


def test_old_import_paths_resolve_to_the_moved_code():
    import importlib

    import hyperdcp.api
    import hyperdcp.coordination.base as base
    import hyperdcp.coordination.wire as old_wire
    import hyperdcp.exchange as old_exchange
    import hyperdcp.shm as old_shm
    from hyperdcp import coordination, loading
    from hyperdcp.coordination import checked, files, local, shm
    from hyperdcp.core import wire
    from hyperdcp.loading import read_once as ro
    from hyperdcp.planning import read_once as pro

    old_files = importlib.import_module("hyperdcp.async_save.file_coordination")  # the function hides the package
    assert old_wire.pack is wire.pack and old_wire.unpack is wire.unpack
    assert old_files.FileCoordinator is files.FileCoordinator and old_files.write_abort is files.write_abort
    assert old_shm is shm  # setting an attribute through the old path acts on the real module
    assert base.LocalCoordinator is local.LocalCoordinator is coordination.LocalCoordinator
    assert base.run_checked is checked.run_checked and base.broadcast_checked is checked.broadcast_checked
    assert hyperdcp.api.coordinator_for is coordination.default_coordinator
    assert old_exchange.build_schedule is pro.build_schedule and old_exchange.read_once is ro.read_once
    assert old_exchange._Segment is shm.Segment and old_exchange._LIVE is shm._LIVE
    assert loading.read_chunk is loading.reads.read_chunk and loading.plan_targets is loading.targets.plan_targets
    assert isinstance(coordination.default_coordinator(), local.LocalCoordinator)


def test_an_error_marked_raised_everywhere_is_not_exchanged_again():
    """A rank that already raised an error on every rank at one step must not wait for the others again."""
    from hyperdcp.coordination import LocalCoordinator, RaisedEverywhere
    from hyperdcp.coordination.checked import check_all

    class Counting(LocalCoordinator):
        calls = 0

        def all_gather(self, data: bytes) -> list[bytes]:
            Counting.calls += 1
            return super().all_gather(data)

    err = ValueError("tensor 'w': broken on rank 0")
    with pytest.raises(ValueError):
        check_all(Counting(), "a step", RaisedEverywhere.mark(err))
    assert Counting.calls == 0 and RaisedEverywhere.on(err)
    with pytest.raises(ValueError):
        check_all(Counting(), "a step", ValueError("not marked"))
    assert Counting.calls == 2  # the flag, then the error texts


def _plan_and_scatter(rank, world, fail):
    from hyperdcp.coordination import default_coordinator
    from hyperdcp.coordination.checked import gather_checked, plan_and_scatter
    from hyperdcp.errors import RemoteRankError

    coord = default_coordinator()

    def write():
        if fail and rank == 2:
            raise OSError("no space left writing file 'data-2' (rank 2)")
        return f"wrote{rank}".encode()

    results, err = gather_checked(coord, "writing data files", write)
    gathered = (results, type(err).__name__ if err else None, str(err) if err else None)

    def plan(payloads):
        if fail:
            raise ValueError("no plan for tensor 'w' (rank 0)")
        return [p + b"->" + str(r).encode() for r, p in enumerate(payloads)]

    try:
        return gathered, ("ok", plan_and_scatter(coord, "global planning", f"rank{rank}".encode(), plan))
    except RemoteRankError as e:
        return gathered, ("remote", str(e))
    except ValueError as e:
        return gathered, ("local", str(e))


def test_gather_checked_and_plan_and_scatter_surface_an_error_on_one_rank_where_it_belongs():
    """gather_checked: the root gets every result, or the first failing rank's error to raise at its next
    step (the failing rank keeps its own); plan_and_scatter: each rank gets its part, or every rank fails
    on the root's planning error."""
    pytest.importorskip("torch")
    ok = run_ranks(3, _plan_and_scatter, False, timeout=60)
    assert ok[0][0] == ([b"wrote0", b"wrote1", b"wrote2"], None, None)
    assert ok[1][0] == ok[2][0] == (None, None, None)
    assert [r[1] for r in ok] == [("ok", b"rank0->0"), ("ok", b"rank1->1"), ("ok", b"rank2->2")]

    bad = run_ranks(3, _plan_and_scatter, True, timeout=60)
    results, kind, msg = bad[0][0]
    assert results[:2] == [b"wrote0", b"wrote1"] and kind == "RemoteRankError"
    assert "writing data files failed on rank 2" in msg and "data-2" in msg, msg
    assert bad[1][0] == (None, None, None)
    assert bad[2][0][0] is None and bad[2][0][1] == "OSError"  # its own error, raised at its next step
    assert bad[0][1] == ("local", "no plan for tensor 'w' (rank 0)")
    for _, (kind, msg) in bad[1:]:
        assert kind == "remote" and "global planning failed on rank 0" in msg and "tensor 'w'" in msg, msg


def _transport(rank, world):
    from hyperdcp.coordination import Transport, default_coordinator

    coord = default_coordinator()
    assert isinstance(coord, Transport)
    peer = 1 - rank
    out = np.arange(8, dtype=np.uint8) + 10 * rank
    got = np.zeros(8, dtype=np.uint8)
    handles = [coord.irecv(got, peer, tag=3), coord.isend(out, peer, tag=3)]
    bcast = np.arange(5, dtype=np.uint8) * 7 if rank == 1 else np.zeros(5, dtype=np.uint8)
    handles.append(coord.broadcast_in(bcast, 1, None))  # None: the coordinator's own group
    coord.wait(handles)
    return got.tolist(), bcast.tolist()


def test_torch_coordinator_moves_buffers_point_to_point_as_a_transport():
    pytest.importorskip("torch")
    res = run_ranks(2, _transport, timeout=60)
    assert res[0] == (list(range(10, 18)), [0, 7, 14, 21, 28])
    assert res[1] == (list(range(0, 8)), [0, 7, 14, 21, 28])
