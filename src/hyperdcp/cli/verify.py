"""``hyperdcp verify PATH``: check every checksum of a checkpoint; exit 1 on any problem."""

from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify", help="check every checksum of a checkpoint (parallel); exit non-zero on any problem",
        description="Read every stored byte of the checkpoint at PATH and check it against its checksums. "
        "Lists damaged files and chunks, prints the throughput, exits 1 on any problem.",
    )
    p.add_argument("path", metavar="PATH", help="checkpoint directory or URL, HF model directory, hub snapshot or "
                   ".safetensors file")
    p.add_argument("--threads", type=int, default=min(16, (os.cpu_count() or 2) * 2), help="reader threads")
    p.add_argument("--max-report", type=int, default=50, help="list at most this many bad chunks")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..tools.verify import verify_checkpoint
    from ._text import safe

    rep = verify_checkpoint(args.path, threads=max(1, args.threads))
    for msg in rep.file_errors:
        print(f"BAD FILE  {safe(msg)}")
    for b in rep.bad_chunks[: args.max_report]:
        print(f"BAD CHUNK {safe(b)}")
    if len(rep.bad_chunks) > args.max_report:
        print(f"... and {len(rep.bad_chunks) - args.max_report} more bad chunks")
    if not rep.checksums:
        print(f"NO CHECKSUMS: {safe(rep.path)} is a {rep.kind} source, which carries no block checksums: its files' "
              "presence, sizes and headers were checked, not their bytes")
    print(
        f"{'OK' if rep.ok else 'FAILED'}: {safe(rep.path)}: {rep.files} files, {rep.chunks} chunks, "
        f"{rep.bytes_checked / 1e9:.3f} GB checked in {rep.seconds:.3f} s ({rep.gb_per_s:.2f} GB/s, "
        f"{args.threads} threads); {len(rep.file_errors)} bad files, {len(rep.bad_chunks)} bad chunks",
        file=sys.stdout,
    )
    return 0 if rep.ok else 1
