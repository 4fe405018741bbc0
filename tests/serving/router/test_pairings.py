"""The pairing table: a refused pairing is tried again with the backoff of a lost one (at once,
then 1 s doubling to 30 s), counted on the router's ``/metrics``; records are per incarnation."""

from __future__ import annotations

import time
from dataclasses import replace

import msgspec
import pytest

from kvplane.errors import InvalidArgumentError, ProtocolError
from kvplane.metrics import MetricsRegistry
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import WorkerInfo
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer
from kvplane.serving.router.healing import RepairBackoff
from kvplane.serving.router.observe import RouterMetrics
from kvplane.serving.router.pairings import Pairing, PairTable, Report
from kvplane.serving.router.router import Router
from kvplane.testing.cluster import MLA, TEST_SECRET, base_config


def _dials(d: DecodeWorker) -> int:
    """Handshakes the decode worker began that the prefill worker refused."""
    return d.endpoint.snapshot().get("handshakes_refused", 0)


def test_a_refused_pairing_is_retried_with_backoff_and_counted() -> None:
    # real workers whose handshake refuses: the prefill worker has 3 layers, the decode 2.
    # Every refresh re-paired a refused pair at once, however often it was refused.
    p = PrefillWorker(base_config(name="p"), SyntheticProducer(replace(MLA, num_layers=3)))
    d = DecodeWorker(base_config(name="d"), SyntheticDecoder(MLA))
    p.start()
    d.start()
    r = Router([p.address], [d.address], timeout_s=5.0, probe_s=2.0, secret=TEST_SECRET)
    reg = r.metrics
    try:
        with pytest.raises(ProtocolError, match=r"cannot pair: pairing with .* failed"):
            r.connect()
        assert _dials(d) == 1 and r.decode[0].repair
        with pytest.raises(ProtocolError, match="cannot pair"):
            r.refresh()  # the first try again goes at once
        assert _dials(d) == 2
        assert reg.value("router_repairs", {"cause": "refused"}, "_total") == 1.0
        for _ in range(3):  # within the 1 s backoff: not asked, not an error
            assert r.refresh() == []
        assert _dials(d) == 2 and reg.value("router_pairs_backing_off") == 1.0
        time.sleep(1.1)
        with pytest.raises(ProtocolError, match="cannot pair"):
            r.refresh()
        assert _dials(d) == 3
        assert reg.value("router_repairs", {"cause": "refused"}, "_total") == 2.0
        assert reg.value("router_repairs", {"cause": "lost"}, "_total") == 0.0
        assert r.refresh() == [] and _dials(d) == 3  # the second wait is 2 s
        assert not r.ready()
    finally:
        r.close()
        d.close()
        p.close()


def _info(role: str, incarnation: int, peers: tuple[str, ...] | None) -> WorkerInfo:
    return WorkerInfo(
        role=role, peer_id=role, pd_address="tcp://127.0.0.1:1", incarnation=incarnation,
        transport="tcp", peers=peers,
    )  # fmt: skip


def test_refused_and_lost_pairs_share_one_backoff_reset_only_when_seen_paired() -> None:
    t: PairTable[str] = PairTable(RepairBackoff(first_s=1.0, max_s=4.0))
    incs = (1, 1)
    t.record("k", incs, Pairing.REFUSED, at=0.0)
    assert t.state("k", incs) is Pairing.REFUSED and t.state("k", (2, 1)) is None
    assert t.retry("k", incs, 0.0) is Pairing.REFUSED  # at once
    assert t.retry("k", incs, 0.5) is None and t.waiting(0.5) == 1
    assert t.retry("k", incs, 1.0) is Pairing.REFUSED  # after 1 s
    assert t.retry("k", incs, 2.5) is None and t.retry("k", incs, 3.0) is Pairing.REFUSED
    t.record("k", incs, Pairing.ACCEPTED, at=3.0)  # an Ack alone does not reset the count
    assert t.tries("k") == 3 and t.retry("k", incs, 3.0) is None  # accepted: nothing to retry
    d, p = _info("decode", 1, ("prefill",)), _info("prefill", 1, ())
    reports = [Report("d", 4.0, d, p), Report("p", 4.0, p, d)]
    assert t.judge("k", incs, reports, now=4.0) == "p has no live PD connection to 'decode'"
    assert t.state("k", incs) is Pairing.LOST
    assert t.retry("k", incs, 4.5) is None  # the 4th try waits 4 s (the cap) after the 3rd
    assert t.retry("k", incs, 7.0) is Pairing.LOST and t.tries("k") == 4
    paired = [
        Report("d", 8.0, d, msgspec.structs.replace(p, peers=None)),
        Report("p", 8.0, msgspec.structs.replace(p, peers=("decode",)), d),
    ]
    assert t.judge("k", incs, paired, now=8.0) == ""
    assert t.state("k", incs) is Pairing.ACCEPTED and t.tries("k") == 0 and t.waiting(8.0) == 0
    t.forget(lambda k: k == "k")
    assert t.state("k", incs) is None


def test_a_re_pair_cause_that_is_not_lost_or_refused_is_a_bug() -> None:
    rm = RouterMetrics(MetricsRegistry(), flights=lambda: 0, workers=lambda: (0, 0))
    with pytest.raises(InvalidArgumentError, match="re-pair cause"):
        rm.retried("pending")
