"""``kvplane demo``: placeholder until the foundation pieces land."""

from __future__ import annotations

import argparse

NAME = "demo"
HELP = "Run the end-to-end demonstration."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON summary")


def run(args: argparse.Namespace) -> int:
    print("kvplane demo")
    return 0
