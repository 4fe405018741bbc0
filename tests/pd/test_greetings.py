"""Greetings: one slot per peer id and per connection, never evicting another peer id's, bounded
in number and age; and the bounded memory of recent Hello nonces."""

from __future__ import annotations

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.pd.association import associate
from kvplane.pd.events import Hello
from kvplane.pd.greetings import Greetings
from kvplane.pd.handshake import compat_fingerprint
from kvplane.testing.session_pair import sim_profile

PROFILE = sim_profile()


def hello(peer: str, nonce: bytes = b"i" * 16) -> Hello:
    return Hello(peer_id=peer, incarnation=1, profile=PROFILE,
                 fingerprint=compat_fingerprint(PROFILE), nonce=nonce)  # fmt: skip


def add(g: Greetings, conn: bytes, peer: str, now: float = 0.0) -> bool:
    h = hello(peer)
    return g.add(conn, h, b"r" * 16, associate(None, h, b"r" * 16, we_initiated=False), now)


def test_a_full_table_turns_newcomers_away_and_never_evicts() -> None:
    """The 33rd Hello used to evict the oldest greeting (a genuine handshake in progress)."""
    g = Greetings(capacity=3, timeout_s=10.0)
    assert [add(g, b"c%d" % i, f"p{i}") for i in range(5)] == [True, True, True, False, False]
    assert len(g) == 3 and g.turned_away == 2
    assert [g.get(b"c%d" % i) is not None for i in range(5)] == [True] * 3 + [False] * 2
    assert g.has_room(b"c0", "p9", 1.0)  # c0's slot is replaced by its next Hello
    assert g.has_room(b"c9", "p1", 1.0)  # p1's slot is replaced, whatever the connection
    assert not g.has_room(b"c9", "p9", 1.0)


def test_one_slot_per_peer_id_and_per_connection() -> None:
    g = Greetings(capacity=4)
    assert add(g, b"a", "decode") and add(g, b"b", "decode")  # same peer id: replaced
    assert g.get(b"a") is None and g.get(b"b") is not None and len(g) == 1
    assert add(g, b"b", "other")  # same connection, another peer id: replaced too
    assert len(g) == 1 and g.replaced == 1 and b"b" in g and b"a" not in g
    greeting = g.pop(b"b")
    assert greeting is not None and greeting.hello.peer_id == "other" and len(g) == 0


def test_greetings_expire_in_order() -> None:
    g = Greetings(capacity=2, timeout_s=10.0)
    add(g, b"a", "p1", 0.0)
    add(g, b"b", "p2", 5.0)
    assert not g.has_room(b"c", "p3", 9.9)
    assert g.has_room(b"c", "p3", 10.0) and g.expired == 1 and g.get(b"a") is None
    g.expire(15.0)
    assert len(g) == 0 and g.expired == 2


def test_a_repeated_nonce_is_a_replay_within_the_memory_bound() -> None:
    g = Greetings(seen_nonces=2)
    assert [g.replayed(n) for n in (b"x" * 16, b"y" * 16, b"x" * 16)] == [False, False, True]
    assert not g.replayed(b"z" * 16)  # x is now the oldest of three: forgotten
    assert not g.replayed(b"x" * 16) and g.replayed(b"z" * 16)
    assert not g.replayed(b"") and not g.replayed(b"")  # no nonce: refused elsewhere
    with pytest.raises(InvalidArgumentError):
        Greetings(capacity=0)
