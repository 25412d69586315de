"""The ``hyperdcp`` command line. Each subcommand lives in its own module of this package.

A subcommand module defines ``register(subparsers)`` that adds its parser and sets ``func`` to a
function taking the parsed args and returning the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand modules, in the order ``--help`` lists them
SUBCOMMANDS: list[str] = ["demo", "verify", "convert", "inspect", "diff"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperdcp", description="Distributed checkpoints of sharded training state.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from ..errors import CheckpointError

    try:
        return int(args.func(args) or 0)
    except CheckpointError as e:
        print(f"hyperdcp {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
