"""The ``hyperdcp`` command line. Each subcommand lives in its own module of this package.

A subcommand module defines ``register(subparsers)`` that adds its parser and sets ``func`` to a
function taking the parsed args and returning the exit status.

Every command exits quietly (status 141, like a process ended by SIGPIPE) when its output pipe closes
(``hyperdcp inspect ... | head``), and escapes control characters in what it prints.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

#: subcommand modules, in the order ``--help`` lists them
SUBCOMMANDS: list[str] = ["demo", "verify", "convert", "inspect", "diff"]
#: exit status when the output pipe closed early (128 + SIGPIPE)
EXIT_BROKEN_PIPE = 141


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperdcp", description="Distributed checkpoints of sharded training state.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log progress and one line per save/load to stderr (the 'hyperdcp' logger at INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def _enable_logging() -> logging.Handler:
    from ..cli._text import safe_lines
    from ..logs import logger

    class SafeFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return safe_lines(super().format(record))

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter("hyperdcp: %(message)s"))
    handler.previous_level = logger.level  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    from ..errors import CheckpointError
    from ._text import safe_lines

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        handler = _enable_logging() if args.verbose else None
        try:
            rc = int(args.func(args) or 0)
            sys.stdout.flush()
            return rc
        except CheckpointError as e:
            print(f"hyperdcp {args.command}: error: {safe_lines(e)}", file=sys.stderr)
            return 1
        finally:
            if handler is not None:
                from ..logs import logger

                logger.removeHandler(handler)
                logger.setLevel(handler.previous_level)  # type: ignore[attr-defined]
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
