"""validators: exact messages, the caller's error class, and the boundaries (with hypothesis)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplane.errors import (
    CheckpointError,
    ConfigError,
    InvalidArgumentError,
    LayoutError,
    UnknownBlockError,
)
from kvplane.validators import (
    MAX_DURATION_S,
    MAX_SIZE_BYTES,
    finite_number,
    is_int,
    is_number,
    require_bool,
    require_finite_positive,
    require_id,
    require_index,
    require_int,
    require_number,
    require_probability,
    require_size,
    shown,
)

NOT_INTS = [True, False, 1.0, 2.5, "3", None, b"4", np.int64(5), [6]]
"""Values no int check accepts: bools, floats, strings, None, NumPy scalars, lists."""


def message(call: object, *args: object, **kw: object) -> str:
    with pytest.raises(InvalidArgumentError) as info:
        call(*args, **kw)  # type: ignore[operator]
    return str(info.value)


# -- exact messages ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "value", "want"),
    [
        ({}, True, "n must be an int, got True"),
        ({"min": 1}, 0, "n must be a positive int, got 0"),
        ({"min": 0}, -1, "n must be an int >= 0, got -1"),
        ({"min": 64}, 63, "n must be an int >= 64, got 63"),
        ({"max": 9}, 10, "n must be an int <= 9, got 10"),
        ({"min": 0, "max": 65535}, 65536, "n must be an int in [0, 65535], got 65536"),
        ({"min": 0, "max": (1 << 62) - 1}, 1 << 62, "n must be an int in [0, 2**62), got "
         f"{1 << 62}"),
        ({"min": 1}, 1 - 2**64, "n must be a positive int, got -18446744073709551615"),
        ({"max": 0}, 2**65, "n must be an int <= 0, got an int of 66 bits"),
        ({"min": 1}, 1.0, "n must be a positive int, got 1.0"),
    ],
)  # fmt: skip
def test_require_int_messages(kw: dict[str, int], value: object, want: str) -> None:
    assert message(require_int, "n", value, **kw) == want


def test_messages_of_the_other_checks() -> None:
    assert message(require_index, "slot", 4, 4) == "slot must be an int in [0, 4), got 4"
    assert message(require_index, "x", -1, 2**40) == "x must be an int in [0, 2**40), got -1"
    assert (
        message(require_id, "S.peer_id", "") == "S.peer_id must be a 1-256 character string, got ''"
    )
    assert (
        message(require_id, "n", "abc", max_len=2) == "n must be a 1-2 character string, got 'abc'"
    )
    assert (
        message(require_size, "nbytes", 0, min=1)
        == "nbytes must be a byte count in [1, 2**62], got 0"
    )
    assert message(require_size, "b", 5, max=4) == "b must be a byte count in [0, 4], got 5"
    assert message(require_bool, "causal", 1) == "causal must be a bool, got 1"
    assert (
        message(require_number, "x", math.nan, min=0) == "x must be a finite number >= 0, got nan"
    )
    assert message(require_number, "x", 0, above=0) == "x must be a finite number > 0, got 0"
    assert message(require_number, "x", "1") == "x must be a finite number, got '1'"
    assert message(require_probability, "p", 1.5) == "p must be a probability in [0, 1], got 1.5"
    assert message(require_finite_positive, "t", 0, InvalidArgumentError) == (
        "t must be a finite number > 0 and at most 1e+06 s, got 0"
    )  # fmt: skip
    assert require_finite_positive("t", 0, zero=True) == 0.0  # 0: "never", where allowed
    assert message(require_finite_positive, "t", -1e-9, InvalidArgumentError, zero=True) == (
        "t must be a finite number >= 0 and at most 1e+06 s, got -1e-09"
    )


def test_the_callers_error_class_is_raised_exactly() -> None:
    with pytest.raises(ConfigError) as cfg:
        require_int("Cfg.n", 0, min=1, error=ConfigError)
    assert type(cfg.value) is ConfigError
    with pytest.raises(LayoutError):
        require_size("L.bytes", -1, error=LayoutError)
    with pytest.raises(CheckpointError):
        require_number("config.json 'eps'", math.inf, min=0, error=CheckpointError)
    with pytest.raises(UnknownBlockError) as block:  # not an InvalidArgumentError: a KeyError
        require_index("a block id of pool 'p'", 8, 8, error=UnknownBlockError)
    assert str(block.value) == "a block id of pool 'p' must be an int in [0, 8), got 8"
    with pytest.raises(ConfigError):
        require_bool("b", "yes", error=ConfigError)
    with pytest.raises(ConfigError):
        require_probability("p", -0.1, error=ConfigError)
    with pytest.raises(ConfigError):
        require_id("i", 7, error=ConfigError)
    with pytest.raises(ConfigError):  # the duration check keeps its ConfigError default
        require_finite_positive("t", -1)


# -- ints --------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", NOT_INTS)
def test_no_int_check_accepts_a_non_int(value: object) -> None:
    assert not is_int(value)
    with pytest.raises(InvalidArgumentError):
        require_int("n", value)
    with pytest.raises(InvalidArgumentError):
        require_size("n", value)


@given(st.integers(), st.integers(-(2**70), 2**70), st.integers(-(2**70), 2**70))
def test_require_int_bounds_are_inclusive(value: int, low: int, high: int) -> None:
    inside = low <= value <= high
    if inside:
        assert require_int("n", value, min=low, max=high) == value
    else:
        with pytest.raises(InvalidArgumentError, match=r"^n must be "):
            require_int("n", value, min=low, max=high)
    assert require_int("n", value) == value  # no bound: any int, however large
    assert require_int("n", low, min=low) == low
    assert require_int("n", high, max=high) == high


@given(st.integers(-(2**80), 2**80), st.integers(0, 2**70))
def test_require_index_is_half_open(value: int, count: int) -> None:
    if 0 <= value < count:
        assert require_index("i", value, count) == value
        if value < 2**63:
            assert require_index("i", np.int64(value), count) == value
    else:
        with pytest.raises(InvalidArgumentError):
            require_index("i", value, count)


def test_require_index_takes_numpy_ints_not_bools_or_floats() -> None:
    got = require_index("i", np.int32(3), 4)
    assert got == 3 and type(got) is int
    for bad in (True, np.bool_(True), 1.0, np.float64(1.0), "1", None):
        with pytest.raises(InvalidArgumentError):
            require_index("i", bad, 4)


@given(st.integers(-(2**64), 2**64), st.integers(0, 2**64))
def test_require_size_bounds(value: int, low: int) -> None:
    if low <= value <= MAX_SIZE_BYTES:
        assert require_size("s", value, min=low) == value
    else:
        with pytest.raises(InvalidArgumentError, match=r"^s must be a byte count in \["):
            require_size("s", value, min=low)


def test_size_and_id_edges() -> None:
    assert require_size("s", MAX_SIZE_BYTES) == MAX_SIZE_BYTES
    assert require_size("s", 0) == 0
    assert require_id("i", "x" * 256) == "x" * 256
    for bad in ("x" * 257, "", 5, None, b"x"):
        with pytest.raises(InvalidArgumentError):
            require_id("i", bad)


def test_require_bool() -> None:
    assert require_bool("b", True) is True
    assert require_bool("b", False) is False
    for bad in (0, 1, "true", None, np.bool_(True)):
        with pytest.raises(InvalidArgumentError):
            require_bool("b", bad)


# -- numbers -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "want"),
    [(2, 2.0), (0.5, 0.5), (True, None), ("1", None), (None, None), (math.inf, None),
     (math.nan, None), (10**400, None)],
)  # fmt: skip
def test_finite_number(value: object, want: float | None) -> None:
    assert finite_number(value) == want


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**1100), 2**1100))
def test_require_number_refuses_what_is_not_finite(value: float) -> None:
    number = finite_number(value)
    if number is None:
        with pytest.raises(InvalidArgumentError):
            require_number("x", value)
    else:
        got = require_number("x", value)
        assert got == number and type(got) is float
        assert is_number(value)


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 3) | st.booleans())
def test_require_probability_is_the_closed_unit_interval(value: float) -> None:
    ok = not isinstance(value, bool) and 0 <= value <= 1
    if ok:
        got = require_probability("p", value)
        assert got == value and type(got) is float
    else:
        with pytest.raises(InvalidArgumentError, match=r"^p must be a probability in \[0, 1\]"):
            require_probability("p", value)


# -- durations ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "shown_as"),
    [
        *((v, repr(v)) for v in (0, -1.5, float("nan"), float("inf"), True, "5", None)),
        (1e6 + 1, "1000001.0"),
        (10**6 + 1, "1000001"),
        pytest.param(10**400, "an int of 1329 bits", id="int>float"),  # a float overflows
        pytest.param(10**5000, "an int of 16610 bits", id="int>repr"),  # repr would raise
    ],
)
def test_require_finite_positive_refuses_with_the_callers_error(
    value: object, shown_as: str
) -> None:
    with pytest.raises(ConfigError) as info:
        require_finite_positive("Cfg.wait_s", value)
    assert (
        str(info.value)
        == f"Cfg.wait_s must be a finite number > 0 and at most 1e+06 s, got {shown_as}"
    )
    with pytest.raises(InvalidArgumentError) as plain:
        require_finite_positive("wait_s", value, InvalidArgumentError)
    assert type(plain.value) is InvalidArgumentError


def test_require_finite_positive_returns_the_value_as_a_float() -> None:
    got = [require_finite_positive("x", v) for v in (2, 1e-9, MAX_DURATION_S, 10**6)]
    assert got == [2.0, 1e-9, 1e6, 1e6]
    assert all(type(v) is float for v in got)


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**1100), 2**1100))
def test_require_finite_positive_is_the_half_open_duration_range(value: float) -> None:
    if 0 < value <= MAX_DURATION_S:
        assert require_finite_positive("t", value) == float(value)
    else:
        with pytest.raises(ConfigError):
            require_finite_positive("t", value)


# -- shown -------------------------------------------------------------------------------------
def test_shown_names_huge_ints_by_their_bits() -> None:
    assert shown(2**64 - 1) == "18446744073709551615"
    assert shown(2**64) == "an int of 65 bits"
    assert shown(-(10**5000)) == "an int of 16610 bits"
    assert shown("x") == "'x'"
