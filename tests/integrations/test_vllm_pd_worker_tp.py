"""PD at TP 2 without engines: two engines of two rank workers each, in one process.

Each engine is one :class:`PDScheduler` (``tp_size=2``) and two :class:`PDWorkerSide` ranks with
their own vLLM-shaped KV buffers; the test plays vLLM: it broadcasts each step's instructions to
both ranks, "computes" each rank's blocks (bytes that differ per rank: its own heads), merges
the ranks' reports and counts each request's finished reports until both ranks named it, as
vLLM's ``KVOutputAggregator`` does. Decode rank r must hold exactly prefill rank r's bytes, over
``tcp``, ``nixl`` and ``mooncake`` (each rank worker its own transport, as in its own process).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
from vllm_testlib import block_content, vllm_kv_caches

from kvplane.ids import SessionId
from kvplane.integrations.vllm.messages import PDResult, RecvOp, StepMeta
from kvplane.integrations.vllm.pd_config import pd_config, pd_settings
from kvplane.integrations.vllm.pd_params import RecvParams, SendParams, parse_params, prompt_key
from kvplane.integrations.vllm.pd_ranks import rank_session, rank_settings
from kvplane.integrations.vllm.pd_scheduler import PDRequest, PDScheduler
from kvplane.integrations.vllm.pd_transport import make_pd_transport
from kvplane.integrations.vllm.pd_worker import PDWorkerSide
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.tp import TPShard
from kvplane.integrations.vllm.wakeup import end_step
from kvplane.metrics import MetricsRegistry
from kvplane.transports.registry import available

BS, TP = 4, 2
PROMPT = list(range(300, 310))  # 10 tokens: 9 move, as 3 whole blocks
MODEL = "cd" * 16
WAIT_S = 10.0
SRC, DST = [3, 5, 6], [9, 2, 11]


@dataclass
class Engine:
    """One TP 2 engine's PD halves: one scheduler side, a worker side per rank."""

    name: str
    extra: dict[str, object] = field(default_factory=dict)
    tp: int = TP
    pools: list[VllmPool] = field(init=False)
    workers: list[PDWorkerSide] = field(init=False)
    sched: PDScheduler = field(init=False)
    metrics: MetricsRegistry = field(init=False)
    results: list[PDResult] = field(default_factory=list)
    closed: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        extra = {"pd_transport": "tcp", "pd_insecure": True, "pd_name": self.name, **self.extra}
        base = pd_settings(pd_config(extra, {}), {})
        assert base is not None
        self.pools, self.workers = [], []
        for r in range(self.tp):
            shard = TPShard(r, self.tp)
            settings = rank_settings(base, shard)
            heads = 2 * TP // self.tp  # the engine's 4 KV heads over its ranks
            kv = vllm_kv_caches(num_blocks=16, block_size=BS, heads=heads)
            pool = VllmPool.from_kv_caches(kv)
            worker = PDWorkerSide(
                settings, pool, MODEL, MetricsRegistry(), make_pd_transport(settings), shard=shard
            )
            self.pools.append(pool)
            self.workers.append(worker)
        self.metrics = MetricsRegistry()
        self.sched = PDScheduler(BS, self.metrics, tp_size=self.tp)
        self.sched.set_endpoint([w.address for w in self.workers], self.workers[0].engine_id)

    def blocks(self, rank: int) -> torch.Tensor:
        pool = self.pools[rank]
        return pool.layout.canonical_view(pool.tensor)

    def live(self) -> list[PDWorkerSide]:
        return [w for r, w in enumerate(self.workers) if r not in self.closed]

    def step(self, compute: Callable[[], None] = lambda: None) -> StepMeta:
        """One step: the same instructions to every rank, the ranks' reports merged."""
        meta = self.sched.build().into(StepMeta())
        for w in self.live():
            w.begin_step(meta)
        compute()
        got: list[PDResult] = []
        for w in self.live():
            w.after_forward(meta)
            got += w.take_results()
        self.results += got
        self.sched.apply(got)
        return meta

    def close(self, rank: int | None = None) -> None:
        for r in range(self.tp) if rank is None else [rank]:
            if r not in self.closed:
                self.closed.add(r)
                self.workers[r].close()


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    prefill, decode = Engine("prefill", {"pd_pull_timeout_s": 1.0}), Engine("decode")
    yield prefill, decode
    prefill.close()
    decode.close()


