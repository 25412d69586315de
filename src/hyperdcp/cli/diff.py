"""``hyperdcp diff A B``: compare two checkpoints (hyperdcp, HuggingFace safetensors, URLs), streaming.

Exit status: 0 when equal (within ``--atol``/``--rtol``), 1 when they differ, 2 on an error.
The comparison itself is :func:`hyperdcp.tools.diff.diff_sources`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from ..tools.diff import DiffReport, TensorDiff, diff_sources  # noqa: F401 - their old import path


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
