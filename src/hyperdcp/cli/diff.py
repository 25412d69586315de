"""``hyperdcp diff A B``: compare two checkpoints (hyperdcp or HuggingFace safetensors), streaming.

Exit status: 0 when equal (within ``--atol``/``--rtol``), 1 when they differ, 2 on an error.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "diff", help="compare two checkpoints: keys, shapes, dtypes and values (exit 0 equal, 1 differ)",
        description="Compare checkpoints A and B (hyperdcp or HF safetensors): keys only in one, shape and dtype "
        "differences, and value differences (max abs and relative error) read slab by slab with bounded memory. "
        "Elements are equal when |a - b| <= atol + rtol * |b| (NaN equals NaN). Exit 0 equal, 1 differ, 2 error.",
    )
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exact)")
    p.add_argument("--slab-bytes", type=int, default=32 << 20, help="bytes per tensor slab read at a time")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


@dataclass
class TensorDiff:
    name: str
    max_abs: float
    max_rel: float
    beyond: int  # elements outside the tolerance
    numel: int


@dataclass
class DiffReport:
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
    """Compare two sources; tensors are read in slabs of whole rows along dim 0 (bounded memory)."""
    from ..core import dtypes
    from ..core.boxes import Box
    from ..hf import data_root, open_metadata, read_box
    from ..planning.load_plan import TensorIndex
    from ..storage.reader import DataFiles

    ma, mb = open_metadata(a), open_metadata(b)
    rep = DiffReport(a, b)
    ka, kb = set(ma.keys()), set(mb.keys())
    rep.only_a, rep.only_b = sorted(ka - kb), sorted(kb - ka)
    for k in sorted(ka & kb):
        if (k in ma.tensors) != (k in mb.tensors):
            rep.kind.append(k)
        elif k in ma.values and not _same_value(ma.values[k], mb.values[k]):
            rep.plain.append(k)
    fa, fb = DataFiles(data_root(ma, a), ma), DataFiles(data_root(mb, b), mb)
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
                xa = read_box(fa, ma, k, box, index=ia)
                xb = read_box(fb, mb, k, box, index=ib)
                rep.bytes_compared += xa.size + xb.size
                if ta.dtype == tb.dtype and np.array_equal(xa, xb):
                    continue
                identical = False
                mx, rl, beyond = _stats(xa.view(dtypes.to_numpy(ta.dtype)), xb.view(dtypes.to_numpy(tb.dtype)), atol, rtol)
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


def run(args) -> int:
    from ..errors import CheckpointError
    from ._text import safe, safe_lines

    try:
        rep = diff_sources(args.a, args.b, args.atol, args.rtol, max(1, args.slab_bytes))
    except CheckpointError as e:
        print(f"hyperdcp diff: error: {safe_lines(e)}", file=sys.stderr)
        return 2
    if args.json:
        doc = asdict(rep)
        doc["equal"] = rep.equal
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0 if rep.equal else 1
    out = []
    for k in rep.only_a:
        out.append(f"only in A: {safe(k)}")
    for k in rep.only_b:
        out.append(f"only in B: {safe(k)}")
    for k in rep.kind:
        out.append(f"kind differs: {safe(k)} (a tensor in one, a plain value in the other)")
    for k, sa, sb in rep.shape:
        out.append(f"shape differs: {safe(k)}: {sa} vs {sb}")
    for k, da, db in rep.dtype:
        out.append(f"dtype differs: {safe(k)}: {da} vs {db}")
    for v in rep.values:
        verdict = "values differ" if v.beyond else "within tolerance"
        out.append(f"{verdict}: {safe(v.name)}: max abs err {v.max_abs:.6g}, max rel err {v.max_rel:.6g}, "
                   f"{v.beyond} of {v.numel} elements beyond tolerance")
    for k in rep.plain:
        out.append(f"value differs: {safe(k)}")
    summary = (f"{rep.tensors_compared} tensors compared ({rep.bytes_compared / 1e9:.3f} GB read), "
               f"atol={args.atol:g} rtol={args.rtol:g}")
    out.append(("EQUAL: " if rep.equal else "DIFFERENT: ") + summary)
    print("\n".join(out))
    return 0 if rep.equal else 1
