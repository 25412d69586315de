"""``hyperdcp demo``: train, save, reshard-resume on local CPU ranks (see hyperdcp.demo)."""

from __future__ import annotations


def register(sub) -> None:
    from .. import demo

    p = sub.add_parser("demo", help="train on N local CPU ranks, save, resume under another layout")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run_from_args)
