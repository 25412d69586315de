"""Checkpoints of a training run under one root: :class:`CheckpointManager` and the newest complete one.

    mgr = hyperdcp.CheckpointManager("ckpt", keep_last=3, save_interval_steps=500, async_save=True)
    step = mgr.restore(state)                   # newest committed step loaded in place; None on a fresh start
    mgr.save(step, state, metrics={"loss": l})  # no-op unless should_save(step)
    mgr.close()

    path = hyperdcp.latest_checkpoint("ckpt")   # e.g. "ckpt/step-300", or None

A checkpoint counts only when its commit record (``hyperdcp.json``) is present and valid: interrupted
saves (temporary ``.<name>.hyperdcp-tmp-*`` directories, directories without metadata, damaged
metadata) are never picked. "Newest" is the largest step number in the name (the last integer in it,
e.g. ``step-300``, ``ckpt_0300``), ties and unnumbered names broken by the commit time recorded in the
metadata.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import string
import sys
import time
from typing import Any, Iterable

from .api import load, save
from .async_saving import async_save
from .coordination import default_coordinator
from .coordination.base import broadcast_checked, check_all
from .errors import CheckpointError, CheckpointNotFoundError, FormatError
from .format.metadata import Metadata
from .options import LoadOptions, SaveOptions
from .retention import Retention, SaveSchedule, StepInfo
from .storage.commit import load_metadata, recover_under, torch_dcp_message
from .storage.urls import is_object_store, is_registered, is_remote, local_path, storage_for, url_join

log = logging.getLogger("hyperdcp")
#: the key of the manager's entry in a checkpoint's user metadata (``Metadata.user``)
USER_KEY = "hyperdcp.manager"

_NUM = re.compile(r"(\d+)(?!.*\d)")


def list_checkpoints(root: str | os.PathLike) -> list[str]:
    """Paths of the complete checkpoints directly under ``root``, oldest first."""
    root = os.fspath(root)
    if is_object_store(root):  # s3://bucket/run: committed records only (storage/object_listing.py)
        from .storage.object_listing import committed_checkpoints

        return committed_checkpoints(root)
    if is_registered(root):  # a scheme of register_storage: its own listing and commit records
        return _committed_in_storage(root)
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


def _committed_in_storage(root: str) -> list[str]:
    """URLs of the committed checkpoints under the URL ``root`` of a registered scheme, oldest first."""
    root = root.rstrip("/")
    st = storage_for(root)
    try:
        names = st.list()
    except CheckpointNotFoundError:
        names = []
    finally:
        st.close()
    found = []
    for name in names:
        if name.startswith("."):  # temporaries, trash and locks of saves and deletions
            continue
        try:
            meta = _read_committed(url_join(root, name))
        except (CheckpointError, OSError):
            continue
        m = _NUM.search(name)
        found.append((int(m.group(1)) if m else -1, meta.created_unix, name, url_join(root, name)))
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


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete (committed) hyperdcp checkpoint; never raises for a missing path."""
    try:
        _read_committed(os.fspath(path))
        return True
    except (CheckpointError, OSError):
        return False


def _read_committed(path: str) -> Metadata:
    if not is_remote(path):
        return load_metadata(local_path(path))
    from .storage.object_listing import read_committed

    st = storage_for(path)
    try:
        return read_committed(st, path)
    finally:
        st.close()


def _step_pattern(fmt: str) -> re.Pattern:
    """The regular expression of the directory names ``fmt.format(step=N)`` gives."""
    parts, fields = [], 0
    for literal, name, _spec, conv in string.Formatter().parse(fmt):
        parts.append(re.escape(literal))
        if name is None:
            continue
        if name != "step" or conv:
            raise ValueError(f"step_format {fmt!r}: the only field allowed is {{step}} (with an optional "
                             f"format spec such as {{step:08d}}), found {{{name}}}")
        fields += 1
        parts.append(r"(\d+)")
    if fields != 1:
        raise ValueError(f"step_format {fmt!r} must contain {{step}} exactly once, e.g. 'step-{{step}}'")
    if "/" in fmt or fmt.startswith("."):
        raise ValueError(f"step_format {fmt!r} must give a plain, non-hidden directory name (no '/', no leading '.')")
    return re.compile("".join(parts))


