"""PD over vLLM's KV cache groups without vLLM: one session per request moves every group.

Two groups as vLLM's hybrid manager gives a Gemma-2 (layer 0 windowed, group 0; layer 1 full,
group 1): both layers view one tensor slot by slot, each group's block ids its own. Block size
4, window 8 tokens. An 18-token prompt moves 16 tokens (4 whole blocks; the decode engine
computes tokens 16 and 17): the full group all 4 blocks, the window group only blocks 2-3 (its
plan window 9 from the end 16: tokens 8-15, read by the query at 16). Two PD worker sides in
one process over the real ``tcp`` transport, played like the connector (as
``test_vllm_pd_worker.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch
from vllm_testlib import block_content, vllm_kv_caches

from kvplane.errors import InvalidArgumentError, UnsupportedError
from kvplane.ids import SessionId, TokenRange
from kvplane.integrations.vllm.groups import HMA_OFF, KVGroup, group_caches
from kvplane.integrations.vllm.messages import PDResult, StepMeta
from kvplane.integrations.vllm.pd_config import pd_config, pd_settings
from kvplane.integrations.vllm.pd_groups import (
    destination_ids,
    group_refusal,
    layer_numbers,
    pd_layouts,
    plan_window,
    window_hole,
)
from kvplane.integrations.vllm.pd_params import RecvParams, SendParams, parse_params
from kvplane.integrations.vllm.pd_params import transferred_tokens as moved
from kvplane.integrations.vllm.pd_scheduler import PDRequest, PDScheduler
from kvplane.integrations.vllm.pd_transport import make_pd_transport, pool_buffers
from kvplane.integrations.vllm.pd_worker import PDWorkerSide
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.tp import TPShard
from kvplane.integrations.vllm.wakeup import end_step
from kvplane.integrations.vllm.windows import KVWindow, first_kept_block
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.pipeline.advert import encode_advert
from kvplane.transfer.resharding import KVBox, window_boxes

BS = 4
WINDOW = KVWindow(8, BS)
W_LAYER, F_LAYER = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
GROUPS = (KVGroup(0, 2, (W_LAYER,), WINDOW), KVGroup(1, 2, (F_LAYER,)))
PROMPT = list(range(300, 318))  # 18 tokens: 16 move
MODEL = "cd" * 16
WAIT_S = 8.0
SECRET = {"KVPLANE_SECRET": "kvplane-pd-test-secret-0123456789"}


# -- the rules, pure ---------------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "bs", "want"), [(8, 4, 9), (10, 4, 13), (64, 32, 65)])
def test_the_plan_window_reads_whole_blocks_from_a_block_aligned_end(
    tokens: int, bs: int, want: int
) -> None:
    window = KVWindow(tokens, bs)
    assert plan_window(window) == want
    layout = KVLayout.gqa(
        num_blocks=8, block_size=bs, num_layers=1, kv_heads=1, head_dim=2, dtype=torch.bfloat16
    )
    planned = KVLayout.gqa(
        num_blocks=8, block_size=bs, num_layers=1, kv_heads=1, head_dim=2, dtype=torch.bfloat16,
        sliding_window=want,
    )  # fmt: skip
    for end in range(0, 12 * bs, bs):
        start = planned.window_start(end)
        first_read = max(0, end + 1 - tokens)  # the decode engine's query at ``end`` reads on
        assert start % bs == 0 and start == first_read // bs * bs
        assert start // bs >= first_kept_block(window, end)  # vLLM holds it there
    assert layout.window_start(4 * bs) == 0


def test_several_groups_move_whole_blocks_before_the_last_token() -> None:
    assert [moved(n, BS, 2) for n in (1, 4, 5, 8, 18)] == [0, 0, 4, 4, 16]
    assert [moved(n, BS) for n in (1, 4, 5, 8, 18)] == [0, 4, 4, 8, 20]  # one group: today's


def test_layers_are_numbered_in_model_order_and_windows_set_per_group() -> None:
    kv = shared_caches()
    pools = [VllmPool.from_kv_caches(group_caches(kv, g)) for g in GROUPS]
    assert layer_numbers(GROUPS[::-1]) == {W_LAYER: 0, F_LAYER: 1}
    assert layer_numbers((KVGroup(0, 1, ("m.layers.10.a", "m.layers.9.a")),)) == {
        "m.layers.9.a": 0,
        "m.layers.10.a": 1,
    }
    got = pd_layouts(pools, GROUPS, TPShard())
    assert [(lay.layer_ids, lay.sliding_window) for lay in got] == [((0,), 9), ((1,), None)]
    one = pd_layouts(pools[:1], (KVGroup(0, 1, (W_LAYER,)),), TPShard())
    assert one == pd_layouts(pools[:1], (), TPShard()) == (pools[0].layout,)
    with pytest.raises(InvalidArgumentError, match="2 pools for 1 KV cache groups"):
        pd_layouts(pools, GROUPS[:1], TPShard())
    assert pool_buffers(pools) == [0, 0]  # one buffer slot by slot: one region


def test_overlapping_unequal_pools_are_refused_naming_the_flag() -> None:
    kv = vllm_kv_caches(num_layers=2, num_blocks=8, block_size=BS)
    whole = VllmPool.from_kv_caches(kv)
    part = VllmPool.from_kv_caches({F_LAYER: kv["model.layers.1.self_attn.attn"]})
    with pytest.raises(UnsupportedError, match=f"groups 0 and 1 view overlapping.*{HMA_OFF}"):
        pool_buffers([whole, part])


def test_destination_ids_are_each_groups_one_after_the_other() -> None:
    assert destination_ids([(0, 0, 17, 18, 19), (11, 12, 13, 14)], 4) == (
        0, 0, 17, 18, 11, 12, 13, 14,
    )  # fmt: skip
    with pytest.raises(UnsupportedError, match="group 1: 3 blocks, the receive needs 4"):
        destination_ids([(1, 2, 3, 4), (5, 6, 7)], 4)


def test_a_peer_with_other_groups_is_refused_in_one_line() -> None:
    kv = shared_caches()
    pools = [VllmPool.from_kv_caches(group_caches(kv, g)) for g in GROUPS]
    two = pd_layouts(pools, GROUPS, TPShard())
    one = VllmPool.from_kv_caches(vllm_kv_caches(num_layers=2, num_blocks=8, block_size=BS))

    def advert(layouts: tuple[KVLayout, ...]) -> bytes:
        return encode_advert("tcp", b"m", [(lay, i) for i, lay in enumerate(layouts)])  # type: ignore[misc]

    assert group_refusal(two, advert(two)) is None
    assert group_refusal((one.layout,), advert((one.layout,))) is None
    why = group_refusal(two, advert((one.layout,)))
    assert why is not None and "\n" not in why
    theirs, ours = "[layers [0, 1] window None]", "[layers [0] window 9; layers [1] window None]"
    assert why.startswith(f"the PD peer has 1 KV cache group(s) {theirs}, this engine 2 {ours}")
    assert why.endswith(f"with or without {HMA_OFF}")
    assert "has 2 KV cache group(s)" in (group_refusal((one.layout,), advert(two)) or "")
    assert "version 9" in (group_refusal(two, b"\x91\x09") or "")
    # the window group's plan moves exactly its window's cells (the planner's one rule)
    whole = KVBox(two[0].head_range, two[0].layer_ids, TokenRange(0, 16))
    assert window_boxes(two[0], whole, 16) == (
        dataclasses.replace(whole, tokens=TokenRange(8, 16)),
    )


# -- two engines, every group in one session -----------------------------------------------------
def shared_caches() -> dict[str, torch.Tensor]:
    """Layer 0 and layer 1 view one tensor slot by slot, as vLLM's hybrid manager lays them."""
    shared = next(iter(vllm_kv_caches(num_layers=1, num_blocks=24, block_size=BS).values()))
    return {W_LAYER: shared, F_LAYER: shared}


