"""``hyperdcp convert hf-to-dcp SRC DST`` and ``hyperdcp convert dcp-to-hf SRC DST``: streaming conversions."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert between HuggingFace safetensors and hyperdcp checkpoints (streaming)",
        description="Convert checkpoints tensor by tensor with bounded memory and parallel I/O. Tensor bytes "
        "are copied bit for bit (unless --dtype casts them).",
    )
    sub = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    a = sub.add_parser("hf-to-dcp", help="HF model directory or .safetensors file -> hyperdcp checkpoint")
    a.add_argument("src", metavar="SRC", help="HF model directory (model.safetensors or sharded with an index) or a .safetensors file")
    a.add_argument("dst", metavar="DST", help="hyperdcp checkpoint directory to create")
    b = sub.add_parser("dcp-to-hf", help="hyperdcp checkpoint -> HF safetensors shards + model.safetensors.index.json")
    b.add_argument("src", metavar="SRC", help="hyperdcp checkpoint directory")
    b.add_argument("dst", metavar="DST", help="output directory")
    b.add_argument("--max-shard-size", default="5GB", help="largest shard (default 5GB; e.g. 500MB, 2GiB)")
    b.add_argument("--dtype", default=None, help="cast floating tensors to bf16, f16, f32 or f64")
    b.add_argument("--values-file", default=None, metavar="PATH",
                   help="write the checkpoint's non-tensor values to this JSON file (otherwise they are listed and skipped)")
    for x in (a, b):
        x.add_argument("--overwrite", action="store_true", help="replace an existing destination")
        x.add_argument("--threads", type=int, default=4, help="parallel I/O threads (default 4)")
        x.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
        x.set_defaults(func=run)


def run(args) -> int:
    from .. import hf

    threads = max(1, args.threads)
    if args.direction == "hf-to-dcp":
        r = hf.hf_to_dcp(args.src, args.dst, overwrite=args.overwrite, threads=threads, quiet=args.quiet)
    else:
        try:
            size = hf.parse_size(args.max_shard_size)
            if args.dtype:
                hf.parse_dtype(args.dtype)
        except ValueError as e:
            print(f"hyperdcp convert: error: {e}", file=sys.stderr)
            return 2
        r = hf.dcp_to_hf(args.src, args.dst, max_shard_size=size, dtype=args.dtype, values_file=args.values_file,
                         overwrite=args.overwrite, threads=threads, quiet=args.quiet)
        if r.skipped_values:
            shown = ", ".join(r.skipped_values[:10]) + (" ..." if len(r.skipped_values) > 10 else "")
            print(f"skipped {len(r.skipped_values)} non-tensor value(s) (pass --values-file to keep them): {shown}",
                  file=sys.stderr)
        elif args.values_file:
            print(f"non-tensor values written to {args.values_file}", file=sys.stderr)
    if not args.quiet:
        print(f"{args.direction}: {r.tensors} tensors, {r.tensor_bytes / 1e9:.3f} GB in {r.seconds:.2f} s "
              f"({r.gb_per_s:.2f} GB/s) -> {r.dst} ({len(r.files)} file{'s' if len(r.files) != 1 else ''})")
    return 0
