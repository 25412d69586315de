"""``hyperdcp convert hf-to-hyperdcp SRC DST`` and ``hyperdcp convert hyperdcp-to-hf SRC DST``: streaming
conversions between HuggingFace safetensors and hyperdcp's own checkpoint format; ``torch-dcp-to-hyperdcp``
and ``hyperdcp-to-torch-dcp``: the same with torch.distributed.checkpoint directories.

``hf-to-dcp`` and ``dcp-to-hf`` are kept as aliases of the two directions.
"""

from __future__ import annotations

import sys

#: direction -> its old spelling, kept as an alias
DIRECTIONS = {"hf-to-hyperdcp": "hf-to-dcp", "hyperdcp-to-hf": "dcp-to-hf"}
#: the torch.distributed.checkpoint directions (no aliases: "dcp" above is hyperdcp's old name)
TORCH_DIRECTIONS = ("torch-dcp-to-hyperdcp", "hyperdcp-to-torch-dcp")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert between HuggingFace safetensors or torch DCP and hyperdcp checkpoints (streaming)",
        description="Convert checkpoints tensor by tensor with bounded memory and parallel I/O. Tensor bytes "
        "are copied bit for bit (unless --dtype casts them). 'hyperdcp' is this library's checkpoint format "
        "(a directory with hyperdcp.json), not torch.distributed.checkpoint.",
    )
    sub = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    a = sub.add_parser("hf-to-hyperdcp", aliases=["hf-to-dcp"],
                       help="HF model directory or .safetensors file -> hyperdcp checkpoint")
    a.add_argument("src", metavar="SRC",
                   help="HF model directory (model.safetensors or sharded with an index) or a .safetensors file")
    a.add_argument("dst", metavar="DST", help="hyperdcp checkpoint to create: a directory or an s3:// URL")
    b = sub.add_parser("hyperdcp-to-hf", aliases=["dcp-to-hf"],
                       help="hyperdcp checkpoint -> HF safetensors shards + model.safetensors.index.json",
                       description="Export a hyperdcp checkpoint as HF safetensors. A checkpoint of "
                       "get_state_dict(model, optimizer) holds the optimizer state too and prefixes the weights "
                       "with 'model.': pass --include model. --strip-prefix model. to export exactly the model's "
                       "weights.")
    b.add_argument("src", metavar="SRC", help="hyperdcp checkpoint directory")
    b.add_argument("dst", metavar="DST", help="output directory")
    b.add_argument("--max-shard-size", default="5GB", help="largest shard (default 5GB; e.g. 500MB, 2GiB)")
    b.add_argument("--dtype", default=None, help="cast floating tensors to bf16, f16, f32 or f64")
    b.add_argument("--values-file", default=None, metavar="PATH",
                   help="write the checkpoint's non-tensor values to this JSON file "
                        "(otherwise they are listed and skipped)")
    b.add_argument("--include", action="append", default=[], metavar="PREFIX",
                   help="export only keys starting with PREFIX (repeatable; plain string prefix, e.g. 'model.')")
    b.add_argument("--exclude", action="append", default=[], metavar="PREFIX",
                   help="leave out keys starting with PREFIX (repeatable; applied after --include)")
    b.add_argument("--strip-prefix", default=None, metavar="PREFIX",
                   help="remove PREFIX from the start of the exported names (e.g. 'model.')")
    c = sub.add_parser("torch-dcp-to-hyperdcp", help="torch.distributed.checkpoint directory -> hyperdcp checkpoint",
                       description="Convert a torch DCP checkpoint (dcp.save / dcp.async_save) into a hyperdcp "
                       "checkpoint, streaming with bounded memory. Its .metadata is read with a restricted unpickler "
                       "(torch's metadata records only; anything else is refused by name and never executed).")
    c.add_argument("src", metavar="SRC", help="torch DCP checkpoint directory (with .metadata)")
    c.add_argument("dst", metavar="DST", help="hyperdcp checkpoint to create: a directory or an s3:// URL")
    d = sub.add_parser("hyperdcp-to-torch-dcp", help="hyperdcp checkpoint -> torch.distributed.checkpoint directory",
                       description="Write a checkpoint that torch.distributed.checkpoint.load reads (needs torch).")
    d.add_argument("src", metavar="SRC", help="hyperdcp checkpoint directory (or HF safetensors)")
    d.add_argument("dst", metavar="DST", help="torch DCP directory to create")
    for x in (c, d):
        x.add_argument("--overwrite", action="store_true", help="replace an existing destination")
        x.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
        x.set_defaults(func=run)
    c.add_argument("--threads", type=int, default=4, help="parallel I/O threads (default 4)")
    c.add_argument("--no-crc", action="store_true",
                   help="skip checking each storage against the CRC-32 torch recorded (faster, unchecked)")
    for x in (a, b):
        x.add_argument("--overwrite", action="store_true", help="replace an existing destination")
        x.add_argument("--threads", type=int, default=4, help="parallel I/O threads (default 4)")
        x.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
        x.set_defaults(func=run)