class Engine:
    """One engine's PD halves over two groups (``hybrid``) or one group of both layers."""

    def __init__(self, name: str, hybrid: bool = True) -> None:
        extra = {"pd_transport": "tcp", "pd_name": name}
        settings = pd_settings(pd_config(extra, SECRET), SECRET)  # peers hear refusals
        assert settings is not None
        self.metrics = MetricsRegistry()
        groups = GROUPS if hybrid else (KVGroup(0, 1, (W_LAYER, F_LAYER)),)
        kv = shared_caches() if hybrid else vllm_kv_caches(num_blocks=24, block_size=BS)
        self.pools = [VllmPool.from_kv_caches(group_caches(kv, g)) for g in groups]
        self.worker = PDWorkerSide(
            settings, self.pools[0], MODEL, self.metrics, make_pd_transport(settings),
            groups=groups, group_pools=self.pools[1:],
        )  # fmt: skip
        self.sched = PDScheduler(BS, MetricsRegistry(), groups=len(groups))
        self.sched.set_endpoint([self.worker.address], self.worker.engine_id)
        self.results: list[PDResult] = []

    def blocks(self) -> torch.Tensor:
        return self.pools[0].layout.canonical_view(self.pools[0].tensor)

    def step(self) -> StepMeta:
        meta = self.sched.build().into(StepMeta())
        self.worker.begin_step(meta)
        self.worker.after_forward(meta)
        got = self.worker.take_results()
        self.results += got
        self.sched.apply(got)
        return meta


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    prefill, decode = Engine("prefill"), Engine("decode")
    yield prefill, decode
    prefill.worker.close()
    decode.worker.close()


