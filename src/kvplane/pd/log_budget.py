"""A budget of log lines: a hostile peer must not turn each of its frames into a log line.

:class:`LogBudget` lets ``burst`` lines through per ``interval_s`` and counts the rest, which the
next line that gets through reports. It holds no logger and reads the clock it is given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvplane.validators import require_size


class LogBudget:
    """At most ``burst`` lines per ``interval_s`` (a fixed window); the rest are counted."""

    def __init__(
        self,
        *,
        burst: int = 5,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        require_size("LogBudget.burst", burst, min=1)
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        self.suppressed = 0
        """Lines refused since the last one that got through."""
        self.suppressed_total = 0
        self._window_start = -float("inf")
        self._used = 0

    def log(self, logger: logging.Logger, level: int, msg: str, *args: object) -> bool:
        """Log ``msg % args`` if the budget allows (with the count of lines suppressed before
        it); True if it was logged."""
        now = self.clock()
        if now >= self._window_start + self.interval_s:
            self._window_start, self._used = now, 0
        if self._used >= self.burst:
            self.suppressed += 1
            self.suppressed_total += 1
            return False
        self._used += 1
        if self.suppressed:
            msg += " (%d similar lines suppressed)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        logger.log(level, msg, *args, stacklevel=2)
        return True
