"""Deprecated: the demo lives in :mod:`hyperdcp.cli.demo` (``python -m hyperdcp demo``)."""

from .cli.demo import add_arguments, main, run, run_from_args  # noqa: F401
