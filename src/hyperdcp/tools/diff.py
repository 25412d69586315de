"""Comparing two sources (any kinds: hyperdcp, HuggingFace, URLs), streaming with bounded memory.

    rep = diff_sources("ckpt/step-100", "hf-export/")   # open_source both, then slab by slab
    rep.equal, rep.only_a, rep.values

Elements are equal when ``|a - b| <= atol + rtol * |b|`` (NaN equals NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core import dtypes
from ..core.boxes import Box
from ..loading.reads import read_box
from ..planning.load_plan import TensorIndex
from ..sources.base import open_source


@dataclass
class TensorDiff:
    """How one tensor's values differ (worst element over all slabs)."""

    name: str
    max_abs: float
    max_rel: float
    beyond: int  # elements outside the tolerance
    numel: int


@dataclass
class DiffReport:
    """What :func:`diff_sources` found; ``equal`` when nothing differs beyond the tolerances."""

    a: str
    b: str
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)  # tensor in one, plain value in the other
    shape: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    dtype: list[tuple[str, str, str]] = field(default_factory=list)
    values: list[TensorDiff] = field(default_factory=list)  # tensors compared elementwise and not bit-identical
    plain: list[str] = field(default_factory=list)  # non-tensor values that differ
    tensors_compared: int = 0
    bytes_compared: int = 0

    @property
    def equal(self) -> bool:
        return not (self.only_a or self.only_b or self.kind or self.shape or self.dtype or self.plain
                    or any(v.beyond for v in self.values))


def _stats(x: np.ndarray, y: np.ndarray, atol: float, rtol: float) -> tuple[float, float, int]:
    """(max abs error, max relative error, elements beyond tolerance) of two same-shaped arrays."""
    if x.dtype.kind == "b":
        x = x.astype(np.int8)
    if y.dtype.kind == "b":
        y = y.astype(np.int8)
    if x.dtype.kind in "iu" and y.dtype.kind in "iu" and x.dtype == y.dtype:
        diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
        diff[x == y] = 0.0  # exact where the integers are equal (no float64 rounding)
        ref = np.abs(y.astype(np.float64))
    else:
        wide = np.complex128 if "c" in (x.dtype.kind, y.dtype.kind) else np.float64
        xf, yf = x.astype(wide), y.astype(wide)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(xf - yf)
            both_nan = np.isnan(xf) & np.isnan(yf)
            same = (xf == yf) | both_nan  # equal infinities and NaN pairs are equal
            diff = np.where(same, 0.0, np.where(np.isnan(diff), np.inf, diff))
        ref = np.abs(yf)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / ref)
    with np.errstate(invalid="ignore"):
        tol = atol + (rtol * ref if rtol else 0.0)
    beyond = int(np.count_nonzero(diff > tol))
    return (float(diff.max()) if diff.size else 0.0, float(rel.max()) if rel.size else 0.0, beyond)


def diff_sources(a: str, b: str, atol: float = 0.0, rtol: float = 0.0, slab_bytes: int = 32 << 20) -> DiffReport:
    """Compare two sources; tensors are read in slabs of whole rows along dim 0 (bounded memory).

    Args:
        a, b: anything :func:`~hyperdcp.open_source` opens (either may be a HuggingFace directory).
        atol, rtol: tolerances for floating tensors (0: bit-identical).
        slab_bytes: memory per slab read from each side.

    Returns:
        a :class:`DiffReport`: keys only in one side, kind/shape/dtype differences, tensors whose values
        differ (with their largest difference) and differing plain values; ``equal`` when none.

    Raises:
        CheckpointError: when either path holds no checkpoint, or a chunk fails its checksum.

    Example::

        assert diff_sources("ckpt/step-100", "export/").equal
    """
    sa, sb = open_source(a), open_source(b)
    ma, mb = sa.metadata, sb.metadata
    rep = DiffReport(a, b)
    ka, kb = set(ma.keys()), set(mb.keys())
    rep.only_a, rep.only_b = sorted(ka - kb), sorted(kb - ka)
    for k in sorted(ka & kb):
        if (k in ma.tensors) != (k in mb.tensors):
            rep.kind.append(k)
        elif k in ma.values and not _same_value(ma.values[k], mb.values[k]):
            rep.plain.append(k)
    fa, fb = sa.reader(), sb.reader()
    ia, ib = TensorIndex(ma), TensorIndex(mb)
    try:
        for k in sorted(set(ma.tensors) & set(mb.tensors)):
            ta, tb = ma.tensors[k], mb.tensors[k]
            if tuple(ta.shape) != tuple(tb.shape):
                rep.shape.append((k, list(ta.shape), list(tb.shape)))
                continue
            if ta.dtype != tb.dtype:
                rep.dtype.append((k, ta.dtype, tb.dtype))
            rep.tensors_compared += 1
            shape = tuple(ta.shape)
            numel = ta.nbytes // dtypes.itemsize(ta.dtype)
            if numel == 0:
                continue
            row = max(dtypes.itemsize(ta.dtype), dtypes.itemsize(tb.dtype)) * (numel // shape[0] if shape else 1)
            step = max(1, slab_bytes // max(1, row)) if shape else 1
            worst = TensorDiff(k, 0.0, 0.0, 0, numel)
            identical = ta.dtype == tb.dtype
            for start in range(0, shape[0] if shape else 1, step):
                if shape:
                    n = min(step, shape[0] - start)
                    box = Box((start,) + (0,) * (len(shape) - 1), (n,) + shape[1:])
                else:
                    box = Box((), ())
                xa = read_box(fa, ma, k, box, verify=sa.verifiable, index=ia)
                xb = read_box(fb, mb, k, box, verify=sb.verifiable, index=ib)
                rep.bytes_compared += xa.size + xb.size
                if ta.dtype == tb.dtype and np.array_equal(xa, xb):
                    continue
                identical = False
                mx, rl, beyond = _stats(xa.view(dtypes.to_numpy(ta.dtype)), xb.view(dtypes.to_numpy(tb.dtype)),
                                        atol, rtol)
                worst.max_abs, worst.max_rel = max(worst.max_abs, mx), max(worst.max_rel, rl)
                worst.beyond += beyond
            if not identical:
                rep.values.append(worst)
    finally:
        fa.close()
        fb.close()
    return rep


def _same_value(x: Any, y: Any) -> bool:
    from ..format import values as values_codec

    try:
        return values_codec.encode(x, "a") == values_codec.encode(y, "b")
    except Exception:  # noqa: BLE001
        return x == y