def _top_prefixes(names) -> list[str]:
    return sorted({n.split(".", 1)[0] + "." for n in names if "." in n})


def run(args) -> int:
    from ..tools.convert import dcp_to_hf, hf_to_dcp
    from ._text import parse_dtype, parse_size, safe

    direction = {old: new for new, old in DIRECTIONS.items()}.get(args.direction, args.direction)
    threads = max(1, getattr(args, "threads", 1))
    hint = ""
    if direction in TORCH_DIRECTIONS:
        from ..tools.convert_torch_dcp import hyperdcp_to_torch_dcp, torch_dcp_to_hyperdcp

        if direction == "torch-dcp-to-hyperdcp":
            r = torch_dcp_to_hyperdcp(args.src, args.dst, overwrite=args.overwrite, threads=threads, quiet=args.quiet,
                                      check_crc=not args.no_crc)
        else:
            r = hyperdcp_to_torch_dcp(args.src, args.dst, overwrite=args.overwrite, quiet=args.quiet)
        if r.skipped_values:
            shown = ", ".join(safe(v) for v in r.skipped_values[:10]) + (" ..." if len(r.skipped_values) > 10 else "")
            print(f"left out {len(r.skipped_values)} entr{'y' if len(r.skipped_values) == 1 else 'ies'} the other "
                  f"format cannot hold or hyperdcp does not read (see hyperdcp inspect --source torch-dcp): {shown}",
                  file=sys.stderr)
    elif direction == "hf-to-hyperdcp":
        r = hf_to_dcp(args.src, args.dst, overwrite=args.overwrite, threads=threads, quiet=args.quiet)
    else:
        try:
            size = parse_size(args.max_shard_size)
            if args.dtype:
                parse_dtype(args.dtype)
        except ValueError as e:
            print(f"hyperdcp convert: error: {e}", file=sys.stderr)
            return 2
        r = dcp_to_hf(args.src, args.dst, max_shard_size=size, dtype=args.dtype, values_file=args.values_file,
                      overwrite=args.overwrite, threads=threads, quiet=args.quiet, include=args.include,
                      exclude=args.exclude, strip_prefix=args.strip_prefix)
        if r.skipped_values:
            shown = ", ".join(safe(v) for v in r.skipped_values[:10]) + (" ..." if len(r.skipped_values) > 10 else "")
            print(f"skipped {len(r.skipped_values)} non-tensor value(s) (pass --values-file to keep them): {shown}",
                  file=sys.stderr)
        elif args.values_file:
            print(f"non-tensor values written to {safe(args.values_file)}", file=sys.stderr)
        tops = _top_prefixes(r.tensor_names) if not (args.include or args.exclude or args.strip_prefix) else []
        if len(tops) > 1:
            hint = (f"; the names start with {', '.join(safe(t) for t in tops[:5])}: "
                    "to export only the model's weights "
                    f"pass e.g. --include {safe(tops[0])} --strip-prefix {safe(tops[0])}")
    if not args.quiet:
        print(f"{direction}: {r.tensors} tensors, {r.tensor_bytes / 1e9:.3f} GB in {r.seconds:.2f} s "
              f"({r.gb_per_s:.2f} GB/s) -> {safe(r.dst)} ({len(r.files)} file{'s' if len(r.files) != 1 else ''}){hint}")
    return 0
