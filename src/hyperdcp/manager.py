"""Finding the newest complete checkpoint under a root directory.

    path = hyperdcp.latest_checkpoint("ckpt")   # e.g. "ckpt/step-300", or None

A checkpoint counts only when its commit record (``hyperdcp.json``) is present and valid: interrupted
saves (temporary ``.<name>.hyperdcp-tmp-*`` directories, directories without metadata, damaged
metadata) are never picked. "Newest" is the largest step number in the name (the last integer in it,
e.g. ``step-300``, ``ckpt_0300``), ties and unnumbered names broken by the commit time recorded in the
metadata.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .errors import CheckpointError, CheckpointNotFoundError, FormatError
from .storage.commit import load_metadata, recover_under, torch_dcp_message
from .storage.urls import is_object_store

_NUM = re.compile(r"(\d+)(?!.*\d)")


def list_checkpoints(root: str | os.PathLike) -> list[str]:
    """Paths of the complete checkpoints directly under ``root``, oldest first."""
    root = os.fspath(root)
    if is_object_store(root):  # s3://bucket/run: committed records only (storage/object_listing.py)
        from .storage.object_listing import committed_checkpoints

        return committed_checkpoints(root)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root!r} is not a directory; pass the directory that holds the checkpoints")
    if torch_dcp_message(root):
        raise FormatError(torch_dcp_message(root) + "; latest_checkpoint takes the directory holding the checkpoints")
    recover_under(root)  # overwrites killed between their two renames (file systems without RENAME_EXCHANGE)
    found, torch_dcp = [], []
    for name in os.listdir(root):
        if name.startswith("."):  # temporary, old and lock entries of in-flight or interrupted saves
            continue
        p = os.path.join(root, name)
        if not os.path.isdir(p) or os.path.islink(p):
            continue
        try:
            meta = load_metadata(p)
        except CheckpointError:
            if torch_dcp_message(p):
                torch_dcp.append(name)
            continue
        m = _NUM.search(name)
        found.append((int(m.group(1)) if m else -1, meta.created_unix, name, p))
    if torch_dcp and not found:
        shown = ", ".join(sorted(torch_dcp)[:5]) + (" ..." if len(torch_dcp) > 5 else "")
        raise FormatError(
            f"{root!r} holds no hyperdcp checkpoint but {len(torch_dcp)} torch.distributed.checkpoint (torch DCP) "
            f"checkpoint(s) ({shown}); hyperdcp cannot load torch DCP checkpoints yet: load them with "
            "torch.distributed.checkpoint and save again with hyperdcp.save (or wait for the torch-dcp source)"
        )
    found.sort()
    return [p for *_, p in found]


def latest_checkpoint(root: str | os.PathLike, *, shared: bool | None = None, process_group: Any = None) -> str | None:
    """The newest complete checkpoint directly under ``root``, or None when there is none.

    When torch.distributed is initialized with several ranks (or ``shared=True``), rank 0 resolves it and
    sends the answer to every rank, so all ranks load the same checkpoint even while another job commits
    a newer one; every rank of the group must then call it. ``shared=False``: resolve on this rank alone.

    Raises :class:`~hyperdcp.FormatError` when ``root`` is itself a torch DCP checkpoint, or holds torch DCP
    checkpoints and no hyperdcp one (hyperdcp cannot load those yet; None would silently start afresh).
    """
    if shared is not False:
        from .api import coordinator_for

        coord = coordinator_for(process_group)
        if coord.world_size > 1:
            from .coordination.base import broadcast_checked

            def resolve() -> bytes:
                cps = list_checkpoints(root)
                return b"\x01" + os.fsencode(cps[-1]) if cps else b"\x00"

            raw = broadcast_checked(coord, f"finding the latest checkpoint under {os.fspath(root)!r}", resolve, 0)
            return os.fsdecode(raw[1:]) if raw[:1] == b"\x01" else None
    cps = list_checkpoints(root)
    return cps[-1] if cps else None


__all__ = ["latest_checkpoint", "list_checkpoints"]
