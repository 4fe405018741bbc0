"""A PD pair that loses its connection while neither process restarts heals: real ``kvplane
serve`` processes, a router process, and a pair broken by a pause, a replayed ``Hello`` or a
second process that shakes hands as the prefill worker. One deployment serves the module; each
test leaves it whole (checked after each) and counts handshakes from its own start."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import pytest

from kvplane.ids import PeerId
from kvplane.pd.endpoint import ControlClient
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.messages import Generate, RequestResult, StatsQuery, WorkerStats
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer
from kvplane.serving.rpc import RpcClient
from kvplane.testing.cluster import (
    MLA,
    TEST_SECRET,
    Proc,
    base_config,
    free_port,
)

LEASE = 0.6
"""The workers' PD lease (s): a break is noticed this long after it."""
REFRESH = 0.5
"""The router's refresh period (s); its probe is 2 s (``Router``'s default)."""
HEAL_S = 10.0
"""The bound: requests succeed again within this long of the break's end (lease + refresh +
two probes is under 5 s; the rest is slack for a loaded machine)."""
TIMING = ["--heartbeat", "0.1", "--lease", str(LEASE), "--in-doubt", "0.2", "--drain", "0.5"]
TIMING += ["--retransmit", "0.05", "--deadline", "4"]
SHAPE = ["--layout", "mla", "--layers", "2", "--latent-dim", "32", "--rope-dim", "16"]


def _worker(name: str) -> Proc:
    args = ["--name", name, "--control", f"tcp://127.0.0.1:{free_port()}"]
    args += ["--pd", f"tcp://127.0.0.1:{free_port()}", *SHAPE, *TIMING, "--num-blocks", "128"]
    return Proc(name, args)


def _client(address: str) -> RpcClient:
    return RpcClient(address, timeout_s=15.0, secret=TEST_SECRET)


@pytest.fixture(scope="module")
def shared(
    start_procs: Callable[..., list[Proc]], stop_procs: Callable[[Sequence[Proc]], None]
) -> Iterator[tuple[Proc, Proc, RpcClient]]:
    """One deployment for the module (the two workers start at once, then the router): each
    test breaks its pair and proves it heals; :func:`deployment` checks it was left whole."""
    started: list[Proc] = []
    client = None
    try:
        pre, dec = start_procs(started, partial(_worker, "prefill"), partial(_worker, "decode"))
        flags = ["--timeout", "5", "--refresh", str(REFRESH), "--request-deadline", "20"]
        rt = Proc("router", ["--prefill", pre.control, "--decode", dec.control, *flags])
        started.append(rt)
        client = _client(rt.control)
        assert _generate(client, "warm").state == "success"
        yield pre, dec, client
    finally:
        if client is not None:
            client.close()
        for p in started:
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)  # a test that failed mid-pause
        stop_procs(started)


@pytest.fixture
def deployment(
    shared: tuple[Proc, Proc, RpcClient],
) -> Iterator[tuple[Proc, Proc, RpcClient]]:
    """The module's deployment, whole before the test (a request served, every process up)
    and after it: every process still up, a request served again and both workers' integrity
    checks passing. (Not "holding nothing": after a paused prefill worker resumes, it may keep
    one session live past the test; the per-test deployments never looked.)"""
    pre, dec, client = shared
    yield shared
    for p in (pre, dec):
        os.kill(p.proc.pid, signal.SIGCONT)  # a test that failed mid-pause
    assert all(p.proc.poll() is None for p in (pre, dec)), "a worker exited"
    _until_served(client, HEAL_S)
    for p in (pre, dec):
        c = _client(p.control)
        try:
            stats = c.call(StatsQuery())
        finally:
            c.close()
        assert isinstance(stats, WorkerStats) and stats.integrity == "", stats


def _generate(client: RpcClient, request_id: str) -> RequestResult:
    got = client.call(Generate(request_id=request_id, token_ids=tuple(range(40))))
    if isinstance(got, RequestResult):
        return got
    return RequestResult(request_id=request_id, state="refused", reason=str(got))


