"""AdmissionFilter: admit from the N-th lookup; bounded memory; N = 0 admits all."""

from __future__ import annotations

import pytest
from offload_testlib import key, keys

from kvplane.errors import InvalidArgumentError
from kvplane.offload.admission import AdmissionFilter


def test_admits_from_the_nth_lookup() -> None:
    f = AdmissionFilter(min_lookups=2)
    assert not f.admits(key(0))
    f.record(keys(0, 1))
    assert not f.admits(key(0)) and f.lookups(key(0)) == 1
    f.record(keys(0))
    assert f.admits(key(0)) and not f.admits(key(1))


def test_default_admits_what_was_looked_up_and_zero_admits_all() -> None:
    f = AdmissionFilter()
    assert not f.admits(key(3))
    f.record([key(3)])
    assert f.admits(key(3))
    assert AdmissionFilter(0).admits(key(4))


def test_counts_are_bounded_lru() -> None:
    f = AdmissionFilter(min_lookups=1, capacity=2)
    f.record(keys(0, 1))
    f.record(keys(0))  # 0 becomes the most recent
    f.record(keys(2))  # 1 falls out
    assert len(f) == 2 and f.lookups(key(1)) == 0 and f.lookups(key(0)) == 2


@pytest.mark.parametrize("kw", [{"min_lookups": -1}, {"capacity": 0}, {"min_lookups": True}])
def test_bad_arguments(kw: dict[str, int]) -> None:
    with pytest.raises(InvalidArgumentError):
        AdmissionFilter(**kw)