@pytest.fixture(params=["tcp", "nixl", "mooncake"])
def paired(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine]]:
    """A prefill and a decode engine whose rank workers move KV over the param's transport."""
    transport = str(request.param)
    if (why := available()[transport]) is not None:
        pytest.skip(why)
    extra = {"pd_transport": transport}
    prefill = Engine(f"prefill-{transport}", {**extra, "pd_pull_timeout_s": 1.0})
    decode = Engine(f"decode-{transport}", extra)
    yield prefill, decode
    prefill.close()
    decode.close()


def fill(eng: Engine, blocks: list[int], first: int) -> None:
    """Computes prompt blocks ``first ..`` on every rank: bytes that differ per rank."""
    for r in range(TP):
        view = eng.blocks(r)
        for i in range(first, len(blocks)):
            view[blocks[i]] = block_content([r, *PROMPT], i, BS, tuple(view.shape[1:]))


def prefill_steps(eng: Engine, req: PDRequest, chunk: int) -> dict[str, object]:
    end = 0
    while end < len(req.prompt):
        start, end = end, min(len(req.prompt), end + chunk)
        table = SRC[: -(-end // BS)]
        eng.sched.scheduled(req, end, table)
        eng.step(lambda s=start, t=table: fill(eng, t, s // BS))  # type: ignore[misc]
    done, params = eng.sched.finished(req, req.req_id)
    assert done and params is not None
    eng.step()
    return params


def start_recv(eng: Engine, req: PDRequest) -> None:
    assert eng.sched.matched(req, 0) == (len(PROMPT) - 1, True)
    eng.sched.allocated(req, DST, len(PROMPT) - 1)
    assert len(eng.step().recvs) == 1


def settle(prefill: Engine, decode: Engine, with_send: bool = True) -> set[int]:
    """Step both engines until vLLM would count "p1" finished sending and "d1" finished
    receiving on both ranks; returns the union of the decode ranks' load errors."""
    sent: Counter[str] = Counter()
    got: Counter[str] = Counter()
    finished = ["p1"]
    errors: set[int] = set()
    deadline = time.monotonic() + WAIT_S
    while (with_send and sent["p1"] < TP) or got["d1"] < TP:
        assert time.monotonic() < deadline, f"not settled: sent {sent}, received {got}"
        for w in prefill.live():
            sent.update(end_step([w], finished, False, w.wake)[0])
        finished = []
        for w in decode.live():
            got.update(end_step([w], [], False, w.wake)[1])
            errors |= w.take_load_errors()
        prefill.step()
        decode.step()
        time.sleep(0.005)
    assert max(sent.values(), default=0) <= TP and max(got.values()) == TP, "reported twice"
    return errors


def wait_sessions(prefill: Engine, sid: str) -> None:
    """Until both prefill ranks know session ``sid`` (the decode ranks' requests arrived)."""
    for r, w in enumerate(prefill.workers):
        deadline = time.monotonic() + WAIT_S
        rsid = rank_session(sid, r)  # "<sid>.rank1" on rank 1
        while w.endpoint.call(functools.partial(w.participant.session, rsid)) is None:
            assert time.monotonic() < deadline, "a decode rank's request never arrived"
            time.sleep(0.005)


def check_copied(prefill: Engine, decode: Engine) -> None:
    for r in range(TP):
        want = prefill.blocks(r)[SRC].contiguous().view(torch.uint8)
        assert torch.equal(decode.blocks(r)[DST].contiguous().view(torch.uint8), want), r
    other = prefill.blocks(1)[SRC].contiguous().view(torch.uint8)
    assert not torch.equal(decode.blocks(0)[DST].contiguous().view(torch.uint8), other)


def check_clean(prefill: Engine, decode: Engine) -> None:
    assert not any(w.busy for w in prefill.live() + decode.live())
    prefill.sched.check_integrity()
    decode.sched.check_integrity()


def test_pull_moves_each_ranks_shard_to_the_same_rank(paired: tuple[Engine, Engine]) -> None:
    prefill, decode = paired
    params = prefill_steps(prefill, PDRequest("p1", PROMPT, SendParams(None)), chunk=4)
    recv = parse_params(params)
    addresses = tuple(w.address for w in prefill.workers)
    assert recv == RecvParams("p1", addresses[0], 10, prompt_key(PROMPT), addresses)
    assert isinstance(recv, RecvParams)
    start_recv(decode, PDRequest("d1", PROMPT, recv))
    assert settle(prefill, decode) == set()
    check_copied(prefill, decode)
    assert sorted((r.rank, r.ok) for r in prefill.results) == [(0, True), (1, True)]
    assert sorted((r.rank, r.reason) for r in decode.results) == [(0, "success"), (1, "success")]
    check_clean(prefill, decode)


def test_pipelined_receives_open_on_both_prefill_ranks_before_the_prefill(
    paired: tuple[Engine, Engine],
) -> None:
    prefill, decode = paired
    addresses = tuple(w.address for w in prefill.workers)
    recv = RecvParams("proxy-1", addresses[0], 10, prompt_key(PROMPT), addresses)
    start_recv(decode, PDRequest("d1", PROMPT, recv))
    wait_sessions(prefill, "proxy-1")
    params = prefill_steps(prefill, PDRequest("p1", PROMPT, SendParams("proxy-1")), chunk=3)
    assert parse_params(params) == recv
    assert settle(prefill, decode) == set()
    check_copied(prefill, decode)
    check_clean(prefill, decode)


def test_ranks_wired_across_are_refused_at_the_handshake_by_their_head_ranges(
    engines: tuple[Engine, Engine],
) -> None:
    """Decode rank 0 is sent to prefill rank 1 and rank 1 to rank 0: every handshake is
    refused (the sender's heads do not cover the receiver's), nothing is written, every block
    is a load error, and the unclaimed sends are freed at the pull timeout."""
    prefill, decode = engines
    prefill_steps(prefill, PDRequest("p1", PROMPT, SendParams(None)), chunk=4)
    a0, a1 = (w.address for w in prefill.workers)
    start_recv(decode, PDRequest("d1", PROMPT, RecvParams("p1", a1, 10, None, (a1, a0))))
    assert settle(prefill, decode) == set(DST)
    assert not any(decode.blocks(r)[DST].any() for r in range(TP)), "KV was written"
    why = (
        "cannot open the receive: the PD peer's rank holds KV heads {} of 4, this rank {}: "
        "rank r pairs only with rank r"
    )
    assert sorted((r.rank, r.ok, r.reason) for r in decode.results) == [
        (0, False, why.format("[2, 4)", "[0, 2)")),
        (1, False, why.format("[0, 2)", "[2, 4)")),
    ]
    assert [r.reason for r in prefill.results] == ["no decode engine asked for it in time"] * 2
    assert decode.sched.build().ends == []  # both failed on their own: nothing left to end
    check_clean(prefill, decode)


def test_a_rank_that_loses_its_prefill_rank_fails_the_request_on_every_rank() -> None:
    """Prefill rank 1 dies while both decode ranks wait for the prefill (pipelined): decode rank
    1's session fails at the lease prefill rank 1 announced, the scheduler ends rank 0's receive
    too, and both ranks report every block failed (vLLM recomputes the whole prompt, never half
    its heads)."""
    lease = {"pd_lease_s": 1.0, "pd_heartbeat_s": 0.25}
    prefill, decode = Engine("prefill-fast", lease), Engine("decode-fast", lease)
    try:
        addresses = tuple(w.address for w in prefill.workers)
        recv = RecvParams("proxy-2", addresses[0], 10, prompt_key(PROMPT), addresses)
        start_recv(decode, PDRequest("d1", PROMPT, recv))
        wait_sessions(prefill, "proxy-2")
        prefill.close(1)
        assert settle(prefill, decode, with_send=False) == set(DST)
        # rank 1 failed at its lease; the scheduler's end aborted rank 0's receive
        assert [(r.rank, r.ok, r.reason) for r in decode.results] == [
            (1, False, "failed"),
            (0, False, "aborted"),
        ]
        failed = {"role": "recv", "outcome": "failed"}
        assert decode.metrics.value("vllm_pd_requests", failed, "_total") == 1  # once, joined
        decode.sched.check_integrity()
    finally:
        prefill.close()
        decode.close()


def test_a_tp1_decode_refusing_a_tp2_prefill_tells_both_prefill_ranks_at_once() -> None:
    """A TP 1 decode engine handed a TP 2 prefill's params computes the request itself and
    tells both prefill ranks it will never ask: each rank frees its blocks now, long before its
    ``pd_pull_timeout_s`` (120 s), and vLLM may free the prefill's blocks (both ranks sent)."""
    prefill, decode = Engine("prefill-told"), Engine("decode-tp1", tp=1)
    try:
        params = prefill_steps(prefill, PDRequest("p1", PROMPT, SendParams(None)), chunk=4)
        recv = parse_params(params)
        assert decode.sched.matched(PDRequest("d1", PROMPT, recv), 0) == (0, False)
        (op,) = decode.step().recvs
        assert op.abandon.startswith("PD from a prefill engine at TP 2 to a decode engine at TP 1")
        for r, w in enumerate(prefill.workers):  # the decode engine's abort reached each rank
            deadline = time.monotonic() + WAIT_S
            tomb = functools.partial(w.participant.tombstone, rank_session("p1", r))
            while w.endpoint.call(tomb) is None:
                assert time.monotonic() < deadline, f"prefill rank {r} was never told"
                time.sleep(0.005)
        sent: Counter[str] = Counter()
        finished = ["p1"]
        deadline = time.monotonic() + WAIT_S
        while sent["p1"] < TP:
            assert time.monotonic() < deadline, f"not every prefill rank was told: {sent}"
            for w in prefill.workers:
                sent.update(end_step([w], finished, False, w.wake)[0])
            finished = []
            prefill.step()
            time.sleep(0.005)
        why = "the decode engine will not ask for it"
        assert sorted((r.rank, r.ok, r.reason) for r in prefill.results) == [
            (0, False, why),
            (1, False, why),
        ]
        refused = {"role": "recv", "outcome": "tp_mismatch"}
        assert decode.metrics.value("vllm_pd_requests", refused, "_total") == 1
        assert decode.results == [] and decode.workers[0].take_load_errors() == set()
        check_clean(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def test_a_prefill_rank_that_cannot_be_told_does_not_keep_the_others_from_being_told() -> None:
    prefill, decode = Engine("prefill-gone"), Engine("decode-tp1-gone", tp=1)
    try:
        a0, a1 = (w.address for w in prefill.workers)
        prefill.close(0)  # rank 0's endpoint is gone
        peers = decode.workers[0].peers
        peers.connect_timeout_s = 1.0
        op = RecvOp("d1", "p9", a0, prompt_key(PROMPT), 0, 0, (), "refused", (a0, a1))
        assert peers.abandon(op) == [a0]
        tomb = functools.partial(prefill.workers[1].participant.tombstone, SessionId("p9.rank1"))
        deadline = time.monotonic() + WAIT_S  # the tell is sent; rank 1 takes it on its loop
        while prefill.workers[1].endpoint.call(tomb) is None:
            assert time.monotonic() < deadline, "prefill rank 1 was never told"
            time.sleep(0.005)
    finally:
        prefill.close()
        decode.close()
