"""The benches' noise and row shape: a ratio's spread over paired repeats, the loop that repeats
until that spread is stable, and :class:`Row`, one line of ``kvplane bench all``.

Owns the settle pause and the paired-ratio estimator every bench uses; does no timing of its
own beyond calling the pair it is given. Imports only the standard library and kvplane's
errors and validators, so any bench (and its tests) can use it without torch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

from kvplane.errors import InvalidArgumentError
from kvplane.validators import finite_number, require_int, require_number

SETTLE_S = 0.03
"""Pause before every timed run: after a torch op its OpenMP threads spin-wait for several
milliseconds, stealing the cores of whatever runs next (measured: a copy right after the limit's
``copy_`` lost a third of its speed); each run starts on a quiet machine instead."""
STABLE_MIN_REPEATS = 3
"""Fewer ratios than this are never called stable: one or two agree with themselves."""


@dataclass(frozen=True, slots=True)
class Spread:
    """Paired per-repeat ratios of one row: repeat i timed ours and the limit back to back."""

    repeats: int
    ratio_min: float
    ratio_median: float
    ratio_max: float
    stable: bool
    """The middle half of the ratios lies within ±tolerance of the median (and there are at
    least :data:`STABLE_MIN_REPEATS` of them)."""

    def fields(self) -> dict[str, float | int | bool]:
        """``{"repeats", "ratio_min", "ratio_median", "ratio_max", "stable"}``, the ratios
        rounded to 4 decimals (a bench's JSON row)."""
        return {
            "repeats": self.repeats,
            "ratio_min": round(self.ratio_min, 4),
            "ratio_median": round(self.ratio_median, 4),
            "ratio_max": round(self.ratio_max, 4),
            "stable": self.stable,
        }


def spread_of(ratios: Sequence[float], *, tolerance: float = 0.05) -> Spread:
    """The spread of already-formed per-repeat ratios (at least one, each finite and > 0).
    Stable when the middle half of the sorted ratios -- from index ``n // 4`` to
    ``n - 1 - n // 4`` -- lies within ``median * (1 ± tolerance)`` and ``n`` is at least
    :data:`STABLE_MIN_REPEATS`; with fewer than 4 ratios that middle is all of them.
    :class:`~kvplane.errors.InvalidArgumentError` otherwise."""
    tol = require_number("tolerance", tolerance, min=0.0)
    if not ratios:
        raise InvalidArgumentError("ratios must hold at least one ratio, got none")
    for r in ratios:
        number = finite_number(r)
        if number is None or number <= 0:
            raise InvalidArgumentError(f"ratios must be finite numbers > 0, got {r!r}")
    ordered = sorted(float(r) for r in ratios)
    n = len(ordered)
    median = statistics.median(ordered)
    low, high = ordered[n // 4], ordered[n - 1 - n // 4]
    stable = n >= STABLE_MIN_REPEATS and median * (1 - tol) <= low and high <= median * (1 + tol)
    return Spread(n, ordered[0], median, ordered[-1], stable)


def spread(
    ours_s: Sequence[float],
    limit_s: Sequence[float],
    *,
    tolerance: float = 0.05,
    higher_is_better: bool = True,
) -> Spread:
    """The spread of paired ratios from seconds per repeat, both sides moving the same bytes:
    ``limit_s[i] / ours_s[i]`` (a throughput ratio, 1 = at the limit) when
    ``higher_is_better``, else ``ours_s[i] / limit_s[i]`` (a time ratio). Equal-length
    sequences of positive seconds, else :class:`~kvplane.errors.InvalidArgumentError`."""
    if len(ours_s) != len(limit_s):
        raise InvalidArgumentError(
            f"ours_s and limit_s must be paired, got {len(ours_s)} and {len(limit_s)} repeats"
        )
    for s in (*ours_s, *limit_s):
        number = finite_number(s)
        if number is None or number <= 0:
            raise InvalidArgumentError(f"seconds must be finite numbers > 0, got {s!r}")
    pairs = zip(ours_s, limit_s, strict=True)
    ratios = [lim / us if higher_is_better else us / lim for us, lim in pairs]
    return spread_of(ratios, tolerance=tolerance)


class RepeatOptions(TypedDict, total=False):
    """The keywords of :func:`repeat_rows_until_stable` (and so of :func:`repeat_until_stable`)."""

    min_repeats: int
    max_repeats: int
    cap_s: float
    tolerance: float
    settle_s: float
    clock: Callable[[], float]


def repeat_until_stable(
    pair: Callable[[], tuple[float, float]], **options: Unpack[RepeatOptions]
) -> tuple[list[float], list[float]]:
    """Seconds ``(ours_s, limit_s)`` of repeated calls of ``pair`` -- one repeat, returning its
    ``(ours_s, limit_s)`` timed back to back -- under :func:`repeat_rows_until_stable`'s rules
    (``options``). The caller reads stability from ``spread(ours_s, limit_s)``."""
    [(ours, limit)] = repeat_rows_until_stable(lambda: [pair()], **options)
    return ours, limit


def repeat_rows_until_stable(
    step: Callable[[], Sequence[tuple[float, float]]],
    *,
    min_repeats: int = 5,
    max_repeats: int = 40,
    cap_s: float = 20.0,
    tolerance: float = 0.05,
    settle_s: float = SETTLE_S,
    clock: Callable[[], float] = time.perf_counter,
) -> list[tuple[list[float], list[float]]]:
    """Seconds ``(ours_s, limit_s)`` per row of repeated calls of ``step`` -- one repeat,
    returning one ``(ours_s, limit_s)`` per row (always as many, in the same order), each call
    after a ``settle_s`` pause. Stops at the first of: at least ``min_repeats`` run and every
    row's :func:`spread` (with ``tolerance``) stable; ``max_repeats`` run; ``cap_s`` seconds
    passed since the call (by ``clock``; at least one repeat is always run)."""
    low = require_int("min_repeats", min_repeats, min=1)
    high = require_int("max_repeats", max_repeats, min=low)
    cap = require_number("cap_s", cap_s, above=0.0)
    pause = require_number("settle_s", settle_s, min=0.0)
    rows: list[tuple[list[float], list[float]]] = []
    start = clock()
    for done in range(1, high + 1):
        if pause:
            time.sleep(pause)
        got = list(step())
        if not rows:
            rows = [([], []) for _ in got]
        if len(got) != len(rows):
            raise InvalidArgumentError(f"a step gave {len(got)} rows, the first {len(rows)}")
        for (ours, limit), (us, lim) in zip(rows, got, strict=True):
            ours.append(us)
            limit.append(lim)
        if clock() - start >= cap:
            break
        if done >= low and all(spread(o, li, tolerance=tolerance).stable for o, li in rows):
            break
    return rows


def paired_ratio(ours_s: Sequence[float], limit_s: Sequence[float]) -> float:
    """Throughput ratio ours / limit from seconds per repeat: the median of the per-repeat
    ratios ``limit_s[i] / ours_s[i]``. Repeat ``i`` timed both back to back, under the same
    machine load; on a shared host the load drifts between repeats, and a ratio of the two
    medians would divide times taken under different conditions."""
    return spread(ours_s, limit_s).ratio_median


@dataclass(frozen=True, slots=True)
class Row:
    """One line of ``kvplane bench all``: a figure, its limit, their ratio with its spread."""

    bench: str
    """The bench's name: ``"attention"``, ``"offload"``..."""
    row: str
    """What the line measures, e.g. ``"decode_gbps_vs_readonly"``."""
    figure: float
    """Ours, in ``unit``."""
    unit: str
    """``"GB/s"``, ``"ms"``, ``"µs/block"``..."""
    limit: float
    """The limit's figure in the same unit."""
    limit_name: str
    """``"read-only pass"``, ``"redis-benchmark -P 16"``, ``"memcpy"``..."""
    spread: Spread
    """Of the ratio as the row defines it; ``spread.ratio_median`` is THE ratio."""
    target: float | None
    """The ratio the issue or bench targets; None if none."""
    higher_is_better: bool
    """Direction of the ratio against ``target``."""

    @property
    def met(self) -> bool | None:
        """Whether the median ratio reaches ``target`` in its direction; None without one."""
        if self.target is None:
            return None
        if self.higher_is_better:
            return self.spread.ratio_median >= self.target
        return self.spread.ratio_median <= self.target

    def as_dict(self) -> dict[str, object]:
        """The flat JSON row: bench, row, figure, unit, limit, limit_name, the
        :meth:`Spread.fields`, target and met; figures rounded to 4 significant digits."""
        return {
            "bench": self.bench,
            "row": self.row,
            "figure": float(f"{self.figure:.4g}"),
            "unit": self.unit,
            "limit": float(f"{self.limit:.4g}"),
            "limit_name": self.limit_name,
            **self.spread.fields(),
            "target": self.target,
            "met": self.met,
        }
