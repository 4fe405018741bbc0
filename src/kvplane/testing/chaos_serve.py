"""``python -m kvplane.testing.chaos_serve ROLE ...``: ``kvplane serve`` with seeded faults.

Takes every flag of ``kvplane serve prefill|decode`` plus ``--chaos-seed`` and one probability
per fault of :class:`~kvplane.testing.faults.TransferFaults` and
:class:`~kvplane.testing.faults.FrameFaults` (``--chaos-fail``, ``--chaos-drop``, ...), and
serves through the worker's hooks; bad flags are one line on stderr and exit status 1, as for
``kvplane serve``. A test harness: ``kvplane serve`` has no fault flags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvplane.apps import serve
from kvplane.errors import KVPlaneError
from kvplane.testing.chaos import worker_hooks
from kvplane.testing.faults import FaultPlan, FrameFaults, TransferFaults

TRANSFER = ("submit_error", "fail", "in_doubt", "late", "hang")
FRAME = ("drop", "duplicate", "reorder")
REORDER_S = 0.05
"""How long a reordered frame is held back at most (seconds)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvplane.testing.chaos_serve")
    serve.add_arguments(parser)
    for role_parser in _role_parsers(parser):
        c = role_parser.add_argument_group("chaos (seeded fault injection)")
        c.add_argument("--chaos-seed", type=int, default=0)
        for fault in TRANSFER + FRAME:
            flag = "--chaos-" + fault.replace("_", "-")
            c.add_argument(flag, type=float, default=0.0, help="probability")
    return parser


def _role_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [p for role, p in sub.choices.items() if role in ("prefill", "decode")]


def fault_plan(args: argparse.Namespace) -> FaultPlan:
    """The plan the ``--chaos-*`` flags name."""
    transfers = TransferFaults(**{f: getattr(args, "chaos_" + f) for f in TRANSFER})
    frames = FrameFaults(**{f: getattr(args, "chaos_" + f) for f in FRAME}, reorder_s=REORDER_S)
    return FaultPlan(seed=args.chaos_seed, frames=frames, transfers=transfers)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the worker ``argv`` names with its faults until told to stop: 0; 2 without a
    worker role; 1 for a ``KVPlaneError`` (a bad value, a busy address: one line)."""
    args = build_parser().parse_args(argv)
    if getattr(args, "role", None) not in ("prefill", "decode"):
        print(
            "usage: python -m kvplane.testing.chaos_serve {prefill,decode} [flags]", file=sys.stderr
        )
        return 2
    try:
        return serve.run(args, hooks=worker_hooks(fault_plan(args)))
    except KVPlaneError as exc:  # bad flags or addresses: one line, as `kvplane serve` says it
        print(f"chaos_serve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
