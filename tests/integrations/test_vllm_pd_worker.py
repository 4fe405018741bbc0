"""Two PD worker sides in one process over the real ``tcp`` transport, driven like the connector.

Each side owns a vLLM-shaped KV buffer (``vllm_kv_caches``, block size 4) and a
:class:`PDScheduler` that makes its step instructions, exactly as the connector's scheduler side
does; the test plays vLLM: it schedules chunked prefill steps, "computes" each step's blocks
(known bytes) between ``begin_step`` and ``after_forward``, and polls ``finished`` like vLLM's
engine loop. Received blocks must equal the prefill's byte for byte.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
from vllm_testlib import block_content, vllm_kv_caches

from kvplane.errors import TransferTimeoutError
from kvplane.ids import SessionId
from kvplane.integrations.vllm import pd_peers
from kvplane.integrations.vllm.messages import PDResult, StepMeta
from kvplane.integrations.vllm.pd_config import pd_config, pd_settings
from kvplane.integrations.vllm.pd_params import RecvParams, SendParams, parse_params, prompt_key
from kvplane.integrations.vllm.pd_scheduler import PDRequest, PDScheduler
from kvplane.integrations.vllm.pd_transport import make_pd_transport
from kvplane.integrations.vllm.pd_worker import PDWorkerSide
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.wakeup import IDLE_WAIT_S, Wakeup, end_step
from kvplane.metrics import MetricsRegistry

BS = 4
PROMPT = list(range(300, 310))  # 10 tokens: 9 move, as 3 whole blocks
MODEL = "ab" * 16
WAIT_S = 8.0


@dataclass
class Engine:
    """One engine's PD halves (scheduler and worker) and its KV buffer."""

    name: str
    pool: VllmPool = field(init=False)
    sched: PDScheduler = field(init=False)
    worker: PDWorkerSide = field(init=False)
    results: list[PDResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        extra = {"pd_transport": "tcp", "pd_insecure": True, "pd_name": self.name}
        settings = pd_settings(pd_config(extra, {}), {})
        assert settings is not None
        self.pool = VllmPool.from_kv_caches(vllm_kv_caches(num_blocks=16, block_size=BS))
        transport = make_pd_transport(settings)
        self.worker = PDWorkerSide(settings, self.pool, MODEL, MetricsRegistry(), transport)
        self.sched = PDScheduler(BS, MetricsRegistry())
        self.sched.set_endpoint([self.worker.address], self.worker.engine_id)

    def blocks(self) -> torch.Tensor:
        return self.pool.layout.canonical_view(self.pool.tensor)

    def step(self, compute: Callable[[], None] = lambda: None) -> StepMeta:
        """One engine step: the scheduler's instructions, the forward, the worker's report."""
        meta = self.sched.build().into(StepMeta())
        self.worker.begin_step(meta)
        compute()
        self.worker.after_forward(meta)
        got = self.worker.take_results()
        self.results += got
        self.sched.apply(got)
        return meta

    def close(self) -> None:
        self.worker.close()


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    prefill, decode = Engine("prefill"), Engine("decode")
    yield prefill, decode
    prefill.close()
    decode.close()


def fill(eng: Engine, blocks: list[int], first: int) -> None:
    """Computes prompt blocks ``first ..`` of ``blocks``: known bytes per (prompt, index)."""
    view = eng.blocks()
    for i in range(first, len(blocks)):
        view[blocks[i]] = block_content(PROMPT, i, BS, tuple(view.shape[1:]))


def prefill_steps(eng: Engine, req: PDRequest, blocks: list[int], chunk: int) -> dict[str, object]:
    """Chunked prefill of ``req`` into ``blocks``; returns the finished request's params."""
    end = 0
    while end < len(req.prompt):
        start, end = end, min(len(req.prompt), end + chunk)
        table = blocks[: -(-end // BS)]
        eng.sched.scheduled(req, end, table)
        eng.step(lambda s=start, t=table: fill(eng, t, s // BS))  # type: ignore[misc]
    done, params = eng.sched.finished(req, req.req_id)
    assert done and params is not None
    eng.step()  # carries pd_delayed
    return params


def start_recv(eng: Engine, req: PDRequest, blocks: list[int]) -> None:
    left, load_async = eng.sched.matched(req, 0)
    assert load_async and left == len(PROMPT) - 1
    eng.sched.allocated(req, blocks, left)
    meta = eng.step()
    assert len(meta.recvs) == 1


def settle(
    prefill: Engine, decode: Engine, prefill_id: str, decode_id: str, idle: bool = False
) -> set[int]:
    """Poll both workers like vLLM's loop (``idle``: steps with no token scheduled) until the
    send and the receive are reported (each once); returns the decode side's load errors."""
    sent = got = False
    errors: set[int] = set()
    finished = [prefill_id]  # vLLM passes a finished request's id once
    deadline = time.monotonic() + WAIT_S
    while not (sent and got):
        assert time.monotonic() < deadline, f"not settled: sent {sent}, received {got}"
        s, _ = end_step([prefill.worker], finished, idle, prefill.worker.wake)
        finished = []
        _, r = end_step([decode.worker], [], idle, decode.worker.wake)
        errors |= decode.worker.take_load_errors()
        assert not (sent and prefill_id in s) and not (got and decode_id in r), "reported twice"
        sent, got = sent or prefill_id in s, got or decode_id in r
        prefill.step()
        decode.step()
        time.sleep(0.005)
    return errors


def wait_for(what: Callable[[], bool], why: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.005)


def check_copied(prefill: Engine, decode: Engine, src: list[int], dst: list[int]) -> None:
    p, d = prefill.blocks(), decode.blocks()
    for s, t in zip(src, dst, strict=True):
        want = p[s].contiguous().view(torch.uint8)
        assert torch.equal(d[t].contiguous().view(torch.uint8), want), f"block {s} -> {t}"
    untouched = [b for b in range(16) if b not in dst]
    assert not d[untouched].any(), "a block outside the receive was written"


def check_clean(prefill: Engine, decode: Engine) -> None:
    assert not prefill.worker.busy and not decode.worker.busy
    assert not prefill.sched.pending_push_work
    prefill.sched.check_integrity()
    decode.sched.check_integrity()


SRC, DST = [3, 5, 6], [9, 2, 11]


def test_pull_after_prefill_copies_every_block(engines: tuple[Engine, Engine]) -> None:
    prefill, decode = engines
    req = PDRequest("p1", PROMPT, SendParams(None))
    params = prefill_steps(prefill, req, SRC, chunk=4)
    recv = parse_params(params)
    assert recv == RecvParams("p1", prefill.worker.address, 10, prompt_key(PROMPT))
    assert isinstance(recv, RecvParams)
    start_recv(decode, PDRequest("d1", PROMPT, recv), DST)
    assert settle(prefill, decode, "p1", "d1") == set()
    check_copied(prefill, decode, SRC, DST)
    assert prefill.results == [PDResult("p1", "send", True, "committed by the receiver")]
    assert decode.results == [PDResult("d1", "recv", True, "success")]
    check_clean(prefill, decode)


@pytest.mark.parametrize("chunk", [4, 3, 10])
def test_pipelined_receive_opened_before_prefill_copies_every_block(
    engines: tuple[Engine, Engine], chunk: int
) -> None:
    prefill, decode = engines
    sid = "proxy-1"
    recv = RecvParams(sid, prefill.worker.address, 10, prompt_key(PROMPT))
    start_recv(decode, PDRequest("d1", PROMPT, recv), DST)
    ep, part = prefill.worker.endpoint, prefill.worker.participant
    wait_for(
        lambda: ep.call(lambda: part.session(SessionId(sid))) is not None,
        "the decode engine's request never reached the prefill engine",
    )
    params = prefill_steps(prefill, PDRequest("p1", PROMPT, SendParams(sid)), SRC, chunk)
    assert parse_params(params) == recv
    assert settle(prefill, decode, "p1", "d1") == set()
    check_copied(prefill, decode, SRC, DST)
    assert prefill.results == [PDResult("p1", "send", True, "committed by the receiver")]
    assert decode.results == [PDResult("d1", "recv", True, "success")]
    check_clean(prefill, decode)


def test_a_receive_for_another_prompt_fails_and_frees_the_send(
    engines: tuple[Engine, Engine],
) -> None:
    prefill, decode = engines
    params = prefill_steps(prefill, PDRequest("p1", PROMPT, SendParams(None)), SRC, chunk=4)
    recv = parse_params(params)
    assert isinstance(recv, RecvParams)
    other = [*PROMPT[:-1], 7]
    # vLLM's decode scheduler would catch this itself (check_prompt); a worker never trusts it
    op_req = PDRequest("d1", other, RecvParams(recv.session_id, recv.address, 10, None))
    start_recv(decode, op_req, DST)
    assert settle(prefill, decode, "p1", "d1") == set(DST)
    assert not decode.blocks()[DST].any(), "KV of another prompt was written"
    assert prefill.results == [
        PDResult("p1", "send", False, "the decode engine asked for another prompt's KV")
    ]
    assert decode.results == [PDResult("d1", "recv", False, "failed")]
    assert not prefill.worker.busy and not decode.worker.busy
    prefill.sched.check_integrity()


def test_a_preempted_prefill_is_sent_again_and_held_until_pulled(
    engines: tuple[Engine, Engine],
) -> None:
    prefill, decode = engines
    req = PDRequest("p1", PROMPT, SendParams(None))
    prefill.sched.scheduled(req, 4, [4])
    prefill.step(lambda: fill(prefill, [4], 0))
    prefill.sched.preempted(["p1"])
    meta = prefill.step()  # the EndOp: the unclaimed send stops and is reported failed
    assert [e.req_id for e in meta.ends] == ["p1"]
    assert [(r.req_id, r.role, r.ok) for r in prefill.results] == [("p1", "send", False)]
    # vLLM recomputes the preempted request into new blocks; the scheduler sends it afresh
    params = prefill_steps(prefill, req, SRC, chunk=4)
    sent, _ = prefill.worker.finished(["p1"])
    assert sent == set(), "blocks released before the decode engine pulled them"
    recv = parse_params(params)
    assert isinstance(recv, RecvParams)
    start_recv(decode, PDRequest("d1", PROMPT, recv), DST)
    assert settle(prefill, decode, "p1", "d1") == set()
    check_copied(prefill, decode, SRC, DST)
    check_clean(prefill, decode)


def test_a_decode_request_for_another_prompt_abandons_the_send(
    engines: tuple[Engine, Engine],
) -> None:
    prefill, decode = engines
    params = prefill_steps(prefill, PDRequest("p1", PROMPT, SendParams(None)), SRC, chunk=4)
    recv = parse_params(params)
    assert isinstance(recv, RecvParams)
    req = PDRequest("d1", [*PROMPT[:-1], 7], recv)  # the decode scheduler checks the key
    assert decode.sched.matched(req, 0) == (0, False)
    meta = decode.step()
    assert [op.abandon != "" for op in meta.recvs] == [True]
    sent: set[str] = set()
    finished = ["p1"]
    deadline = time.monotonic() + WAIT_S  # far below pd_pull_timeout_s (120 s)
    while "p1" not in sent:
        assert time.monotonic() < deadline, "the abandoned send was never reported"
        sent, _ = prefill.worker.finished(finished)
        finished = []
        prefill.step()
        time.sleep(0.005)
    assert prefill.results == [
        PDResult("p1", "send", False, "the decode engine will not ask for it")
    ]
    assert decode.worker.take_load_errors() == set()
    check_clean(prefill, decode)


class RecordingWakeup(Wakeup):
    """Stands in for the worker's wake-up: records the waits an idle step makes."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return False


def test_an_idle_step_waits_for_progress_only_while_a_transfer_is_pending(
    engines: tuple[Engine, Engine],
) -> None:
    prefill, decode = engines
    wake = prefill.worker.wake = RecordingWakeup()
    assert end_step([prefill.worker], [], True, wake) == (set(), set())
    assert wake.waits == []  # nothing pending: vLLM is not stepping for us
    req = PDRequest("p1", PROMPT, SendParams(None))
    params = prefill_steps(prefill, req, SRC, chunk=4)
    assert end_step([prefill.worker], ["p1"], False, wake) == (set(), set())
    assert wake.waits == []  # a step with work never waits
    assert end_step([prefill.worker], [], True, wake) == (set(), set())
    assert wake.waits == [IDLE_WAIT_S]  # the send waits for its decode engine
    recv = parse_params(params)
    assert isinstance(recv, RecvParams)
    start_recv(decode, PDRequest("d1", PROMPT, recv), DST)
    assert settle(prefill, decode, "p1", "d1", idle=True) == set()
    check_copied(prefill, decode, SRC, DST)
    check_clean(prefill, decode)


def test_a_dial_nobody_answers_is_made_afresh_until_the_connect_timeout(
    engines: tuple[Engine, Engine],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, decode = engines
    monkeypatch.setattr(pd_peers, "CONNECT_ATTEMPT_S", 0.3)
    decode.worker.peers.connect_timeout_s = 1.0
    with socket.socket() as mute:  # accepts connections, never says a word
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        address = f"tcp://127.0.0.1:{mute.getsockname()[1]}"
        with pytest.raises(TransferTimeoutError, match=f"handshake with {address} timed out"):
            decode.worker.peers.connect(address)
    attempts = [r for r in caplog.records if "timed out" in r.getMessage()]
    assert len(attempts) >= 2  # one per attempt: the first did not end the dial
    assert all(address in r.getMessage() for r in attempts)
