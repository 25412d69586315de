"""The error hierarchy in one module, with built-in mixins, and fix texts that name real functions.

A user's generic handler (``except FileNotFoundError``, ``except FileExistsError``, ``except ValueError``)
catches the hyperdcp error of the same meaning; every async-save error is a ``hyperdcp.errors`` class;
``hyperdcp.async_save`` is the function while the package is ``hyperdcp.async_saving``; and every
``hyperdcp.<name>`` that a message or docstring in the sources tells the user to call exists.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import numpy as np
import pytest

import hyperdcp
from hyperdcp import errors

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "hyperdcp"


def test_loading_a_missing_checkpoint_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        hyperdcp.load({"w": np.zeros(3)}, str(tmp_path / "never-saved"))
    assert isinstance(info.value, hyperdcp.CheckpointNotFoundError)
    assert "never-saved" in str(info.value)


def test_saving_over_a_checkpoint_without_overwrite_is_a_file_exists_error(tmp_path):
    path = str(tmp_path / "step-1")
    hyperdcp.save({"w": np.arange(3.0)}, path)
    with pytest.raises(FileExistsError) as info:
        hyperdcp.save({"w": np.arange(3.0) + 1}, path)
    assert isinstance(info.value, hyperdcp.CheckpointExistsError)
    assert "overwrite=True" in str(info.value)
    got = {"w": np.zeros(3)}
    hyperdcp.load(got, path)
    assert np.array_equal(got["w"], np.arange(3.0))  # the first checkpoint is intact


def test_a_shape_mismatch_and_a_broken_commit_record_are_value_errors(tmp_path):
    path = str(tmp_path / "step-1")
    hyperdcp.save({"w": np.arange(6.0)}, path)
    with pytest.raises(ValueError) as info:
        hyperdcp.load({"w": np.zeros(5)}, path)
    assert isinstance(info.value, hyperdcp.MismatchError) and "'w'" in str(info.value)
    record = tmp_path / "step-1" / "hyperdcp.json"
    record.write_bytes(record.read_bytes().replace(b'"format_version"', b'"format_versio"'))
    with pytest.raises(ValueError) as info:
        hyperdcp.read_metadata(path)
    assert isinstance(info.value, hyperdcp.FormatError)


def test_async_save_errors_live_in_errors_and_are_checkpoint_errors():
    import hyperdcp.async_saving as pkg

    for name in ("AsyncSaveError", "SaveInProgressError", "PersistProcessDiedError", "PersistProcessStuckError",
                 "AsyncSaveTimeoutError"):
        cls = getattr(errors, name)
        assert cls.__module__ == "hyperdcp.errors" and issubclass(cls, errors.CheckpointError)
        assert getattr(pkg, name) is cls and getattr(hyperdcp, name) is cls
    assert issubclass(errors.PersistProcessDiedError, errors.CoordinationError)
    assert issubclass(errors.AsyncSaveTimeoutError, TimeoutError)


def test_async_save_is_the_function_and_finalize_is_reachable_from_both_names():
    import hyperdcp.async_saving as pkg

    assert callable(hyperdcp.async_save) and hyperdcp.async_save is pkg.async_save
    assert hyperdcp.finalize is pkg.finalize
    assert hyperdcp.AsyncSaveOptions().coordination == "gloo"
    with pytest.raises(ValueError, match="coordination must be one of"):
        hyperdcp.AsyncSaveOptions(coordination="carrier-pigeon")


_NAMED = re.compile(r"\bhyperdcp\.([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")


def _resolves(dotted: str) -> bool:
    """Whether ``hyperdcp.<dotted>`` is a module or an attribute reachable from one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(["hyperdcp", *parts[:cut]]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    obj = hyperdcp
    try:
        for attr in parts:
            obj = getattr(obj, attr)
    except AttributeError:
        return False
    return True


def test_every_hyperdcp_name_in_messages_and_docstrings_exists():
    """A fix text like "call hyperdcp.async_save.finalize(path)" must not send the user to an AttributeError."""
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            for m in _NAMED.finditer(node.value):
                dotted = m.group(1).rstrip(".")
                if dotted in ("json", "rank") or dotted.startswith(("json.", "rank-")):
                    continue  # file names of the format (hyperdcp.json, hyperdcp.rank-00000.json), not functions
                if not _resolves(dotted):
                    missing.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: hyperdcp.{dotted}")
    assert not missing, "names that do not exist:\n" + "\n".join(missing)
