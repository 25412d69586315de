"""Overwrite never destroys what is not a hyperdcp checkpoint (issue 10 part 4), an overwrite killed
between its two renames (no RENAME_EXCHANGE, e.g. NFS) loses nothing (issue 11 item 6), running out of
file descriptors while cleaning up is a CheckpointError that leaves nothing behind, and data-file names
are matched in full (issue 11 item 13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hyperdcp
from hyperdcp.hf import dcp_to_hf, hf_to_dcp
from hyperdcp.storage.local_commit import NO_EXCHANGE_ENV
from tests.faults.fuzz_campaign import sign


def _state(v: float) -> dict:
    return {"w": np.full((4, 3), v, np.float32), "b": np.arange(5, dtype=np.int64) + int(v), "step": int(v)}


def _loaded(path) -> dict:
    sd = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(5, np.int64), "step": None}
    hyperdcp.load(sd, path)
    return sd


def _same(a: dict, b: dict) -> bool:
    return all((np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]) for k in a)


def _tree(root) -> dict:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.readlink(p) if os.path.islink(p) else open(p, "rb").read()
    return out


# -- never delete what is not ours --------------------------------------------------------------
@pytest.mark.parametrize("overwrite", [False, True])
def test_directory_with_a_stray_file_is_never_replaced(tmp_path, overwrite):
    target = tmp_path / "run"
    target.mkdir()
    (target / "notes.txt").write_text("my experiment notes")
    with pytest.raises(hyperdcp.CheckpointExistsError, match=r"not a hyperdcp checkpoint.*'notes.txt' \(file\)"):
        hyperdcp.save(_state(1), str(target), overwrite=overwrite)
    assert (target / "notes.txt").read_text() == "my experiment notes"
    assert sorted(os.listdir(tmp_path)) == ["run"], "no temporary directory or lock left behind"


def test_checkpoint_holding_a_user_file_is_not_overwritten(tmp_path):
    path = str(tmp_path / "step-1")
    hyperdcp.save(_state(1), path)
    with open(os.path.join(path, "eval-results.json"), "w") as f:
        f.write('{"acc": 0.9}')
    os.mkdir(os.path.join(path, "plots"))
    with pytest.raises(hyperdcp.CheckpointExistsError, match=r"'eval-results.json' \(file\), 'plots' \(directory\)"):
        hyperdcp.save(_state(2), path, overwrite=True)
    assert _same(_loaded(path), _state(1))
    assert os.path.exists(os.path.join(path, "eval-results.json")) and os.path.isdir(os.path.join(path, "plots"))


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_symlink_at_the_path_is_never_followed_or_replaced(tmp_path, overwrite):
    elsewhere = tmp_path / "other-disk" / "precious"
    hyperdcp.save(_state(1), str(elsewhere))
    before = _tree(elsewhere)
    link = tmp_path / "ckpt"
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(hyperdcp.StorageError, match="symbolic link"):
        hyperdcp.save(_state(2), str(link), overwrite=overwrite)
    assert os.path.islink(link) and os.readlink(link) == str(elsewhere)
    assert _tree(elsewhere) == before
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(hyperdcp.StorageError, match="symbolic link"):
        hyperdcp.save(_state(2), str(dangling), overwrite=overwrite)
    assert os.path.islink(dangling) and not os.path.exists(tmp_path / "nowhere")


def test_a_no_collectives_async_save_never_writes_through_a_symlink(tmp_path):
    elsewhere = tmp_path / "precious"
    hyperdcp.save(_state(1), str(elsewhere))
    before = _tree(elsewhere)
    link = tmp_path / "ckpt"
    link.symlink_to(elsewhere, target_is_directory=True)
    fut = hyperdcp.async_save(_state(2), str(link), coordination="none", overwrite=True)
    with pytest.raises(hyperdcp.CheckpointError, match="symbolic link"):
        fut.result(timeout=120)
    assert _tree(elsewhere) == before


def test_a_symlink_inside_the_checkpoint_blocks_the_overwrite(tmp_path):
    path = str(tmp_path / "step-1")
    hyperdcp.save(_state(1), path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big.bin").write_bytes(b"x" * 10)
    os.symlink(tmp_path / "data", os.path.join(path, "r00099-00.safetensors"))
    with pytest.raises(hyperdcp.CheckpointExistsError, match=r"'r00099-00.safetensors' \(link\)"):
        hyperdcp.save(_state(2), path, overwrite=True)
    assert (tmp_path / "data" / "big.bin").read_bytes() == b"x" * 10


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_empty_directory_is_a_valid_target(tmp_path, overwrite):
    target = tmp_path / "empty"
    target.mkdir()
    hyperdcp.save(_state(3), str(target), overwrite=overwrite)
    assert _same(_loaded(str(target)), _state(3))


def test_an_interrupted_save_of_ours_is_replaced_only_with_overwrite(tmp_path):
    path = str(tmp_path / "step-1")
    hyperdcp.save(_state(1), path)
    os.unlink(os.path.join(path, "hyperdcp.json"))  # what a no-collectives save killed before its record leaves
    with pytest.raises(hyperdcp.CheckpointExistsError, match="incomplete hyperdcp checkpoint.*overwrite=True"):
        hyperdcp.save(_state(2), path)
    hyperdcp.save(_state(2), path, overwrite=True)
    assert _same(_loaded(path), _state(2))


def test_a_torch_dcp_checkpoint_is_named_and_kept(tmp_path):
    path = tmp_path / "torch-step-5"
    path.mkdir()
    (path / ".metadata").write_bytes(b"torch pickled metadata")
    (path / "__0_0.distcp").write_bytes(b"torch data")
    with pytest.raises(hyperdcp.CheckpointExistsError, match="torch.distributed.checkpoint"):
        hyperdcp.save(_state(1), str(path), overwrite=True)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp"]


def test_hf_conversion_into_a_foreign_directory_is_refused(tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    src.mkdir()
    save_file({"w": np.ones((2, 2), np.float32)}, str(src / "model.safetensors"))
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.me").write_text("x")
    with pytest.raises(hyperdcp.CheckpointExistsError, match="keep.me"):
        hf_to_dcp(str(src), str(dst), overwrite=True)
    assert sorted(os.listdir(dst)) == ["keep.me"]


# -- overwrite without RENAME_EXCHANGE ------------------------------------------------------------
def test_overwrite_through_the_two_rename_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv(NO_EXCHANGE_ENV, "1")  # the documented switch: commit as on NFS
    path = str(tmp_path / "step-1")
    hyperdcp.save(_state(1), path)
    hyperdcp.save(_state(2), path, overwrite=True)
    assert _same(_loaded(path), _state(2))
    assert sorted(os.listdir(tmp_path)) == ["step-1"], "the replaced checkpoint and the lock are gone"


def _kill_between_renames(tmp_path) -> str:
    """The state a kill between the fallback's two renames leaves: the old checkpoint set aside in
    ``.step-1.hyperdcp-old-*``, the new one complete in the temporary directory, nothing at the path."""
    path = str(tmp_path / "step-1")
    hyperdcp.save(_state(1), path)
    staged = str(tmp_path / "staged")
    hyperdcp.save(_state(2), staged)
    os.rename(path, str(tmp_path / ".step-1.hyperdcp-old-0123456789ab"))
    os.rename(staged, str(tmp_path / ".step-1.hyperdcp-tmp-ba9876543210"))
    assert not os.path.exists(path)
    return path


@pytest.mark.parametrize("access", ["load", "read_metadata", "latest_checkpoint", "save"])
def test_a_checkpoint_set_aside_by_a_killed_overwrite_is_recovered(tmp_path, access):
    path = _kill_between_renames(tmp_path)
    if access == "load":
        assert _same(_loaded(path), _state(1))
    elif access == "read_metadata":
        assert hyperdcp.read_metadata(path).values["step"] == 1
    elif access == "latest_checkpoint":
        assert hyperdcp.latest_checkpoint(str(tmp_path)) == path
    else:
        with pytest.raises(hyperdcp.CheckpointExistsError, match="already exists"):
            hyperdcp.save(_state(3), path)  # without overwrite: the recovered checkpoint is there
    assert _same(_loaded(path), _state(1)), "the previous checkpoint is back at its path, intact"
    hyperdcp.save(_state(3), path, overwrite=True)
    assert _same(_loaded(path), _state(3))
    assert sorted(os.listdir(tmp_path)) == ["step-1"], "the next save removes the leftovers"


def test_a_damaged_set_aside_copy_is_not_restored(tmp_path):
    path = _kill_between_renames(tmp_path)
    old = str(tmp_path / ".step-1.hyperdcp-old-0123456789ab")
    data = [n for n in os.listdir(old) if n.endswith(".safetensors")][0]
    os.truncate(os.path.join(old, data), 8)
    with pytest.raises(hyperdcp.IncompleteCheckpointError):
        hyperdcp.read_metadata(path)
    assert os.path.isdir(old) and not os.path.exists(path)


# -- file descriptors exhausted ----------------------------------------------------------------
_EMFILE_SCRIPT = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np
    import hyperdcp
    root = sys.argv[1]
    sd = {"w": np.arange(10, dtype=np.float32)}
    hyperdcp.save(sd, os.path.join(root, "c"))
    out = []
    for headroom in range(8):
        leftover = os.path.join(root, ".c.hyperdcp-tmp-000000000000")
        os.makedirs(leftover, exist_ok=True)
        open(os.path.join(leftover, "r00000-00.safetensors"), "w").close()
        before = sorted(os.listdir(root))
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (len(os.listdir("/proc/self/fd")) + 40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for _ in range(headroom):
            os.close(held.pop())
        try:
            hyperdcp.save(sd, os.path.join(root, "c"), overwrite=True)
            outcome = "ok"
        except hyperdcp.CheckpointError as e:
            outcome = "CheckpointError"
        except BaseException as e:
            outcome = f"raw {type(e).__name__}: {e}"
        for fd in held:
            os.close(fd)
        after = sorted(os.listdir(root))
        out.append([headroom, outcome, sorted(set(after) - set(before)), after])
    print(json.dumps(out))
""")


