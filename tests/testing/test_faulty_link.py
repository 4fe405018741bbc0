"""The fault-injecting in-memory link: seeded, ordered by arrival, faults counted."""

from __future__ import annotations

import random

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.testing.faulty_link import Faults, FaultyLink


def deliveries(seed: int, faults: Faults, n: int = 200) -> tuple[list[bytes], dict[str, int]]:
    link = FaultyLink(faults, random.Random(seed))
    for i in range(n):
        link.send(i * 0.001, "a", "b", i.to_bytes(4, "big"))
    got = [d.frame for d in link.due(10.0)]
    return got, dict(link.stats)


def test_a_clean_link_delivers_everything_in_order_of_arrival() -> None:
    got, stats = deliveries(1, Faults(min_delay_s=0.0, max_delay_s=0.0))
    assert got == [i.to_bytes(4, "big") for i in range(200)]
    assert stats == {"sent": 200, "delivered": 200}


def test_faults_are_reproducible_from_the_seed_and_counted() -> None:
    faults = Faults(drop=0.1, duplicate=0.1, reorder=0.3, corrupt=0.1, reorder_delay_s=0.05)
    a, stats = deliveries(7, faults)
    assert (a, stats) == deliveries(7, faults)
    assert a != deliveries(8, faults)[0]
    assert stats["delivered"] == stats["sent"] - stats["dropped"] + stats["duplicated"] == len(a)
    assert stats["dropped"] > 0 and stats["duplicated"] > 0 and stats["corrupted"] > 0
    clean = {i.to_bytes(4, "big") for i in range(200)}
    assert sum(f not in clean for f in a) > 0  # corrupted copies arrive changed
    ints = [int.from_bytes(f, "big") for f in a if f in clean]
    assert ints != sorted(ints)  # reordered


def test_partition_drops_both_directions_until_healed() -> None:
    link = FaultyLink(Faults(), random.Random(0))
    link.partition("a", "b")
    link.send(0.0, "a", "b", b"1")
    link.send(0.0, "b", "a", b"2")
    link.send(0.0, "a", "c", b"3")
    link.heal("a", "b")
    link.send(0.0, "a", "b", b"4")
    assert sorted(d.frame for d in link.due(1.0)) == [b"3", b"4"]
    assert link.stats["partitioned"] == 2 and len(link) == 0 and link.next_time() is None


@pytest.mark.parametrize(
    "kwargs", [{"drop": 1.0}, {"corrupt": -0.1}, {"min_delay_s": 0.5, "max_delay_s": 0.1}]
)
def test_bad_faults(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgumentError):
        Faults(**kwargs)
