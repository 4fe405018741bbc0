"""ARCPolicy: exact eviction order through ghost hits, p adaptation and ghost trimming."""

from __future__ import annotations

import pytest
from offload_testlib import keys

from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.offload.policies import ARCPolicy, make_policy

a, b, c, d, e = keys(0, 1, 2, 3, 4)
ALL = lambda k: True  # noqa: E731


def test_exact_eviction_order_with_ghost_hits() -> None:
    p = ARCPolicy(4)
    for k in (a, b, c, d):
        p.insert(k)
    p.access(a)
    p.access(b)  # frequency list T2 = [a, b]; recency list T1 = [c, d]
    assert (p.t1, p.t2, p.p) == ([c, d], [a, b], 0.0)
    assert p.select_victims(1, ALL) == [c]  # |T1| = 2 > p = 0: T1's LRU end
    p.evict(c)
    p.insert(e)
    assert p.select_victims(1, ALL) == [d]
    p.evict(d)
    assert p.b1 == [c, d]
    p.insert(c)  # a B1 ghost returns: p grows by max(|B2|/|B1|, 1) = 1, c goes to T2
    assert (p.t1, p.t2, p.b1, p.p) == ([e], [a, b, c], [d], 1.0)
    assert p.select_victims(2, ALL) == [a, b]  # |T1| = 1 is within p = 1: T2 first
    assert p.order() == [a, b, c, e]
    p.evict(a)
    assert p.b2 == [a]
    p.insert(a)  # a B2 ghost returns: p shrinks by max(|B1|/|B2|, 1) = 1
    assert (p.t2, p.b2, p.p) == ([b, c, a], [], 0.0)
    assert p.select_victims(1, ALL) == [e]
    assert p.select_victims(1, lambda k: k != e) == [b]  # pinned e is skipped, T2 serves
    assert p.select_victims(5, ALL) is None
    p.check_integrity({a, b, c, e})


def test_ghost_lists_are_trimmed_to_capacity() -> None:
    p = ARCPolicy(2)
    p.insert(a)
    p.insert(b)
    p.evict(a)
    p.evict(b)
    assert p.b1 == [a, b] and len(p) == 0
    p.insert(c)  # |T1| + |B1| would be 3 > 2: the oldest ghost goes
    assert p.b1 == [b] and p.t1 == [c]
    p.remove(c)  # removal forgets without a ghost
    assert p.b1 == [b] and p.t1 == []
    p.check_integrity(set())


def test_misuse() -> None:
    p = ARCPolicy(2)
    p.insert(a)
    with pytest.raises(InvalidArgumentError):
        p.insert(a)
    with pytest.raises(InvalidArgumentError):
        p.evict(b)
    with pytest.raises(InvalidArgumentError):
        p.remove(b)
    with pytest.raises(ConfigError, match="lfu"):
        make_policy("lfu", 2)
    assert isinstance(make_policy("arc", 2), ARCPolicy)
