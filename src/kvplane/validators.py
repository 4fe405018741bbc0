"""The one home of scalar argument checks: ints, ids, byte sizes, numbers, probabilities,
durations and bools.

Each ``require_*`` returns the checked value or raises the error class its caller names (a
:mod:`kvplane.errors` class; :class:`~kvplane.errors.InvalidArgumentError` by default) with one
line ``"<what> must be <rule>, got <value>"``. Bools are never ints or numbers here, floats are
never ints, and ints too big to print or convert are shown by their bit length. Imports only the
standard library and :mod:`kvplane.errors`: array (NumPy/torch) checks live with their arrays.
"""

from __future__ import annotations

import math
import operator
from typing import TypeGuard

from kvplane.errors import ConfigError, InvalidArgumentError, KVPlaneError

MAX_DURATION_S = 1e6
"""The longest timeout, lease, stall or deadline accepted (about 11.6 days): a longer one means
"never", and would overflow the clocks and timers it turns into (``threading`` waits, socket
timeouts, millisecond counts) at some later call instead of being refused up front."""

MAX_SIZE_BYTES = 2**62
"""The largest byte count :func:`require_size` accepts (as ``layout.MAX_POOL_BYTES``): an
offset into such a buffer plus a length inside it ends below 2**63, so it fits an int64."""

Error = type[KVPlaneError]
"""The error class a caller chooses (``ConfigError``, ``LayoutError``, ``PlanError``...)."""


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool (``True`` is never the int 1 here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or a float and not a bool (NaN and infinities included)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def shown(value: object) -> str:
    """``repr(value)``, or ``"an int of N bits"`` for an int past 64 bits (whose repr may be
    refused, and is never worth reading in an error message)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return repr(value)


def _pow2(n: int) -> str:
    """``n``, as ``2**k`` when it is a power of two past 32 bits."""
    return f"2**{n.bit_length() - 1}" if n > 2**32 and n & (n - 1) == 0 else str(n)


def _interval(low: int, high: int) -> str:
    """``[low, high]``, or ``[low, 2**k)`` when ``high + 1`` is a power of two past 32 bits."""
    top = _pow2(high + 1)
    return f"[{low}, {top})" if top.startswith("2**") else f"[{low}, {high}]"


def require_int(
    what: str,
    value: object,
    *,
    min: int | None = None,
    max: int | None = None,
    error: Error = InvalidArgumentError,
) -> int:
    """``value`` when it is an int (not a bool, not a float) in ``[min, max]`` (both inclusive,
    either optional), else ``error``: ``"<what> must be a positive int, got 0"`` (``min=1``),
    ``"an int >= <min>"``, ``"an int <= <max>"``, ``"an int in [<min>, <max>]"`` or ``"an int"``.
    """
    if is_int(value) and (min is None or value >= min) and (max is None or value <= max):
        return value
    if min is None and max is None:
        rule = "an int"
    elif max is None:
        rule = "a positive int" if min == 1 else f"an int >= {min}"
    elif min is None:
        rule = f"an int <= {max}"
    else:
        rule = f"an int in {_interval(min, max)}"
    raise error(f"{what} must be {rule}, got {shown(value)}")


def require_index(
    what: str, value: object, count: int, *, error: Error = InvalidArgumentError
) -> int:
    """``value`` as a plain int in ``[0, count)`` (an index into ``count`` entries: a slot, a
    block), else ``error``: ``"<what> must be an int in [0, <count>), got 9"``. NumPy integers
    pass (indices come out of arrays); bools, floats and strings do not."""
    if not isinstance(value, bool):
        try:
            index = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if 0 <= index < count:
                return index
    raise error(f"{what} must be an int in [0, {_pow2(count)}), got {shown(value)}")


def require_id(
    what: str, value: object, *, max_len: int = 256, error: Error = InvalidArgumentError
) -> str:
    """``value`` when it is a name that travels in frames (a peer, session or request id): a
    ``str`` of 1 to ``max_len`` characters; else ``error``: ``"<what> must be a 1-256 character
    string, got ''"``."""
    if isinstance(value, str) and 1 <= len(value) <= max_len:
        return value
    raise error(f"{what} must be a 1-{max_len} character string, got {shown(value)}")


def require_size(
    what: str,
    value: object,
    *,
    min: int = 0,
    max: int = MAX_SIZE_BYTES,
    error: Error = InvalidArgumentError,
) -> int:
    """``value`` when it is a byte count: an int (not a bool) in ``[min, max]``, by default
    ``[0, MAX_SIZE_BYTES]``; else ``error``: ``"<what> must be a byte count in [1, 2**62], got
    0"``."""
    if is_int(value) and min <= value <= max:
        return value
    raise error(f"{what} must be a byte count in [{min}, {_pow2(max)}], got {shown(value)}")


def require_bool(what: str, value: object, *, error: Error = InvalidArgumentError) -> bool:
    """``value`` when it is a bool (not 0 or 1, not a string), else ``error`` naming ``what``."""
    if isinstance(value, bool):
        return value
    raise error(f"{what} must be a bool, got {shown(value)}")


def finite_number(value: object) -> float | None:
    """``value`` as a finite float, or ``None`` when it is not a number (``None``, a bool, a
    string...) or not finite (NaN, an infinity, or an int beyond float range)."""
    if not is_number(value):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return number if math.isfinite(number) else None


def require_number(
    what: str,
    value: object,
    *,
    min: float | None = None,
    above: float | None = None,
    error: Error = InvalidArgumentError,
) -> float:
    """``float(value)`` when it is a finite int or float (not a bool), at least ``min`` and
    greater than ``above`` where given; else ``error``: ``"<what> must be a finite number >= 0,
    got nan"`` (``"> <above>"`` for ``above``)."""
    number = finite_number(value)
    if number is not None and (min is None or number >= min) and (above is None or number > above):
        return number
    rule = "a finite number"
    if min is not None:
        rule += f" >= {min:g}"
    if above is not None:
        rule += f" > {above:g}"
    raise error(f"{what} must be {rule}, got {shown(value)}")


def require_probability(what: str, value: object, *, error: Error = InvalidArgumentError) -> float:
    """``float(value)`` when it is an int or float in ``[0, 1]`` (not a bool, not NaN), else
    ``error``: ``"<what> must be a probability in [0, 1], got 1.5"``. Also right for fractions
    and ratios bounded by 1."""
    if is_number(value) and 0 <= value <= 1:
        return float(value)
    raise error(f"{what} must be a probability in [0, 1], got {shown(value)}")


def require_finite_positive(
    what: str, value: object, error: Error = ConfigError, *, zero: bool = False
) -> float:
    """``float(value)`` when it is an int or float in ``(0, MAX_DURATION_S]`` (a duration in
    seconds; ``[0, MAX_DURATION_S]`` with ``zero``, where 0 means "never"), else ``error``
    naming ``what`` and the value. Bools, strings, NaN, the infinities and ints too large for a
    float are refused.

    The one duration check below the components, so a config and the object it configures
    (which must not import that config) refuse the same values with the same message.
    """
    if is_number(value) and (value >= 0 if zero else value > 0) and value <= MAX_DURATION_S:
        return float(value)  # exact for any int; NaN is False
    low = ">= 0" if zero else "> 0"
    raise error(
        f"{what} must be a finite number {low} and at most {MAX_DURATION_S:g} s, got {shown(value)}"
    )