FULL_SRC, WIN_SRC = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
FULL_DST, WIN_DST = [11, 12, 13, 14], [0, 0, 17, 18]  # vLLM holds the window of token 16 on


def prefill(eng: Engine, req: PDRequest, chunk: int, hole: bool = False) -> dict[str, object]:
    """Chunked prefill: each step computes its blocks of both groups (known bytes, the group
    in them); the window group's table is null left of the window of the step's first token
    (``hole``: the last step's also at block 2, as if vLLM freed a block the window needs)."""
    view, end = eng.blocks(), 0
    while end < len(PROMPT):
        start, end = end, min(len(PROMPT), end + chunk)
        n = -(-end // BS)
        kept = first_kept_block(WINDOW, start)
        kept = 3 if hole and end == len(PROMPT) else kept
        win = [0] * kept + WIN_SRC[kept:n]
        eng.sched.scheduled(req, end, win, [FULL_SRC[:n]])  # the window group is group 0
        for i in range(start // BS, n):
            for g, table in enumerate((win, FULL_SRC)):
                view[table[i]] = block_content([g, *PROMPT], i, BS, tuple(view.shape[1:]))
        eng.step()
    done, params = eng.sched.finished(req, req.req_id)
    assert done and params is not None
    eng.step()
    return params


def settle(p: Engine, d: Engine) -> None:
    sent = got = False
    finished = ["p1"]
    deadline = time.monotonic() + WAIT_S
    while not (sent and got):
        assert time.monotonic() < deadline, f"not settled: sent {sent}, received {got}"
        s, _ = end_step([p.worker], finished, False, p.worker.wake)
        finished = []
        _, r = end_step([d.worker], [], False, d.worker.wake)
        sent, got = sent or "p1" in s, got or "d1" in r
        p.step()
        d.step()
        time.sleep(0.005)


def check_copied(p: Engine, d: Engine) -> None:
    """The full group's 4 blocks and the window group's blocks 2-3, byte for byte; nothing
    else written (the window group's null block neither)."""
    src, dst = p.blocks(), d.blocks()
    pairs = [*zip(FULL_SRC[:4], FULL_DST, strict=True), (8, 17), (9, 18)]
    for s, t in pairs:
        assert torch.equal(dst[t].view(torch.uint8), src[s].view(torch.uint8)), f"{s} -> {t}"
    untouched = [b for b in range(24) if b not in {t for _s, t in pairs}]
    assert not dst[untouched].any(), "a block outside the receive was written"
    block = p.pools[0].bytes_per_block  # one layer: one group's block
    assert p.metrics.value("pd_bytes_moved", suffix="_total") == (4 + 2) * block


def check_clean(p: Engine, d: Engine) -> None:
    assert p.results == [PDResult("p1", "send", True, "committed by the receiver")]
    assert d.results == [PDResult("d1", "recv", True, "success")]
    assert not p.worker.busy and not d.worker.busy and not p.sched.pending_push_work
    p.sched.check_integrity()
    d.sched.check_integrity()


def start_recv(d: Engine, recv: RecvParams) -> None:
    req = PDRequest("d1", PROMPT, recv)
    assert d.sched.matched(req, 0) == (16, True)  # tokens 16 and 17 computed there
    d.sched.allocated(req, WIN_DST, 16, [FULL_DST])
    (op,) = d.step().recvs
    assert (op.num_tokens, op.prefix_tokens) == (16, 0)
    assert op.block_ids == (*WIN_DST, *FULL_DST)


def test_pull_moves_every_group_in_one_session(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    params = prefill(p, PDRequest("p1", PROMPT, SendParams(None)), chunk=8)
    recv = parse_params(params)
    assert isinstance(recv, RecvParams)
    start_recv(d, recv)
    settle(p, d)
    check_copied(p, d)
    check_clean(p, d)


def test_pipelined_moves_every_group_in_one_session(engines: tuple[Engine, Engine]) -> None:
    p, d = engines
    recv = RecvParams("proxy-1", p.worker.address, len(PROMPT))
    start_recv(d, recv)
    deadline = time.monotonic() + WAIT_S
    part = p.worker.participant
    while p.worker.endpoint.call(lambda: part.session(SessionId("proxy-1"))) is None:
        assert time.monotonic() < deadline, "the decode's request never reached the prefill"
        time.sleep(0.005)
    prefill(p, PDRequest("p1", PROMPT, SendParams("proxy-1")), chunk=4)
    settle(p, d)
    check_copied(p, d)
    check_clean(p, d)


def test_a_decode_engine_with_other_groups_is_refused_at_the_handshake() -> None:
    p, d = Engine("prefill"), Engine("decode", hybrid=False)
    try:
        params = prefill(p, PDRequest("p1", PROMPT, SendParams(None)), chunk=8)
        recv = parse_params(params)
        assert isinstance(recv, RecvParams)
        req = PDRequest("d1", PROMPT, recv)
        assert d.sched.matched(req, 0) == (17, True)  # one group: today's rule
        d.sched.allocated(req, [*FULL_DST, 15], 17)
        d.step()
        deadline = time.monotonic() + WAIT_S
        while not d.results:
            assert time.monotonic() < deadline, "the refused receive never ended"
            d.step()
            time.sleep(0.005)
        (res,) = d.results
        assert not res.ok and "\n" not in res.reason
        assert "KV cache group(s)" in res.reason and HMA_OFF in res.reason
        assert not d.blocks().any()
    finally:
        p.worker.close()
        d.worker.close()


def test_a_window_freed_under_the_send_fails_the_request_not_the_bytes(
    engines: tuple[Engine, Engine],
) -> None:
    """The last step's window table is null at block 2 (read from 8 on): the send ends, the
    decode's receive fails and is named a failed receive (several groups: vLLM recomputes the
    request whatever earlier slices wrote)."""
    tables = ((0, 0, 0, 9), (1, 2, 3, 4))
    layouts = engines[0].worker.layouts
    assert window_hole(layouts, tables, 16) == (
        "KV cache group 0 freed a block of its window before the PD send"
    )
    assert window_hole(layouts, ((0, 0, 8, 9), (1, 2, 3, 4)), 16) is None
    p, d = engines
    recv = RecvParams("proxy-2", p.worker.address, len(PROMPT))
    start_recv(d, recv)
    deadline = time.monotonic() + WAIT_S
    part = p.worker.participant
    while p.worker.endpoint.call(lambda: part.session(SessionId("proxy-2"))) is None:
        assert time.monotonic() < deadline, "the decode's request never reached the prefill"
        time.sleep(0.005)
    prefill(p, PDRequest("p1", PROMPT, SendParams("proxy-2")), chunk=4, hole=True)
    while not (p.results and d.results):
        assert time.monotonic() < deadline + WAIT_S, "the failed send never settled"
        end_step([p.worker], ["p1"], False, p.worker.wake)
        end_step([d.worker], [], False, d.worker.wake)
        p.step()
        d.step()
        time.sleep(0.005)
    assert [(r.role, r.ok) for r in p.results + d.results] == [("send", False), ("recv", False)]
    assert d.worker.take_failed() == {"d1"} and d.worker.take_load_errors() == set()
    assert not p.worker.busy and not d.worker.busy
    p.sched.check_integrity()
    d.sched.check_integrity()
