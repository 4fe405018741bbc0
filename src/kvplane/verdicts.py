"""Capability verdicts: whether a plug-in (an attention backend, a chunk codec) can take a problem.

Owns :class:`Supported`, :class:`Unsupported` (with the reasons, never empty) and :func:`verdict`,
shared by every contract whose ``check`` answers with data instead of raising. It must not know
any plug-in kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class Supported:
    """The plug-in can plan and run the problem."""


@dataclass(frozen=True, slots=True)
class Unsupported:
    """The plug-in cannot; ``reasons`` say why (and how to fix it where that is possible)."""

    reasons: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.reasons:
            raise InvalidArgumentError("Unsupported needs at least one reason")


Verdict = Supported | Unsupported


def verdict(reasons: Sequence[str]) -> Verdict:
    """:class:`Unsupported` with ``reasons`` when there are any, else :class:`Supported`."""
    return Unsupported(tuple(reasons)) if reasons else Supported()