#: what a SIGTERM does once the manager has saved: exit the process, re-deliver the signal, or return
PREEMPTION_ACTIONS = ("exit", "signal", "continue")


class CheckpointManager:
    """Saves, restores and retires the checkpoints of one run under ``directory`` (a path or URL).

    Every rank constructs it with the same arguments and makes the same calls in the same order
    (``save``, ``restore``, ``steps``, ``close``...): decisions that touch storage (which steps exist,
    which to delete) are taken on rank 0 and broadcast, so ranks never disagree.

    Safety: a step is listed, returned by :meth:`latest_step` and restored only once committed;
    retention runs only after a newer checkpoint of this manager committed, never deletes the newest
    committed step nor one being restored, and deletes crash-safely (:meth:`Storage.delete`);
    temporaries of killed saves and deletions are swept (rank 0, at the first call and after each
    retention) unless a live save holds them. See docs/MANAGER.md.

    Args:
        directory: the root; each step is the directory ``step_format.format(step=N)`` under it.
        keep_last, keep_every_steps, keep_best, best_metric, best_mode, keep_unscored, keep_for: the keep
            rules of :class:`~hyperdcp.retention.Retention` (none given: every checkpoint is kept).
        save_interval_steps, save_at_steps: when :meth:`should_save` is true (every step by default).
        save_on_preemption: install a SIGTERM handler (main thread only) after which the next
            :meth:`save` saves whatever the interval, then does ``on_preemption`` (``"exit"``: close and
            exit with status 143; ``"signal"``: re-deliver SIGTERM to the previous handler; ``"continue"``:
            return, :attr:`preempted` is True). Costs one one-flag collective per ``save`` call.
        async_save: save in the background (:func:`hyperdcp.async_save`); at most one save in flight:
            a due save waits for the previous one, or is skipped when ``skip_if_busy``.
        process_group, timeout: as for :func:`hyperdcp.save`; save_options/load_options: passed through.
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = None,
                 keep_every_steps: int | None = None, keep_best: int | None = None, best_metric: str | None = None,
                 best_mode: str = "min", keep_unscored: bool = True, keep_for: float | None = None,
                 save_interval_steps: int | None = 1, save_at_steps: Iterable[int] = (),
                 save_on_preemption: bool = False, on_preemption: str = "exit",
                 step_format: str = "step-{step}", async_save: bool = False, skip_if_busy: bool = False,
                 process_group: Any = None, timeout: float | None = None,
                 save_options: SaveOptions | None = None, load_options: LoadOptions | None = None) -> None:
        self.directory = os.fspath(directory)
        self.retention = Retention(keep_last, keep_every_steps, keep_best, best_metric, best_mode, keep_unscored,
                                   None if keep_for is None else float(keep_for))
        self.schedule = SaveSchedule(save_interval_steps, frozenset(int(s) for s in save_at_steps))
        if on_preemption not in PREEMPTION_ACTIONS:
            raise ValueError(f"on_preemption must be one of {PREEMPTION_ACTIONS}, got {on_preemption!r}")
        self.step_format, self._pattern = step_format, _step_pattern(step_format)
        self.async_save, self.skip_if_busy, self.on_preemption = async_save, skip_if_busy, on_preemption
        self.process_group, self.timeout = process_group, timeout
        self.save_options, self.load_options = save_options or SaveOptions(), load_options
        self.save_on_preemption = save_on_preemption
        #: True once a SIGTERM arrived (``save_on_preemption``) on this rank
        self.preempted = False
        self._listing: list[StepInfo] | None = None  # rank 0's scan as broadcast to every rank
        self._cache: dict[str, StepInfo] = {}         # rank 0: name -> committed step, to read each record once
        self._pending: tuple[int, Any] | None = None  # (step, SaveFuture) of the async save in flight
        self._protected: set[int] = set()             # steps being restored in this process
        self._closed = False
        self._prev_handler: Any = None
        if save_on_preemption:
            self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- naming and listing ---------------------------------------------------------------------------
    def step_name(self, step: int) -> str:
        return self.step_format.format(step=step)

    def step_path(self, step: int) -> str:
        """Where step ``step`` is (or would be) saved."""
        name = self.step_name(step)
        return url_join(self.directory, name) if is_remote(self.directory) else os.path.join(self.directory, name)

    def _coord(self):
        return default_coordinator(self.process_group, self.timeout)

    def _scan(self) -> list[StepInfo]:
        """Rank 0: the committed steps under the root, oldest first (each commit record read once)."""
        root = storage_for(self.directory)
        try:
            if not is_remote(self.directory):
                recover_under(local_path(self.directory))  # overwrites killed between their two renames
            try:
                names = root.list()
            except CheckpointNotFoundError:
                names = []
            found = []
            for name in names:
                m = self._pattern.fullmatch(name)
                if m is None or self.step_name(int(m.group(1))) != name:
                    continue
                info = self._cache.get(name)
                if info is None:
                    try:
                        meta = _read_committed(self.step_path(int(m.group(1))))
                    except CheckpointError:
                        continue  # not committed (yet): never listed
                    mine = meta.user.get(USER_KEY) if isinstance(meta.user, dict) else None
                    metrics = mine.get("metrics", {}) if isinstance(mine, dict) else {}
                    info = self._cache[name] = StepInfo(int(m.group(1)), name, meta.created_unix, dict(metrics))
                found.append(info)
            present = set(names)
            for gone in [n for n in self._cache if n not in present]:
                del self._cache[gone]
            return sorted(found, key=lambda s: s.step)
        finally:
            root.close()

    def _collective(self, what: str, fn) -> list[StepInfo]:
        """Rank 0 runs ``fn()`` (returning the listing) and every rank receives that listing."""
        coord = self._coord()
        if coord.world_size == 1:
            self._listing = fn()
            return self._listing
        raw = broadcast_checked(coord, f"{what} under {self.directory!r}",
                                lambda: json.dumps([s.to_json() for s in fn()]).encode(), 0)
        self._listing = [StepInfo.from_json(x) for x in json.loads(raw)]
        return self._listing

    def _refresh(self) -> list[StepInfo]:
        def scan() -> list[StepInfo]:
            if self._listing is None and self._pending is None:  # first call: sweep leftovers of killed runs
                storage = storage_for(self.directory)
                try:
                    storage.sweep()
                finally:
                    storage.close()
            return self._scan()
        return self._collective("listing the checkpoints", scan)

    def steps(self) -> list[int]:
        """The committed steps, oldest first (collective: every rank calls it)."""
        self._check_open()
        self._settle(block=False)
        return [s.step for s in self._refresh()]

    def latest_step(self) -> int | None:
        """The newest committed step, or None (collective)."""
        steps = self.steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics saved with ``step`` (from its commit record; ``{}`` when none were given)."""
        self._check_open()
        for s in self._listing if self._listing is not None else self._refresh():
            if s.step == step:
                return dict(s.metrics)
        for s in self._refresh():
            if s.step == step:
                return dict(s.metrics)
        raise CheckpointNotFoundError(f"no committed checkpoint of step {step} under {self.directory!r}; committed "
                                      f"steps: {[s.step for s in self._listing or []]}")

    # -- saving ----------------------------------------------------------------------------------------
    def _newest_known(self) -> int | None:
        listing = self._listing if self._listing is not None else self._refresh()
        newest = listing[-1].step if listing else None
        if self._pending is not None and (newest is None or self._pending[0] > newest):
            newest = self._pending[0]
        return newest

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` at ``step`` saves: due by the schedule (or preempted), newer than every step
        saved or in flight. Deterministic on every rank (preemption is agreed on inside :meth:`save`)."""
        newest = self._newest_known()
        return (self.preempted or self.schedule.due(step)) and (newest is None or step > newest)

    def save(self, step: int, state: Any, *, metrics: dict[str, Any] | None = None, force: bool = False) -> bool:
        """Save ``state`` as step ``step`` if :meth:`should_save` (or ``force``); returns whether it saved
        (started, when async). Every rank calls it at every step it might save at."""
        self._check_open()
        if self.save_on_preemption:
            self.preempted = self._coord().any_true(self.preempted)
        self._settle(block=False)
        if not (force or self.should_save(step)):
            return False
        newest = self._newest_known()
        if newest is not None and step <= newest:
            raise CheckpointError(f"cannot save step {step} under {self.directory!r}: step {newest} is already "
                                  "saved or in flight; steps must increase")
        if self._pending is not None:
            if self.skip_if_busy and not self.preempted and self._coord().any_true(not self._pending[1].done()):
                log.info("hyperdcp manager: skipping step %d, the save of step %d is still in flight",
                         step, self._pending[0])
                return False
            self._settle(block=True)
        if metrics is not None:
            json.dumps(metrics, allow_nan=False)  # only plain JSON numbers/strings: fail here, not in the record
        user = dict(self.save_options.user_metadata)
        user[USER_KEY] = {"step": int(step), "metrics": dict(metrics or {})}
        opts = dataclasses.replace(self.save_options, user_metadata=user, process_group=self.process_group,
                                   timeout=self.timeout if self.timeout is not None else self.save_options.timeout)
        path = self.step_path(step)
        if self.async_save and not self.preempted:
            self._pending = (step, async_save(state, path, options=opts))
        else:
            save(state, path, options=opts)
            self._retain()
        if self.preempted:
            self._act_on_preemption()
        return True

    def _settle(self, block: bool) -> None:
        """Finish the async save in flight if it is done on every rank (or wait for it: ``block``): surface its
        error on every rank, then apply retention."""
        if self._pending is None:
            return
        step, fut = self._pending
        coord = self._coord()
        if not block and coord.any_true(not fut.done()):
            return
        exc = fut.exception()
        self._pending = None
        check_all(coord, f"the async save of step {step} to {self.step_path(step)!r}", exc)
        self._retain()

    def _retain(self) -> None:
        """After a commit: rank 0 deletes what the rules let go, sweeps leftovers, and broadcasts the listing."""
        def apply() -> list[StepInfo]:
            listing = self._scan()
            doomed = self.retention.to_delete(listing, time.time(), self._protected)
            if doomed:
                storage = storage_for(self.directory)
                try:
                    for s in doomed:
                        storage.delete(s.name)
                        self._cache.pop(s.name, None)
                        log.info("hyperdcp manager: deleted step %d (%s) under %s", s.step, s.name, self.directory)
                    storage.sweep()
                finally:
                    storage.close()
                listing = [s for s in listing if s not in doomed]
            return listing
        self._collective("applying retention", apply)

    # -- restoring -------------------------------------------------------------------------------------
    def restore(self, state: Any, step: int | None = None, **load_overrides: Any) -> int | None:
        """Load the newest committed step (or ``step``) into ``state`` in place; its step, or None when there
        is none (a fresh start). Collective. ``load_overrides``: :class:`~hyperdcp.LoadOptions` fields."""
        self._check_open()
        self._settle(block=True)
        listing = self._refresh()
        if step is None:
            if not listing:
                return None
            step = listing[-1].step
        elif step not in {s.step for s in listing}:
            raise CheckpointNotFoundError(f"cannot restore step {step} from {self.directory!r}: it is not a committed "
                                          f"checkpoint; committed steps: {[s.step for s in listing]}")
        self._protected.add(step)
        try:
            opts = {"process_group": self.process_group, "timeout": self.timeout, **load_overrides}
            load(state, self.step_path(step), options=self.load_options, **opts)
        finally:
            self._protected.discard(step)
        return step

    # -- lifetime --------------------------------------------------------------------------------------
    def wait_until_finished(self) -> None:
        """Wait for the async save in flight; its error raises on every rank."""
        self._settle(block=True)

    def close(self) -> None:
        """Wait for the save in flight (its error raises), remove the SIGTERM handler. Idempotent."""
        if self._closed:
            return
        try:
            self._settle(block=True)
        finally:
            self._closed = True
            if self.save_on_preemption and self._prev_handler is not None:
                try:
                    signal.signal(signal.SIGTERM, self._prev_handler)
                except ValueError:
                    pass  # not the main thread

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.directory!r} is closed; create a new one")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.preempted = True

    def _act_on_preemption(self) -> None:
        log.warning("hyperdcp manager: preempted (SIGTERM); saved, now %s", self.on_preemption)
        if self.on_preemption == "continue":
            return
        prev = self._prev_handler
        self.close()
        if self.on_preemption == "signal" and prev not in (None, signal.SIG_IGN):
            os.kill(os.getpid(), signal.SIGTERM)  # now handled by the previous handler (SIG_DFL: terminate)
            return
        sys.exit(128 + signal.SIGTERM)

__all__ = ["CheckpointManager", "is_checkpoint", "latest_checkpoint", "list_checkpoints"]
