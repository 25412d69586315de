"""``hyperdcp inspect PATH``: what a checkpoint (hyperdcp, HuggingFace safetensors, a URL) holds.

The report itself is :func:`hyperdcp.tools.inspect.describe`; this module parses and prints.
"""

from __future__ import annotations

import json
import sys

from ..tools.inspect import describe  # noqa: F401 - the old import path of describe


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect", help="list the tensors of a checkpoint (hyperdcp or HuggingFace safetensors)",
        description="Print one row per tensor (dtype, global shape, chunks, bytes, files), totals, the saving "
        "world size and the format version. Reads only metadata and headers.",
    )
    p.add_argument("path", metavar="PATH",
                   help="hyperdcp checkpoint (path or URL), HF model directory, hub snapshot or .safetensors file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--source", default="auto", choices=["auto", "hyperdcp", "huggingface", "torch-dcp"],
                   help="the checkpoint's kind (default: detected; torch-dcp is never detected, as reading it "
                   "unpickles .metadata with a restricted unpickler: pass --source torch-dcp for it)")
    p.set_defaults(func=run)


def _files_cell(files: list[str]) -> str:
    return ",".join(files) if len(files) <= 2 else f"{len(files)} files"


def run(args) -> int:
    from ._text import human_size as _human
    from ._text import safe

    rep = describe(args.path, args.source)
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    head = ("tensor", "dtype", "shape", "chunks", "bytes", "files")
    rows = [(safe(t["name"]), t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]", str(t["chunks"]),
             str(t["bytes"]),
             safe(_files_cell(t["files"]))) for t in rep["tensors"]]
    w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]
    right = {3, 4}
    fmt = lambda r: "  ".join(c.rjust(w[i]) if i in right else c.ljust(w[i]) for i, c in enumerate(r)).rstrip()  # noqa: E731
    out = [fmt(head), fmt(tuple("-" * x for x in w))] + [fmt(r) for r in rows]
    tot = rep["totals"]
    out.append("")
    if rep["kind"] == "hyperdcp":
        out.append(f"format: hyperdcp v{rep['format_version']} (written by hyperdcp {rep['library_version']}), "
                   f"saved by {rep['world_size']} rank(s)")
    elif rep["kind"] == "torch-dcp":
        out.append("format: torch.distributed.checkpoint (torch DCP), read with a restricted unpickler (no saving "
                   "world size recorded)")
    else:
        out.append("format: HuggingFace safetensors (no saving world size recorded)")
    out.append(f"total: {tot['tensors']} tensors, {tot['tensor_bytes']} bytes ({_human(tot['tensor_bytes'])}), "
               f"{tot['chunks']} chunks in {tot['files']} file(s) of {_human(tot['file_bytes'])}; "
               f"{tot['values']} non-tensor value(s)")
    if rep["values"]:
        shown = ", ".join(safe(v) for v in rep["values"][:20]) + (" ..." if len(rep["values"]) > 20 else "")
        out.append(f"values: {shown}")
    for key, why in list(rep.get("unreadable", {}).items())[:20]:
        out.append(f"not readable by hyperdcp: {safe(key)}: {safe(why)}")
    print("\n".join(out))
    return 0
