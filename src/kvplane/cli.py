"""The ``kvplane`` command line: one subcommand per module in ``kvplane.apps``.

Each command module exposes ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``;
this file only wires them into argparse, so commands stay independent of one another.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from kvplane import __version__
from kvplane.apps import demo, generate, report, serve, simulate
from kvplane.apps.bench import command as bench
from kvplane.apps.bench import tune
from kvplane.errors import KVPlaneError


def _commands() -> list[ModuleType]:
    return [demo, bench, generate, serve, report, simulate, tune]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvplane",
        description="kvplane: the KV-cache data plane of disaggregated LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"kvplane {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _commands():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        code: int = run(args)
    except KVPlaneError as exc:
        print(f"kvplane: error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
