"""A decode rank dialling its prefill rank is busy: idle steps wait instead of spinning.

The first pipelined request of a TP 2 decode server behind ``kvplane serve proxy`` lost 15 s:
each rank's first handshake with its prefill rank timed out three times. Until the handshake
was done the rank had no receive in flight, so it said it was not busy and every idle vLLM step
(the request waits for its remote KV) returned at once: the engine core and both rank workers
spun the host's two cores the handshake needed, exactly as before ``wakeup.end_step`` waited
("Threads off the model runner's core", docs/vllm.md). Later requests found the handshake
cached and opened their receive within the step. Here a prefill "endpoint" that never answers
holds both decode ranks in their dial, so the window is as long as the test needs.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from vllm_testlib import vllm_kv_caches

from kvplane.integrations.vllm.messages import RecvOp, StepMeta
from kvplane.integrations.vllm.pd_config import pd_config, pd_settings
from kvplane.integrations.vllm.pd_ranks import rank_settings
from kvplane.integrations.vllm.pd_transport import make_pd_transport
from kvplane.integrations.vllm.pd_worker import PDWorkerSide
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.tp import TPShard
from kvplane.integrations.vllm.wakeup import Wakeup, end_step
from kvplane.metrics import MetricsRegistry

TP = 2
MODEL = "ab" * 16
WAIT_S = 10.0
BLOCKS = (4, 7, 9)


class CountingWakeup(Wakeup):
    """A wake-up that counts the idle waits of :func:`end_step`."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        return super().wait(timeout)


@pytest.fixture
def silent() -> Iterator[list[str]]:
    """Two "prefill rank endpoints" that accept tcp connections and never say a word."""
    socks = []
    for _ in range(TP):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        socks.append(sock)
    yield [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for sock in socks:
        sock.close()


@pytest.fixture
def ranks() -> Iterator[list[PDWorkerSide]]:
    """A TP 2 decode engine's two rank workers; one handshake attempt of 0.5 s."""
    extra = {"pd_transport": "tcp", "pd_insecure": True, "pd_name": "decode-dial",
             "pd_connect_timeout_s": 0.5}  # fmt: skip
    base = pd_settings(pd_config(extra, {}), {})
    assert base is not None
    workers = []
    for r in range(TP):
        settings = rank_settings(base, TPShard(r, TP))
        pool = VllmPool.from_kv_caches(vllm_kv_caches(num_blocks=16, block_size=4, heads=1))
        workers.append(PDWorkerSide(settings, pool, MODEL, MetricsRegistry(),
                                    make_pd_transport(settings), shard=TPShard(r, TP)))  # fmt: skip
    yield workers
    for w in workers:
        w.close()


def test_a_rank_dialling_its_prefill_rank_is_busy_and_its_idle_steps_wait(
    silent: list[str], ranks: list[PDWorkerSide]
) -> None:
    op = RecvOp("d1", "proxy-1", silent[0], "key", 10, 0, BLOCKS, rank_addresses=tuple(silent))
    assert [w.busy for w in ranks] == [False, False]
    for w in ranks:
        w.begin_step(StepMeta(recvs=(op,)))
    assert [w.busy for w in ranks] == [True, True]  # before the fix: [False, False]
    wakes = [CountingWakeup() for _ in ranks]
    for w, wake in zip(ranks, wakes, strict=True):
        assert end_step([w], [], True, wake) == (set(), set())
    assert [wake.waits for wake in wakes] == [1, 1]  # before the fix: [0, 0], a spinning step
    for r, w in enumerate(ranks):  # the attempt times out: the receive fails, all its blocks
        deadline = time.monotonic() + WAIT_S
        while not w.has_news:
            assert time.monotonic() < deadline, f"rank {r}'s dial never ended"
            time.sleep(0.01)
        (got,) = w.take_results()
        why = f"cannot open the receive: handshake with {silent[r]} timed out after 0."
        assert (got.req_id, got.role, got.ok, got.rank) == ("d1", "recv", False, r)
        assert got.reason.startswith(why), got.reason
        assert w.take_load_errors() == set(BLOCKS)
        assert w.finished() == (set(), {"d1"})
    assert [w.busy for w in ranks] == [False, False]
    wakes = [CountingWakeup() for _ in ranks]
    for w, wake in zip(ranks, wakes, strict=True):
        assert end_step([w], [], True, wake) == (set(), set())
    assert [wake.waits for wake in wakes] == [0, 0]  # nothing in flight: no wait


def test_a_refused_requests_abandon_dial_is_busy_until_told(
    silent: list[str], ranks: list[PDWorkerSide]
) -> None:
    """A refused request's "never asking" is a handshake too: busy until it gave up."""
    op = RecvOp("d2", "p9", silent[0], "key", 10, 0, (), "refused", tuple(silent))
    rank = ranks[0]
    rank.begin_step(StepMeta(recvs=(op,)))
    assert rank.busy
    deadline = time.monotonic() + WAIT_S
    while rank.busy:
        assert time.monotonic() < deadline, "the abandon dial never ended"
        time.sleep(0.01)
    assert rank.take_results() == [] and rank.take_load_errors() == set()
