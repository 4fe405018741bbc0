"""TokenRange: half-open semantics and validation."""

from __future__ import annotations

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.ids import TokenRange


def test_half_open_range() -> None:
    r = TokenRange(4, 10)
    assert len(r) == 6 and not r.empty and str(r) == "[4, 10)"
    assert TokenRange(3, 3).empty
    assert r.contains(TokenRange(4, 10)) and r.contains(TokenRange(9, 9))
    assert not r.contains(TokenRange(3, 5))
    assert r.intersect(TokenRange(8, 20)) == TokenRange(8, 10)
    assert r.intersect(TokenRange(12, 20)) == TokenRange(12, 12)
    assert TokenRange(0, 1) < TokenRange(0, 2) < TokenRange(1, 1)


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (5, 4), (1.5, 3), (True, 2), (0, "3")])
def test_bad_ranges(start: object, end: object) -> None:
    with pytest.raises(InvalidArgumentError):
        TokenRange(start, end)  # type: ignore[arg-type]