def test_running_out_of_file_descriptors_is_a_checkpoint_error_that_leaves_nothing(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))
    proc = subprocess.run([sys.executable, "-c", _EMFILE_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for headroom, outcome, new, after in rows:
        assert outcome in ("ok", "CheckpointError"), (headroom, outcome)
        assert new == [], f"with {headroom} free descriptors the save left {new} behind"
        if outcome == "ok":
            assert after == ["c"], "a save that succeeds removes the leftover of the earlier one"
    assert rows[-1][1] == "ok", "with enough descriptors the save succeeds"


# -- data-file names -------------------------------------------------------------------------
def test_a_data_file_name_ending_in_a_newline_is_rejected(tmp_path):
    path = str(tmp_path / "step-1")
    hyperdcp.save(_state(1), path)
    raw = open(os.path.join(path, "hyperdcp.json"), "rb").read()
    doc = json.loads(raw)
    del doc["metadata_checksum"]
    name = doc["files"][0]["name"]
    os.rename(os.path.join(path, name), os.path.join(path, name + "\n"))
    doc["files"][0]["name"] = name + "\n"
    open(os.path.join(path, "hyperdcp.json"), "wb").write(sign(doc))
    with pytest.raises(hyperdcp.FormatError, match="plain, unique file name"):
        hyperdcp.read_metadata(path)


def test_an_hf_export_never_writes_through_a_symlink(tmp_path):
    ckpt = str(tmp_path / "c")
    hyperdcp.save(_state(1), ckpt)
    elsewhere = tmp_path / "someone-elses-model"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"their weights")
    (tmp_path / "export").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(hyperdcp.StorageError, match="symbolic link"):
        dcp_to_hf(ckpt, str(tmp_path / "export"), overwrite=True)
    assert (elsewhere / "model.safetensors").read_bytes() == b"their weights"


# -- on several ranks ------------------------------------------------------------------------------
def _two_rank_overwrites(rank, world, root):
    stray = os.path.join(root, "foreign")
    try:
        hyperdcp.save(_state(1), stray, overwrite=True)
        refused = "no error"
    except hyperdcp.CheckpointError as e:
        refused = f"{type(e).__name__}: {e}"
    path = os.path.join(root, "step-1")
    hyperdcp.save(_state(1), path)
    hyperdcp.save(_state(2), path, overwrite=True)  # through the two-rename fallback (env below)
    return refused, _same(_loaded(path), _state(2))


def test_a_refused_overwrite_fails_every_rank_and_the_fallback_commits_on_two_ranks(tmp_path):
    from tests.dist import run_ranks

    os.mkdir(tmp_path / "foreign")
    (tmp_path / "foreign" / "notes.txt").write_text("keep")
    out = run_ranks(2, _two_rank_overwrites, str(tmp_path), timeout=90, env={NO_EXCHANGE_ENV: "1"})
    for rank, (refused, ok) in enumerate(out):
        assert "notes.txt" in refused, (rank, refused)
        assert ok, f"rank {rank} loads the overwritten checkpoint"
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["foreign", "step-1"]
