"""PDScheduler's decisions: what a decode engine receives and a prefill engine sends and holds.

Block size 4. A prompt of ``n`` tokens moves ``transferred_tokens(n, 4)`` token slots (all but
its last token, rounded up to whole blocks); the decode engine recomputes the last token.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplane.errors import UnsupportedError
from kvplane.integrations.vllm.messages import EndOp, PDResult, RecvOp, SendOp
from kvplane.integrations.vllm.pd_params import (
    RecvParams,
    SendParams,
    parse_params,
    prompt_key,
    transferred_tokens,
)
from kvplane.integrations.vllm.pd_scheduler import PDRequest, PDScheduler, PDStep
from kvplane.metrics import MetricsRegistry
from kvplane.pipeline.slicing import SliceCutter

BS = 4
ADDR = "tcp://127.0.0.1:7001"
PROMPT = list(range(100, 110))  # 10 tokens: 9 move, rounded up to 12 (3 blocks)


def sched(check_prompt: bool = True) -> tuple[PDScheduler, MetricsRegistry]:
    metrics = MetricsRegistry()
    s = PDScheduler(BS, metrics, check_prompt=check_prompt)
    s.set_endpoint([ADDR], "vllm-prefill")
    return s, metrics


def decode_req(
    prompt: list[int] = PROMPT, *, count: int | None = None, key: str | None = None
) -> PDRequest:
    n = len(PROMPT) if count is None else count
    params = RecvParams("sess-1", ADDR, n, prompt_key(PROMPT) if key is None else key)
    return PDRequest("d1", prompt, params)


def prefill_req(prompt: list[int] = PROMPT, session: str | None = None) -> PDRequest:
    return PDRequest("p1", prompt, SendParams(session))


def held(s: PDScheduler) -> bool:
    return s.pending_push_work


def requests(m: MetricsRegistry, role: str, outcome: str) -> float:
    return m.value("vllm_pd_requests", {"role": role, "outcome": outcome}, "_total")


# -- decode side ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "computed", "want"), [(10, 0, 9), (10, 4, 5), (10, 8, 1), (33, 0, 32)]
)
def test_matched_counts_all_but_the_last_token_beyond_the_computed(
    n: int, computed: int, want: int
) -> None:
    s, _ = sched()
    prompt = list(range(n))
    req = PDRequest("d1", prompt, RecvParams("s", ADDR, n, prompt_key(prompt)))
    assert s.matched(req, computed) == (want, True)
    assert s.matched(req, computed) == (0, False)  # asked once
    assert s.build() == PDStep()


@pytest.mark.parametrize(("n", "computed"), [(1, 0), (10, 9), (10, 10)])
def test_matched_is_zero_when_nothing_is_left(n: int, computed: int) -> None:
    s, _ = sched()
    prompt = list(range(n))
    req = PDRequest("d1", prompt, RecvParams("s", ADDR, n, prompt_key(prompt)))
    assert s.matched(req, computed) == (0, False)
    assert s.build() == PDStep()
    s.check_integrity()


def test_a_prefill_request_matches_nothing() -> None:
    s, _ = sched()
    assert s.matched(prefill_req(), 0) == (0, False)


@pytest.mark.parametrize(
    "req",
    [
        decode_req(count=11),  # the prefill's prompt had 11 tokens
        decode_req(key=prompt_key([1, 2, 3])),  # same length, other tokens
        decode_req([*PROMPT[:-1], 999]),  # the decode's own prompt differs in its last token
    ],
)
def test_a_prompt_mismatch_is_computed_here_and_abandoned_once(req: PDRequest) -> None:
    s, m = sched()
    assert s.matched(req, 0) == (0, False)
    why = "the decode request's prompt differs from the prefill's"
    want = RecvOp("d1", "sess-1", ADDR, prompt_key(req.prompt), 0, 0, (), why)
    assert s.build() == PDStep(recvs=[want])
    assert s.matched(req, 0) == (0, False)
    s.allocated(req, [1, 2, 3], 0)
    assert s.build() == PDStep()
    assert requests(m, "recv", "prompt_mismatch") == 1
    assert s.finished(req, "d1") == (False, None)
    assert s.build() == PDStep()
    s.check_integrity()


def test_without_check_prompt_a_same_length_prompt_is_received() -> None:
    s, m = sched(check_prompt=False)
    assert s.matched(decode_req(key=prompt_key([1] * 10)), 0) == (9, True)
    assert s.matched(decode_req(count=11), 0) == (0, False)  # "d1" asked already
    s2, m2 = sched(check_prompt=False)
    assert s2.matched(decode_req(count=11), 0) == (0, False)  # the length is always checked
    assert requests(m2, "recv", "prompt_mismatch") == 1
    assert requests(m, "recv", "prompt_mismatch") == 0


@pytest.mark.parametrize(
    ("n", "computed", "blocks", "num", "want_blocks"),
    [
        (10, 0, [7, 8, 9], 12, (7, 8, 9)),  # 9 tokens -> 3 blocks
        (9, 0, [5, 6, 3], 8, (5, 6)),  # 8 tokens -> exactly 2 blocks
        (10, 4, [2, 8, 9], 12, (2, 8, 9)),  # a local prefix hit: the receive starts at 4
        (2, 0, [4], 4, (4,)),
    ],
)
def test_allocated_receives_whole_blocks(
    n: int, computed: int, blocks: list[int], num: int, want_blocks: tuple[int, ...]
) -> None:
    s, _ = sched()
    prompt = list(range(50, 50 + n))
    req = PDRequest("d1", prompt, RecvParams("sess-1", ADDR, n, prompt_key(prompt)))
    left, load_async = s.matched(req, computed)
    assert load_async
    s.allocated(req, blocks, left)
    s.allocated(req, blocks, left)  # once
    want = RecvOp("d1", "sess-1", ADDR, prompt_key(prompt), num, computed, want_blocks)
    assert s.build() == PDStep(recvs=[want])
    assert num == transferred_tokens(n, BS)


def test_allocated_without_external_tokens_or_a_match_does_nothing() -> None:
    s, _ = sched()
    s.allocated(decode_req(), [1, 2, 3], 9)  # never matched
    assert s.matched(decode_req(), 0) == (9, True)
    s.allocated(decode_req(), [1, 2, 3], 0)
    assert s.build() == PDStep()


def test_a_received_request_is_counted_and_then_computed_locally() -> None:
    s, m = sched()
    req = decode_req()
    s.matched(req, 0)
    s.allocated(req, [1, 2, 3], 9)
    s.build()
    with pytest.raises(UnsupportedError, match="recvs \\['d1'\\]"):
        s.check_integrity()
    s.apply([PDResult("d1", "recv", True)])
    s.check_integrity()
    assert s.matched(req, 9) == (0, False)
    assert requests(m, "recv", "ok") == 1
    assert m.value("vllm_pd_tokens", {"role": "recv"}, "_total") == 9
    assert s.finished(req, "d1") == (False, None)
    assert s.build() == PDStep()


def test_a_failed_receive_moves_no_tokens() -> None:
    s, m = sched()
    s.matched(decode_req(), 0)
    s.allocated(decode_req(), [1, 2, 3], 9)
    s.apply([PDResult("d1", "recv", False, "failed")])
    assert requests(m, "recv", "failed") == 1
    assert m.value("vllm_pd_tokens", {"role": "recv"}, "_total") == 0


def test_a_decode_request_finished_while_receiving_ends_its_session() -> None:
    s, _ = sched()
    s.matched(decode_req(), 0)
    s.allocated(decode_req(), [1, 2, 3], 9)
    s.build()
    assert s.finished(decode_req(), "d1") == (False, None)
    assert s.build() == PDStep(ends=[EndOp("d1", "request finished in vLLM while receiving")])
    assert not s.pending_push_work


def test_a_request_finished_while_receiving_leaves_nothing_behind() -> None:
    s, _ = sched()
    s.matched(decode_req(), 0)
    s.allocated(decode_req(), [1, 2, 3], 9)
    s.finished(decode_req(), "d1")
    s.build()
    s.apply([PDResult("d1", "recv", False, "cancelled")])  # the worker's report comes after
    s.check_integrity()
    assert s.matched(decode_req(), 0) == (9, True)  # the id is free again (e.g. a retry)


def test_a_decode_request_finished_before_allocation_is_forgotten() -> None:
    s, _ = sched()
    s.matched(decode_req(), 0)
    assert s.finished(decode_req(), "d1") == (False, None)
    assert s.build() == PDStep()
    s.check_integrity()


# -- prefill side --------------------------------------------------------------------------------
def send(end: int, blocks: tuple[int, ...], last: bool, sid: str = "p1") -> SendOp:
    return SendOp("p1", sid, prompt_key(PROMPT), 12, end, blocks, last)


def test_chunked_prefill_sends_one_op_per_step_and_none_after_the_last() -> None:
    s, _ = sched()
    req = prefill_req()
    s.scheduled(req, 4, [3])
    assert s.build() == PDStep(sends=[send(4, (3,), False)])
    s.scheduled(req, 8, [3, 5])
    assert s.build() == PDStep(sends=[send(8, (3, 5), False)])
    s.scheduled(req, 10, [3, 5, 6])
    assert s.build() == PDStep(sends=[send(12, (3, 5, 6), True)])  # the last: num_tokens
    s.scheduled(req, 11, [3, 5, 6])  # the first decode step
    assert s.build() == PDStep()


def test_a_session_id_from_the_proxy_names_the_session() -> None:
    s, _ = sched()
    s.scheduled(prefill_req(session="proxy-7"), 10, [1, 2, 3])
    assert s.build() == PDStep(sends=[send(12, (1, 2, 3), True, sid="proxy-7")])
    done, params = s.finished(prefill_req(session="proxy-7"), "p1")
    assert done and parse_params(params) == RecvParams("proxy-7", ADDR, 10, prompt_key(PROMPT))


def test_a_one_token_prompt_sends_nothing() -> None:
    s, _ = sched()
    s.scheduled(prefill_req([5]), 1, [1])
    assert s.build() == PDStep()
    assert s.finished(prefill_req([5]), "p1") == (False, None)
    assert s.build() == PDStep()


def test_a_decode_request_is_never_sent() -> None:
    s, _ = sched()
    s.scheduled(decode_req(), 10, [1, 2, 3])
    assert s.build() == PDStep()


def test_finished_after_the_last_step_holds_blocks_and_returns_decode_params() -> None:
    s, m = sched()
    req = prefill_req()
    s.scheduled(req, 10, [1, 2, 3])
    s.build()
    assert not s.pending_push_work
    done, params = s.finished(req, "p1")
    assert done is True
    assert parse_params(params) == RecvParams("p1", ADDR, 10, prompt_key(PROMPT))
    assert params is not None and params["remote_engine_id"] == "vllm-prefill"
    assert s.build() == PDStep(delayed=["p1"])
    assert held(s)
    with pytest.raises(UnsupportedError, match="held \\['p1'\\]"):
        s.check_integrity()
    s.apply([PDResult("p1", "send", True)])
    assert not s.pending_push_work
    s.check_integrity()
    assert requests(m, "send", "ok") == 1


def test_finished_before_the_last_step_ends_the_session() -> None:
    s, m = sched()
    req = prefill_req()
    s.scheduled(req, 4, [1])
    s.build()
    assert s.finished(req, "p1") == (True, None)
    want = PDStep(ends=[EndOp("p1", "prefill request ended before its prompt")], delayed=["p1"])
    assert s.build() == want
    assert held(s)
    s.apply([PDResult("p1", "send", False, "cancelled")])
    assert not s.pending_push_work
    s.check_integrity()
    assert requests(m, "send", "failed") == 1


def test_preempted_prefill_ends_its_send_once() -> None:
    s, _ = sched()
    req = prefill_req()
    s.scheduled(req, 4, [1])
    s.build()
    s.preempted(["p1", "unknown"])
    s.preempted(["p1"])
    assert s.build() == PDStep(ends=[EndOp("p1", "preempted on the prefill engine")])
    s.scheduled(req, 4, [7])  # rescheduled: no more slices for the ended session
    assert s.build() == PDStep()
    s.apply([PDResult("p1", "send", False, "cancelled")])
    s.check_integrity()


def test_a_finished_request_unknown_to_pd_is_ignored() -> None:
    s, _ = sched()
    assert s.finished(None, "x") == (False, None)
    assert s.build() == PDStep()


def test_the_endpoint_comes_from_the_worker_handshake() -> None:
    s = PDScheduler(BS, MetricsRegistry())
    s.set_endpoint(["tcp://10.0.0.1:9"], "engine-a")
    s.scheduled(prefill_req(), 10, [1, 2, 3])
    _, params = s.finished(prefill_req(), "p1")
    assert params is not None
    assert (params["kvplane_pd"], params["remote_engine_id"]) == ("tcp://10.0.0.1:9", "engine-a")


# -- property: what a chunked prefill sends ------------------------------------------------------
@given(st.integers(2, 300), st.lists(st.integers(1, 64), min_size=1, max_size=40))
def test_send_ops_of_any_chunking_cut_into_aligned_slices(n: int, chunks: list[int]) -> None:
    s, _ = sched()
    prompt = list(range(n))
    req = PDRequest("p1", prompt, SendParams(None))
    end, i = 0, 0
    while end < n:
        end = min(n, end + chunks[i % len(chunks)])
        i += 1
        s.scheduled(req, end, list(range(1, -(-end // BS) + 1)))
    s.scheduled(req, n + 1, list(range(1, -(-(n + 1) // BS) + 1)))  # a decode step: no op
    ops = s.build().sends
    num = transferred_tokens(n, BS)
    assert len(ops) == i
    assert all(op.num_tokens == num for op in ops)
    assert [op.last for op in ops] == [False] * (i - 1) + [True]
    ends = [op.computed_end for op in ops]
    assert ends == sorted(ends) and ends[-1] == num
    assert all(e <= n - 1 for e in ends[:-1])  # a step before the last computes < n tokens
    if all(c % BS == 0 for c in chunks):  # vLLM's block-multiple token budgets
        assert all(e % BS == 0 for e in ends)
    cutter = SliceCutter(num, BS)  # the worker cuts the ops into block-aligned slices
    cuts = [c for op in ops if (c := cutter.after_step(op.computed_end, op.last)) is not None]
    ranges = [(r.start, r.end) for _, r in cuts]
    assert ranges[0][0] == 0 and ranges[-1][1] == num
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(e % BS == 0 for _, e in ranges)


def test_a_send_done_while_vllm_still_decodes_is_released_once_it_finishes() -> None:
    """Pipelined with more than one token: the session ends before the request does; the
    finished request is still delayed once (the worker reports it), but nothing is held."""
    s, _ = sched()
    req = prefill_req(session="proxy-9")
    s.scheduled(req, 10, [3, 5, 6])
    s.build()
    s.apply([PDResult("p1", "send", True)])
    assert not held(s)
    done, params = s.finished(req, "p1")
    assert done and parse_params(params) == RecvParams("proxy-9", ADDR, 10, prompt_key(PROMPT))
    assert s.build() == PDStep(delayed=["p1"])
    assert not held(s)
    s.check_integrity()
