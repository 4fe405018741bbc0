"""The fault plans of every harness: what goes wrong on a control wire and in a transfer.

:class:`FrameFaults` is used by the simulated link (:mod:`~kvplane.testing.faulty_link`) and the
real faulty PD endpoint (:mod:`~kvplane.testing.chaos`); :class:`TransferFaults` by the faulty
transport (real batches) and the simulated backend of :mod:`~kvplane.testing.session_pair`.
:class:`FaultPlan` joins both with a seed for a chaos worker. Values only: no RNG, no I/O.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import ClassVar

from kvplane.errors import ConfigError
from kvplane.validators import require_int, require_number, require_probability


class _ExclusiveFaults:
    """Base of a fault plan: exclusive probabilities named by ``FATES`` (drawn in that order)
    and non-negative delays named by ``DELAYS``, checked at construction."""

    __slots__ = ()
    FATES: ClassVar[tuple[str, ...]]
    DELAYS: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        name = type(self).__name__
        total = sum(
            require_probability(f"{name}.{attr}", getattr(self, attr), error=ConfigError)
            for attr in self.FATES
        )
        if total > 1.0 + 1e-12:
            raise ConfigError(f"{name}: the probabilities of its exclusive faults sum past 1")
        for attr in self.DELAYS:
            require_number(f"{name}.{attr}", getattr(self, attr), min=0, error=ConfigError)

    @property
    def any(self) -> bool:
        return any(getattr(self, fate) for fate in self.FATES)

    def _draw(self, rng: random.Random) -> str | None:
        """One draw of ``rng``: the fate it falls on, None for the rest of the unit interval."""
        roll = rng.random()
        for fate in self.FATES:
            prob = getattr(self, fate)
            if roll < prob:
                return fate
            roll -= prob
        return None


@dataclass(frozen=True, slots=True)
class FrameFaults(_ExclusiveFaults):
    """Per-frame probabilities on a control wire; exclusive, drawn once per frame in this order.

    ``drop``: never arrives. ``duplicate``: arrives twice. ``reorder``: held up to
    ``reorder_s`` more, so later frames overtake it. ``corrupt``: 1-3 bytes flipped (only where
    frames are bytes: the simulated link).
    """

    FATES: ClassVar[tuple[str, ...]] = ("drop", "duplicate", "reorder", "corrupt")
    DELAYS: ClassVar[tuple[str, ...]] = ("reorder_s",)
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    corrupt: float = 0.0
    reorder_s: float = 0.01

    def pick(self, rng: random.Random) -> str:
        """One frame's fate, one draw: a field name (``"drop"``, ...) or ``"ok"``."""
        return self._draw(rng) or "ok"


class Fate(enum.Enum):
    """What a transfer's report says, whatever its bytes did."""

    OK = "ok"
    SUBMIT_ERROR = "submit_error"  # submit raises
    FAIL = "fail"  # reported FAILED
    IN_DOUBT = "in_doubt"  # reported IN_DOUBT
    LATE = "late"  # the true end, reported ``late_s`` after it
    HANG = "hang"  # no end is reported until the transfer is cancelled


@dataclass(frozen=True, slots=True)
class TransferFaults(_ExclusiveFaults):
    """Per-transfer probabilities of each :class:`Fate` (exclusive); the rest report the truth.

    A FAILED, IN_DOUBT or late report is made only after the real transfer ended, so no byte
    lands after its report.
    """

    FATES: ClassVar[tuple[str, ...]] = ("submit_error", "fail", "in_doubt", "late", "hang")
    DELAYS: ClassVar[tuple[str, ...]] = ("late_s",)
    submit_error: float = 0.0
    fail: float = 0.0
    in_doubt: float = 0.0
    late: float = 0.0
    hang: float = 0.0
    late_s: float = 0.5

    def pick(self, rng: random.Random) -> Fate:
        """One transfer's fate, one draw of ``rng``."""
        return Fate(self._draw(rng) or "ok")


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """A chaos worker's faults: its transfers', its outgoing session frames', and the seed."""

    seed: int = 0
    frames: FrameFaults = field(default_factory=FrameFaults)
    transfers: TransferFaults = field(default_factory=TransferFaults)

    def __post_init__(self) -> None:
        require_int("FaultPlan.seed", self.seed, error=ConfigError)
        if self.frames.corrupt:
            raise ConfigError("FaultPlan.frames.corrupt: a real endpoint sends events, not bytes")