def _until_served(client: RpcClient, bound_s: float) -> tuple[float, list[str]]:
    """Send requests until one succeeds: seconds it took, and why the earlier ones failed
    (AssertionError naming them after ``bound_s``)."""
    start, failures = time.monotonic(), list[str]()
    while time.monotonic() - start < bound_s:
        got = _generate(client, f"after{len(failures)}")
        if got.state == "success" and got.mismatches == 0:
            return time.monotonic() - start, failures
        failures.append(f"{got.state}: {got.reason}"[:200])
        time.sleep(0.1)
    raise AssertionError(f"no request served within {bound_s} s: {failures[-3:]}")


def _handshakes(control: str) -> int:
    c = _client(control)
    try:
        stats = c.call(StatsQuery())
        assert isinstance(stats, WorkerStats)
        return stats.counters.get("handshakes_completed", 0)
    finally:
        c.close()


@pytest.mark.parametrize("paused", ["decode", "prefill"])
def test_a_worker_paused_past_its_lease_but_not_its_probe_is_re_paired(
    deployment: tuple[Proc, Proc, RpcClient], paused: str
) -> None:
    pre, dec, client = deployment
    before = _handshakes(dec.control)
    victim = dec if paused == "decode" else pre
    os.kill(victim.proc.pid, signal.SIGSTOP)
    time.sleep(2 * LEASE)  # the peer's lease on it runs out; the router's 2 s probe does not
    os.kill(victim.proc.pid, signal.SIGCONT)
    took, failures = _until_served(client, HEAL_S)
    assert took < HEAL_S, failures
    assert _handshakes(dec.control) > before  # re-paired: the decode worker shook hands again


def test_a_replayed_hello_of_the_prefill_worker_breaks_nothing_for_long(
    deployment: tuple[Proc, Proc, RpcClient],
) -> None:
    # a process with the cluster's secret learns the prefill worker's own Hello by pairing
    # with it, then replays that Hello to the decode worker's PD endpoint. Without handshake
    # freshness the decode worker moved its route to the replayer and the pair stayed broken;
    # with it the replay is refused. Either way requests recover within the bound.
    pre, dec, client = deployment
    spy = DecodeWorker(base_config(name="spy"), SyntheticDecoder(MLA))
    spy.start()
    try:
        spy.pair(str(pre.info["pd"]))
        rec = spy.endpoint.call(lambda: spy.participant.peers.get(PeerId("prefill")))
        assert rec is not None
        hello = rec.hello
    finally:
        spy.close()
    replayer = ControlClient(str(dec.info["pd"]), secret=TEST_SECRET)
    try:
        replayer.send(hello)
        time.sleep(2 * LEASE)  # both sides' leases on each other run out
        took, failures = _until_served(client, HEAL_S)
        assert took < HEAL_S, failures
    finally:
        replayer.close()


def test_a_twin_of_the_prefill_worker_breaks_the_pair_for_a_bounded_time(
    deployment: tuple[Proc, Proc, RpcClient],
) -> None:
    # a process with the cluster's secret shakes hands with the decode worker as the prefill
    # worker (same peer id, incarnation and profile: a copy started by mistake, or a forger),
    # then goes: the decode worker took it for the same process and moved its route to it
    pre, dec, client = deployment
    before = _handshakes(dec.control)
    incarnation = int(str(pre.info["incarnation"]))
    twin = PrefillWorker(
        base_config(name="prefill", incarnation=incarnation), SyntheticProducer(MLA)
    )
    twin.start()
    try:
        twin.endpoint.connect(str(dec.info["pd"]))
    finally:
        twin.close()
    time.sleep(2 * LEASE)  # both sides' leases on each other run out
    took, failures = _until_served(client, HEAL_S)
    assert took < HEAL_S, failures
    assert _handshakes(dec.control) > before  # broken, then re-paired: the decode worker dialled
