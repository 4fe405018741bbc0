"""The fault-injecting in-memory link: seeded, ordered by arrival, faults counted."""

from __future__ import annotations

import random

import pytest

from kvplane.errors import ConfigError
from kvplane.testing.faults import FrameFaults
from kvplane.testing.faulty_link import FaultyLink


def deliveries(
    seed: int, faults: FrameFaults, n: int = 200, latency_s: tuple[float, float] = (0.0005, 0.002)
) -> tuple[list[bytes], dict[str, int]]:
    link = FaultyLink(faults, random.Random(seed), latency_s=latency_s)
    for i in range(n):
        link.send(i * 0.001, "a", "b", i.to_bytes(4, "big"))
    got = [d.frame for d in link.due(10.0)]
    return got, dict(link.stats)


def test_a_clean_link_delivers_everything_in_order_of_arrival() -> None:
    got, stats = deliveries(1, FrameFaults(), latency_s=(0.0, 0.0))
    assert got == [i.to_bytes(4, "big") for i in range(200)]
    assert stats == {"sent": 200, "delivered": 200}


def test_faults_are_reproducible_from_the_seed_and_counted() -> None:
    faults = FrameFaults(drop=0.1, duplicate=0.1, reorder=0.3, corrupt=0.1, reorder_s=0.05)
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
    link = FaultyLink(FrameFaults(), random.Random(0))
    link.partition("a", "b")
    link.send(0.0, "a", "b", b"1")
    link.send(0.0, "b", "a", b"2")
    link.send(0.0, "a", "c", b"3")
    link.heal("a", "b")
    link.send(0.0, "a", "b", b"4")
    assert sorted(d.frame for d in link.due(1.0)) == [b"3", b"4"]
    assert link.stats["partitioned"] == 2 and len(link) == 0 and link.next_time() is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"drop": 1.5}, "FrameFaults.drop must be a probability in [0, 1], got 1.5"),
        ({"corrupt": -0.1}, "FrameFaults.corrupt must be a probability in [0, 1], got -0.1"),
        ({"drop": True}, "FrameFaults.drop must be a probability in [0, 1], got True"),
        ({"drop": 0.6, "reorder": 0.5}, "FrameFaults: the probabilities of its exclusive faults"),
        ({"reorder_s": -1.0}, "FrameFaults.reorder_s must be a finite number >= 0, got -1.0"),
    ],
)
def test_bad_faults(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        FrameFaults(**kwargs)
    assert str(err.value).startswith(message)


def test_a_link_latency_needs_lo_le_hi() -> None:
    with pytest.raises(ConfigError, match="latency_s needs 0 <= lo <= hi"):
        FaultyLink(FrameFaults(), random.Random(0), latency_s=(0.5, 0.1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"reorder_s": float("nan")},
            "FrameFaults.reorder_s must be a finite number >= 0, got nan",
        ),
        (
            {"reorder_s": float("inf")},
            "FrameFaults.reorder_s must be a finite number >= 0, got inf",
        ),
        ({"reorder_s": True}, "FrameFaults.reorder_s must be a finite number >= 0, got True"),
        ({"duplicate": "0.1"}, "FrameFaults.duplicate must be a probability in [0, 1], got '0.1'"),
        ({"reorder": float("nan")}, "FrameFaults.reorder must be a probability in [0, 1], got nan"),
    ],
)
def test_every_refusal_is_worded_exactly(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        FrameFaults(**kwargs)  # type: ignore[arg-type]
    assert str(err.value) == message
    assert FrameFaults(drop=1, reorder_s=0).drop == 1


@pytest.mark.parametrize(
    "latency_s", [(0.5, 0.1), (-0.1, 0.1), (0.0, float("inf")), (float("nan"), 1.0)]
)
def test_a_link_latency_must_be_finite(latency_s: tuple[float, float]) -> None:
    with pytest.raises(ConfigError) as err:
        FaultyLink(FrameFaults(), random.Random(0), latency_s=latency_s)
    assert str(err.value) == f"FaultyLink latency_s needs 0 <= lo <= hi, got {latency_s}"
    link = FaultyLink(FrameFaults(), random.Random(0), latency_s=(0, 1))
    assert link.latency_s == (0.0, 1.0) and type(link.latency_s[0]) is float
