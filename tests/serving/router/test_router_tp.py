"""A TP-aware router: decode ranks are paired with, and served by, only the prefill ranks whose
KV heads cover theirs (GQA across TP degrees); a decode rank no prefill rank covers is reported,
not re-paired, and gets no request; each decode rank's requests are spread evenly over the
prefill ranks covering it; a request nothing can serve is refused before any order."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack

import numpy as np
import pytest

from kvplane.errors import ProtocolError
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import WorkerStats
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer, SyntheticSpec
from kvplane.serving.router.router import Router
from kvplane.testing.cluster import (
    GQA,
    MLA,
    TEST_SECRET,
    base_config,
    check_balanced,
    free_port,
    idle,
    prompt,
)

Heads = tuple[int, int]


def _prefill(name: str, heads: Heads, spec: SyntheticSpec = GQA, **kw: object) -> PrefillWorker:
    w = PrefillWorker(base_config(name=name, head_range=heads, **kw), SyntheticProducer(spec))
    w.start()
    return w


def _decode(name: str, heads: Heads, spec: SyntheticSpec = GQA) -> DecodeWorker:
    w = DecodeWorker(base_config(name=name, head_range=heads), SyntheticDecoder(spec))
    w.start()
    return w


def _router(stack: ExitStack, prefill: list[PrefillWorker], decode: list[DecodeWorker]) -> Router:
    """A router over ``prefill`` and ``decode``; every one of them and it closed by ``stack``."""
    for w in (*prefill, *decode):
        stack.callback(w.close)
    r = Router(
        [w.address for w in prefill], [w.address for w in decode], timeout_s=20.0,
        secret=TEST_SECRET,
    )  # fmt: skip
    stack.callback(r.close)
    return r


def _peers(w: PrefillWorker | DecodeWorker) -> list[str]:
    """A worker's live PD peers (read on its PD loop)."""
    part = w.participant
    return w.endpoint.call(lambda: sorted(str(x) for x in part.peers.live_peers()))


def _served(stats: dict[str, WorkerStats], name: str, role: str) -> int:
    return stats[name].counters.get(f"session_finished_{role}_success", 0)


def _balanced_up(r: Router) -> dict[str, WorkerStats]:
    """:func:`check_balanced` over the workers up (one address in the test has no worker)."""
    end = time.monotonic() + 10.0
    while True:
        stats, _ = r.gather_stats()
        if all(idle(s) for s in stats.values()) or time.monotonic() > end:
            break
        time.sleep(0.02)
    assert all(idle(s) and s.integrity == "" for s in stats.values()), stats
    return stats


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def test_a_2x2_tp_cluster_pairs_only_covering_ranks_and_serves_every_request(
    stack: ExitStack,
) -> None:
    p0, p1 = _prefill("p0", (0, 2)), _prefill("p1", (2, 4))
    d0, d1 = _decode("d0", (0, 2)), _decode("d1", (2, 4))
    r = _router(stack, [p0, p1], [d0, d1])
    r.connect()  # the mismatched pairs are never asked: not errors
    assert not any(w.repair for w in r.workers) and r.ready()
    assert (_peers(d0), _peers(d1)) == (["p0"], ["p1"])
    assert [w.info.head_ranges for w in r.workers if w.info] == [
        ((0, 2), (0, 1)),
        ((2, 4), (0, 1)),
        ((0, 2), (0, 1)),
        ((2, 4), (0, 1)),
    ]
    rng = np.random.default_rng(5)
    futs = [r.submit(f"q{i}", prompt(rng, 20 + 7 * i)) for i in range(8)]
    for f in futs:
        res = f.result(timeout=20)
        assert (res.state, res.mismatches) == ("success", 0), res.reason
    stats = check_balanced(r)
    # every session ran on a covering pair: each prefill rank served its own decode rank only
    assert [_served(stats, n, "sender") for n in ("p0", "p1")] == [4, 4]
    assert [_served(stats, n, "receiver") for n in ("d0", "d1")] == [4, 4]
    assert r.refresh() == []  # nothing changed: nothing re-paired, nothing reported


def test_each_decode_rank_spreads_its_requests_over_every_prefill_rank_covering_it(
    stack: ExitStack,
) -> None:
    # p0 holds every head, p1 only d0's: d0 is served by both, d1 by p0 alone; the prefill rank
    # follows each decode rank's own round-robin (it used to follow the request number, so p0
    # took every request)
    p0, p1 = _prefill("p0", (0, 4)), _prefill("p1", (0, 2))
    d0, d1 = _decode("d0", (0, 2)), _decode("d1", (2, 4))
    r = _router(stack, [p0, p1], [d0, d1])
    r.connect()
    assert (_peers(d0), _peers(d1)) == (["p0", "p1"], ["p0"])
    rng = np.random.default_rng(7)
    for i in range(8):  # d0: p0, p1, p0, p1; d1: p0 x4
        res = r.generate(f"q{i}", prompt(rng, 20 + 5 * i))
        assert (res.state, res.mismatches) == ("success", 0), res.reason
    stats = check_balanced(r)
    assert [_served(stats, n, "receiver") for n in ("d0", "d1")] == [4, 4]
    assert [_served(stats, n, "sender") for n in ("p0", "p1")] == [6, 2]
    assert r.flights_live == 0


