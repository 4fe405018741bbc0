"""LRUPolicy: exact eviction order, skipping unevictable chunks, atomic selection."""

from __future__ import annotations

import pytest
from offload_testlib import key, keys

from kvplane.errors import IllegalTransitionError, InvalidArgumentError
from kvplane.offload.policies import LRUPolicy, make_policy


def test_exact_eviction_order() -> None:
    p = LRUPolicy(4)
    for k in keys(0, 1, 2, 3):
        p.insert(k)
    p.access(key(1))
    p.access(key(9))  # not resident: ignored
    assert p.order() == keys(0, 2, 3, 1)
    assert p.select_victims(2, lambda k: True) == keys(0, 2)
    assert p.select_victims(2, lambda k: k != key(0)) == keys(2, 3)  # pinned skipped in place
    assert p.select_victims(5, lambda k: True) is None
    assert p.select_victims(0, lambda k: True) == []
    assert p.order() == keys(0, 2, 3, 1)  # selecting changed nothing
    p.evict(key(0))
    p.insert(key(4))
    p.access(key(2))
    assert p.order() == keys(3, 1, 4, 2)
    p.remove(key(1))
    assert p.order() == keys(3, 4, 2) and len(p) == 3 and key(4) in p
    p.check_integrity(set(keys(2, 3, 4)))


def test_misuse_and_integrity() -> None:
    p = LRUPolicy(2)
    p.insert(key(0))
    with pytest.raises(InvalidArgumentError):
        p.insert(key(0))
    with pytest.raises(InvalidArgumentError):
        p.evict(key(1))
    with pytest.raises(IllegalTransitionError):
        p.check_integrity(set(keys(0, 1)))
    with pytest.raises(InvalidArgumentError):
        LRUPolicy(0)
    assert make_policy("lru", 3).name == "lru"
    p.check_integrity({key(0)})
