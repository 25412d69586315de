"""Which checkpoints a :class:`~hyperdcp.CheckpointManager` keeps and when it saves: pure policy.

:class:`Retention` decides, from the committed steps alone (step, commit time, metrics), which ones
may be deleted; :class:`SaveSchedule` decides whether a step is saved. Neither does any I/O, so the
rules read (and are tested) as specifications; the manager applies them on rank 0 only.

A checkpoint is kept when any configured rule keeps it (no rule configured: all are kept):

* ``keep_last=N``: the N newest steps;
* ``keep_every_steps=K``: steps divisible by K (kept forever);
* ``keep_best=N`` with ``best_metric`` and ``best_mode`` (``"min"``/``"max"``): the N best scored steps;
  steps without that metric are kept when ``keep_unscored`` (the default), deletable otherwise;
* ``keep_for=seconds``: steps committed less than that long ago.

The newest committed step and the ``protected`` ones (being restored) are never deleted, whatever
the rules say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence


@dataclass(frozen=True)
class StepInfo:
    """One committed checkpoint: its step, directory name, commit time (unix seconds) and metrics."""

    step: int
    name: str
    created_unix: float
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> list:
        return [self.step, self.name, self.created_unix, self.metrics]

    @staticmethod
    def from_json(x: Sequence) -> "StepInfo":
        return StepInfo(int(x[0]), str(x[1]), float(x[2]), dict(x[3]))


@dataclass(frozen=True)
class Retention:
    """The keep rules (see the module docstring)."""

    keep_last: int | None = None
    keep_every_steps: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    keep_unscored: bool = True
    keep_for: float | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every_steps", "keep_best"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if self.keep_for is not None and not self.keep_for > 0:
            raise ValueError(f"keep_for must be a positive number of seconds or None, got {self.keep_for!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if (self.keep_best is None) != (self.best_metric is None):
            raise ValueError("keep_best=N and best_metric='name' go together: pass both (e.g. keep_best=3, "
                             "best_metric='loss', best_mode='min') or neither")

    @property
    def keeps_all(self) -> bool:
        return all(v is None for v in (self.keep_last, self.keep_every_steps, self.keep_best, self.keep_for))

    def _score(self, info: StepInfo) -> float | None:
        v = info.metrics.get(self.best_metric) if self.best_metric else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            return None
        return float(v)

    def kept(self, steps: Sequence[StepInfo], now: float, protected: Iterable[int] = ()) -> set[int]:
        """The steps to keep among ``steps`` (committed ones, any order) at time ``now``."""
        if not steps:
            return set()
        if self.keeps_all:
            return {s.step for s in steps}
        by_step = sorted(steps, key=lambda s: s.step)
        keep = {by_step[-1].step} | (set(protected) & {s.step for s in steps})
        if self.keep_last is not None:
            keep.update(s.step for s in by_step[-self.keep_last:])
        if self.keep_every_steps is not None:
            keep.update(s.step for s in by_step if s.step % self.keep_every_steps == 0)
        if self.keep_for is not None:
            keep.update(s.step for s in by_step if now - s.created_unix < self.keep_for)
        if self.keep_best is not None:
            scored = [(self._score(s), s.step) for s in by_step]
            ranked = sorted(((v, st) for v, st in scored if v is not None),
                            key=lambda t: (t[0] if self.best_mode == "min" else -t[0], -t[1]))
            keep.update(st for _, st in ranked[:self.keep_best])
            if self.keep_unscored:
                keep.update(st for v, st in scored if v is None)
        return keep

    def to_delete(self, steps: Sequence[StepInfo], now: float, protected: Iterable[int] = ()) -> list[StepInfo]:
        """The committed steps the rules let go, oldest first."""
        keep = self.kept(steps, now, protected)
        return sorted((s for s in steps if s.step not in keep), key=lambda s: s.step)


@dataclass(frozen=True)
class SaveSchedule:
    """When to save: every ``save_interval_steps`` steps and at ``save_at_steps`` (both may be given)."""

    save_interval_steps: int | None = 1
    save_at_steps: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        v = self.save_interval_steps
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"save_interval_steps must be a positive integer or None, got {v!r}")

    def due(self, step: int) -> bool:
        """Whether ``step`` is a step to save at (regardless of what is already saved)."""
        if step in self.save_at_steps:
            return True
        return self.save_interval_steps is not None and step % self.save_interval_steps == 0


__all__ = ["Retention", "SaveSchedule", "StepInfo"]
