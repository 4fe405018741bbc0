"""A re-pair closes the decode worker's previous PD connection: real workers and sockets.

Issue 27 leftover: every ``PairWith`` dialled a new zmq connection and left the previous one
to the same prefill worker open (and reconnecting for ever once its peer was gone), so a pair
re-paired by the router's healing gathered one more connection per re-pair.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvplane.errors import IncompatiblePeerError
from kvplane.ids import PeerId
from kvplane.serving.dials import Dials
from kvplane.serving.messages import Ack, PairWith
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.synthetic import SyntheticProducer
from kvplane.testing.cluster import MLA, base_config, check_balanced, cluster, prompt, wait_for


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def established_to(port: int) -> int:
    """TCP connections on this host, ESTABLISHED, whose remote end is 127.0.0.1:``port``."""
    n = 0
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            remote, state = fields[2], fields[3]
            if remote == f"0100007F:{port:04X}" and state == "01":
                n += 1
    return n


def test_re_pairing_the_same_prefill_worker_keeps_one_connection() -> None:
    with cluster() as c:
        client = c.router.decode[0].client
        addr = c.prefill.endpoint.address
        port = _port(addr)
        assert established_to(port) == 1  # the router's connect paired them once
        for _ in range(5):
            assert client.call(PairWith(pd_address=addr), timeout_s=5) == Ack(detail="prefill")
        wait_for(lambda: established_to(port) == 1, 5.0, "the old connections closed")
        assert c.decode.dials.closed == 5
        assert c.decode.dials.peers() == {addr: PeerId("prefill")}
        got = c.router.generate("after", prompt(np.random.default_rng(0), 40))
        assert got.state == "success" and got.mismatches == 0
        check_balanced(c.router)


def test_a_prefill_worker_that_moved_leaves_no_connection_to_its_old_address() -> None:
    # the same peer id answers at a new address (restarted elsewhere: a newer incarnation);
    # the connection to the old address is closed once the new handshake names the peer
    with cluster() as c:
        old = c.prefill.endpoint.address
        moved = PrefillWorker(base_config(name="prefill"), SyntheticProducer(MLA))
        moved.start()
        try:
            new = moved.endpoint.address
            got = c.router.decode[0].client.call(PairWith(pd_address=new), timeout_s=5)
            assert got == Ack(detail="prefill")
            wait_for(lambda: established_to(_port(old)) == 0, 5.0, "the old address closed")
            assert established_to(_port(new)) == 1
            assert c.decode.dials.peers() == {new: PeerId("prefill")}
        finally:
            moved.close()


def test_dials_to_one_address_run_one_at_a_time_and_a_failure_leaves_it_unpaired() -> None:
    events: list[str] = []
    inside = threading.Event()

    def connect(address: str, timeout_s: float) -> PeerId:
        events.append(f"dial {address}")
        if address == "bad":
            raise IncompatiblePeerError("peer bad is incompatible")
        inside.set()
        time.sleep(0.1)
        events.append(f"done {address}")
        return PeerId("p")

    d = Dials(connect, lambda a: events.append(f"close {a}"))
    t = threading.Thread(target=d.pair, args=("a", 1.0))
    t.start()
    inside.wait(5.0)
    assert d.pair("a", 1.0) == "p"  # waits for the first pairing with "a" to end
    t.join()
    assert events == ["close a", "dial a", "done a", "close a", "dial a", "done a"]
    assert d.closed == 1 and d.peers() == {"a": "p"}
    assert d.pair("b", 1.0) == "p"  # the same peer elsewhere: "a" is closed after the dial
    assert events[-4:] == ["close b", "dial b", "done b", "close a"]
    assert d.closed == 2 and d.peers() == {"b": "p"}
    with pytest.raises(IncompatiblePeerError):
        d.pair("bad", 1.0)
    assert d.peers() == {"b": "p"} and not d._turns