def test_a_decode_rank_no_prefill_covers_is_reported_once_skipped_and_mended(
    stack: ExitStack,
) -> None:
    port = free_port()
    wide, p_late = _prefill("wide", (0, 2)), f"tcp://127.0.0.1:{port}"
    d0, d1 = _decode("d0", (0, 2)), _decode("d1", (2, 4))
    for w in (wide, d0, d1):
        stack.callback(w.close)
    r = Router(
        [wide.address, p_late], [d0.address, d1.address], timeout_s=20.0, probe_s=0.5,
        secret=TEST_SECRET,
    )  # fmt: skip
    stack.callback(r.close)
    why = (
        f"decode worker at {d1.address} (KV heads per pool ((2, 4), (0, 1))) cannot pair: no "
        "prefill worker up holds all its KV heads (one sender per session); prefill workers "
        f"up: {wide.address} (KV heads per pool ((0, 2), (0, 1)))"
    )
    with pytest.raises(ProtocolError, match=re.escape(why)) as err:
        r.connect()
    assert "d0" not in str(err.value) and d0.address not in str(err.value)
    assert not r.decode[1].repair and r.decode[1].uncovered and r.ready()
    assert (_peers(d0), _peers(d1)) == (["wide"], [])
    assert r.refresh() == []  # reported once: not again at every refresh, not re-paired
    for i in range(4):  # d1 is skipped: every request goes to the covered decode rank
        assert r.generate(f"a{i}", list(range(10 + i))).state == "success"
    stats = _balanced_up(r)
    assert [_served(stats, n, "receiver") for n in ("d0", "d1")] == [4, 0]
    late = _prefill("late", (2, 4), control_bind=p_late)  # a covering rank comes up
    stack.callback(late.close)
    assert "late" in r.refresh()  # paired with the rank it covers only: d1 is covered again
    assert not r.decode[1].uncovered and (_peers(d0), _peers(d1)) == (["wide"], ["late"])
    for i in range(4):
        assert r.generate(f"b{i}", list(range(10 + i))).state == "success"
    stats = _balanced_up(r)
    assert [_served(stats, n, "receiver") for n in ("d0", "d1")] == [6, 2]
    assert [_served(stats, n, "sender") for n in ("wide", "late")] == [6, 2]
    late.close()  # d1 is uncovered again: reported at the refresh that sees it
    with pytest.raises(ProtocolError, match=re.escape(f"decode worker at {d1.address}")):
        r.refresh()
    assert r.refresh() == []


def test_a_request_nothing_can_serve_is_refused_before_any_order(stack: ExitStack) -> None:
    p, d = _prefill("p", (0, 2)), _decode("d", (1, 3))
    r = _router(stack, [p], [d])
    with pytest.raises(ProtocolError, match=re.escape("(1, 3)")):
        r.connect()
    assert not r.ready() and not r.decode[0].repair
    msg = (
        "no prefill worker up holds all the KV heads of a decode worker up (one sender per "
        f"session): decode {d.address} (KV heads per pool ((1, 3), (0, 1))); prefill "
        f"{p.address} (KV heads per pool ((0, 2), (0, 1)))"
    )
    with pytest.raises(ProtocolError, match=re.escape(msg)):
        r.submit("x", [1, 2, 3])
    assert r.flights_live == 0 and "x" not in p._requests and "x" not in d._requests
    assert _peers(p) == _peers(d) == []


def test_full_head_and_mla_workers_pair_all_with_all_as_before(stack: ExitStack) -> None:
    for spec, heads in ((GQA, (0, 4)), (MLA, (0, 1))):
        ps = [_prefill(f"p{i}{spec.kind}", heads, spec) for i in range(2)]
        ds = [_decode(f"d{i}{spec.kind}", heads, spec) for i in range(2)]
        r = _router(stack, ps, ds)
        r.connect()
        assert [_peers(d) for d in ds] == [sorted(p.config.name for p in ps)] * 2
        for i in range(4):
            assert r.generate(f"{spec.kind}{i}", list(range(30))).state == "success"
        stats = check_balanced(r)
        # request n on decode n % 2, then that decode worker's own round-robin: every pair once
        assert [_served(stats, p.config.name, "sender") for p in ps] == [2, 2]
        assert [_served(stats, d.config.name, "receiver") for d in ds] == [2, 2]
