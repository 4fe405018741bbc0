"""PD at TP > 1, without engines: the per-rank pieces (``pd_ranks``), the params that name every
prefill rank, and one engine's PD decisions for two ranks (``PDScheduler(tp_size=2)``).

Block size 4; a 10-token prompt moves 3 blocks (9 tokens, rounded up).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvplane.errors import ConfigError, InvalidArgumentError, UnsupportedError
from kvplane.integrations.vllm.messages import EndOp, PDResult, RecvOp
from kvplane.integrations.vllm.pd_config import PDSettings, pd_config, pd_settings
from kvplane.integrations.vllm.pd_params import (
    RecvParams,
    SendParams,
    address_params,
    decode_params,
    parse_params,
    prompt_key,
)
from kvplane.integrations.vllm.pd_ranks import (
    RankResults,
    abandon_peers,
    heads_refusal,
    rank_layout,
    rank_session,
    rank_settings,
    tp_refusal,
)
from kvplane.integrations.vllm.pd_scheduler import PDRequest, PDScheduler, PDStep
from kvplane.integrations.vllm.tp import TPShard
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.pd.handshake import LayoutInfo

BS = 4
A0, A1 = "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"
PROMPT = list(range(100, 110))
KEY = prompt_key(PROMPT)
REFUSAL = (
    "PD from a prefill engine at TP 1 to a decode engine at TP 2: kvplane pairs rank r with "
    "rank r at equal TP only; heterogeneous TP needs issue #31's multi-sender session"
)


# -- rank_layout ---------------------------------------------------------------------------------
def pool_layout(kv_heads: int = 1) -> KVLayout:
    return KVLayout.gqa(
        num_blocks=16, block_size=BS, num_layers=2, kv_heads=kv_heads, head_dim=8,
        dtype=torch.float32,
    )  # fmt: skip


def test_a_rank_layout_holds_its_head_range_of_the_engine_and_the_pools_bytes() -> None:
    pool = pool_layout(kv_heads=2)  # one rank's 2 local heads
    r0, r1 = (rank_layout(pool, TPShard(r, 2)) for r in (0, 1))
    assert (r0.total_heads, r0.head_range) == (4, (0, 2))
    assert (r1.total_heads, r1.head_range) == (4, (2, 4))
    assert r0.shape == r1.shape == pool.shape  # same memory, same strides
    assert (r0.order, r0.num_blocks, r0.dtype) == (pool.order, pool.num_blocks, pool.dtype)
    assert r0.fingerprint() != r1.fingerprint()  # a rank's bytes are its own heads
    assert r0.compat_fingerprint() == r1.compat_fingerprint()


def test_a_rank_layout_is_the_pool_at_tp1_and_for_a_replicated_latent() -> None:
    pool = pool_layout()
    assert rank_layout(pool, TPShard()) is pool
    mla = KVLayout.mla(num_blocks=4, block_size=BS, num_layers=1, latent_dim=16, rope_dim=8)
    assert rank_layout(mla, TPShard(1, 2, shared=True)) is mla
    assert rank_layout(mla, TPShard(1, 2)) is mla  # one latent "head": nothing to place


# -- rank_settings -------------------------------------------------------------------------------
def settings(**extra: object) -> PDSettings:
    s = pd_settings(pd_config({"pd_transport": "tcp", "pd_insecure": True, **extra}, {}), {})
    assert s is not None
    return s


def test_rank_settings_shift_a_fixed_port_and_name_the_rank() -> None:
    s = settings(pd_bind="tcp://127.0.0.1:7000", pd_name="pre")
    got = rank_settings(s, TPShard(1, 2))
    assert (got.bind, got.name) == ("tcp://127.0.0.1:7001", "pre.tp1of2")
    assert got == dataclasses.replace(s, bind="tcp://127.0.0.1:7001", name="pre.tp1of2")
    r0 = rank_settings(s, TPShard(0, 2))
    assert (r0.bind, r0.name) == ("tcp://127.0.0.1:7000", "pre.tp0of2")


def test_rank_settings_keep_an_ephemeral_port_and_tp1() -> None:
    s = settings(pd_name="pre")
    assert rank_settings(s, TPShard(1, 2)).bind == "tcp://127.0.0.1:0"
    assert rank_settings(s, TPShard()) is s


def test_a_rank_port_past_65535_is_a_config_error() -> None:
    s = settings(pd_bind="tcp://127.0.0.1:65535")
    with pytest.raises(ConfigError, match="rank 1 would bind port 65536"):
        rank_settings(s, TPShard(1, 2))


# -- refusals ------------------------------------------------------------------------------------
def test_unequal_tp_is_a_one_line_unsupported_error_naming_issue_31() -> None:
    assert tp_refusal(2, 2) is None and tp_refusal(1, 1) is None
    err = tp_refusal(1, 2)
    assert isinstance(err, UnsupportedError) and str(err) == REFUSAL
    assert "\n" not in str(tp_refusal(4, 2))


def info(layout: KVLayout) -> LayoutInfo:
    return LayoutInfo.from_description(layout.describe())


def test_a_peer_of_another_tp_size_is_refused_at_the_handshake_naming_issue_31() -> None:
    rank0 = rank_layout(pool_layout(kv_heads=1), TPShard(0, 2))  # a TP 2 decode's rank 0
    tp1 = pool_layout(kv_heads=2)  # a TP 1 prefill: both heads
    assert str(heads_refusal(rank0, info(tp1), sender=False)) == REFUSAL
    assert str(heads_refusal(tp1, info(rank0), sender=True)) == REFUSAL
    assert heads_refusal(rank0, info(rank0), sender=False) is None
    assert heads_refusal(tp1, info(tp1), sender=True) is None


def test_the_same_tp_size_but_another_rank_names_both_head_ranges() -> None:
    r0, r1 = (rank_layout(pool_layout(), TPShard(r, 2)) for r in (0, 1))
    err = heads_refusal(r0, info(r1), sender=True)
    assert isinstance(err, UnsupportedError)
    assert str(err) == (
        "the PD peer's rank holds KV heads [1, 2) of 2, this rank [0, 1): rank r pairs only "
        "with rank r"
    )


# -- abandon_peers -------------------------------------------------------------------------------
A2, A3 = "tcp://127.0.0.1:7003", "tcp://127.0.0.1:7004"


def refused(*addresses: str) -> RecvOp:
    ranks = addresses if len(addresses) > 1 else ()
    return RecvOp("d", "s", addresses[0], KEY, 0, 0, (), "refused", ranks)


def test_each_ranks_session_has_its_own_id_and_rank_0s_is_the_transfers() -> None:
    assert [rank_session("p1", r) for r in range(3)] == ["p1", "p1.rank1", "p1.rank2"]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "told"),
    [
        (2, 1, [(0, 1)]),  # a TP 1 decode tells both ranks of a TP 2 prefill
        (1, 2, [(0,), ()]),  # rank 1 of a TP 2 decode has no TP 1 prefill rank to tell
        (2, 2, [(0,), (1,)]),  # equal TP (a prompt mismatch): rank r tells rank r
        (4, 2, [(0, 2), (1, 3)]),
        (2, 4, [(0,), (1,), (), ()]),
        (1, 1, [(0,)]),
    ],
)
def test_a_refusing_decode_engines_ranks_tell_every_prefill_rank_once(
    prefill_tp: int, decode_tp: int, told: list[tuple[int, ...]]
) -> None:
    addresses = (A0, A1, A2, A3)[:prefill_tp]
    op = refused(*addresses)
    got = [abandon_peers(op, TPShard(r, decode_tp)) for r in range(decode_tp)]
    assert got == [tuple((addresses[i], rank_session("s", i)) for i in t) for t in told]
    assert sorted(i for t in told for i in t) == list(range(prefill_tp))


# -- RankResults ---------------------------------------------------------------------------------
def test_a_transfer_is_done_once_every_rank_reported() -> None:
    t = RankResults(2)
    assert t.add(PDResult("r", "recv", True, "success", rank=1)) == (None, False)
    assert t.waiting == 1
    assert t.add(PDResult("r", "recv", True, "success", rank=0)) == (
        PDResult("r", "recv", True, "success"),
        False,
    )
    assert t.waiting == 0


def test_the_first_failed_rank_fails_the_transfer_and_is_flagged_once() -> None:
    t = RankResults(3)
    assert t.add(PDResult("r", "send", True, "ok", rank=0)) == (None, False)
    assert t.add(PDResult("r", "send", False, "lease", rank=2)) == (None, True)
    assert t.add(PDResult("r", "send", False, "cancelled", rank=1)) == (
        PDResult("r", "send", False, "rank 2: lease"),
        False,
    )


def test_a_failure_reported_last_has_no_one_left_to_end() -> None:
    t = RankResults(2)
    t.add(PDResult("r", "recv", True, rank=0))
    assert t.add(PDResult("r", "recv", False, "x", rank=1)) == (
        PDResult("r", "recv", False, "rank 1: x"),
        False,
    )


def test_send_and_receive_of_one_request_are_tallied_apart_and_tp1_passes_through() -> None:
    t = RankResults(2)
    assert t.add(PDResult("r", "send", True, rank=0)) == (None, False)
    assert t.add(PDResult("r", "recv", True, rank=0)) == (None, False)
    assert t.waiting == 2
    one = PDResult("r", "recv", False, "x")
    assert RankResults(1).add(one) == (one, False)


def test_a_rank_twice_or_outside_the_group_is_refused() -> None:
    t = RankResults(2)
    t.add(PDResult("r", "send", True, rank=0))
    with pytest.raises(InvalidArgumentError, match="rank 0 reported PD"):
        t.add(PDResult("r", "send", True, rank=0))
    with pytest.raises(InvalidArgumentError, match=r"PDResult\.rank"):
        t.add(PDResult("r", "send", True, rank=2))


# -- params naming every rank --------------------------------------------------------------------
def test_params_name_every_rank_only_at_tp_above_1() -> None:
    assert address_params([A0]) == {"kvplane_pd": A0}
    assert address_params([A0, A1]) == {"kvplane_pd": A0, "kvplane_pd_ranks": [A0, A1]}
    params = decode_params("s", [A0, A1], PROMPT, "e")
    got = parse_params(params)
    assert got == RecvParams("s", A0, 10, KEY, (A0, A1))
    assert isinstance(got, RecvParams) and got.prefill_tp == 2
    tp1 = parse_params(decode_params("s", [A0], PROMPT, "e"))
    assert isinstance(tp1, RecvParams) and (tp1.rank_addresses, tp1.prefill_tp) == ((), 1)


@pytest.mark.parametrize(
    "ranks", [[A0], [A1, A0], [A0, "udp://x:1"], "tcp://127.0.0.1:1", [A0] * 65, [A0, 7]]
)
def test_bad_rank_addresses_are_refused(ranks: object) -> None:
    params = {**decode_params("s", [A0], PROMPT, "e"), "kvplane_pd_ranks": ranks}
    with pytest.raises(InvalidArgumentError, match="kvplane_pd_ranks"):
        parse_params(params)


def test_a_receive_names_each_decode_rank_its_prefill_rank() -> None:
    op = RecvOp("d", "s", A0, KEY, 12, 0, (1, 2, 3), rank_addresses=(A0, A1))
    assert (op.peer(0), op.peer(1), op.peer(2)) == (A0, A1, None)
    tp1 = RecvOp("d", "s", A0, KEY, 12, 0, (1, 2, 3))
    assert (tp1.peer(0), tp1.peer(1)) == (A0, None)


# -- one engine's decisions for two ranks --------------------------------------------------------
def sched2() -> tuple[PDScheduler, MetricsRegistry]:
    m = MetricsRegistry()
    s = PDScheduler(BS, m, tp_size=2)
    s.set_endpoint([A0, A1], "prefill")
    return s, m


def held(s: PDScheduler) -> bool:
    return s.pending_push_work


def requests(m: MetricsRegistry, role: str, outcome: str) -> float:
    return m.value("vllm_pd_requests", {"role": role, "outcome": outcome}, "_total")


def decode_req(*addresses: str) -> PDRequest:
    ranks = addresses if len(addresses) > 1 else ()
    return PDRequest("d1", PROMPT, RecvParams("s1", addresses[0], 10, KEY, ranks))


def test_a_tp2_decode_receives_from_both_prefill_ranks_and_ends_when_both_did() -> None:
    s, m = sched2()
    req = decode_req(A0, A1)
    assert s.matched(req, 0) == (9, True)
    s.allocated(req, [5, 6, 7, 8], 9)
    want = RecvOp("d1", "s1", A0, KEY, 12, 0, (5, 6, 7), rank_addresses=(A0, A1))
    assert s.build() == PDStep(recvs=[want])
    s.apply([PDResult("d1", "recv", True, "success", rank=1)])
    assert requests(m, "recv", "ok") == 0  # rank 0 still receiving
    s.apply([PDResult("d1", "recv", True, "success", rank=0)])
    assert requests(m, "recv", "ok") == 1
    assert m.value("vllm_pd_tokens", {"role": "recv"}, "_total") == 9
    assert s.build() == PDStep()
    assert s.finished(req, "d1") == (False, None)
    s.check_integrity()


def test_a_tp2_decode_refuses_a_tp1_prefills_params_and_abandons_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s, m = sched2()
    assert s.matched(decode_req(A0), 0) == (0, False)
    assert requests(m, "recv", "tp_mismatch") == 1
    assert s.build() == PDStep(recvs=[RecvOp("d1", "s1", A0, KEY, 0, 0, (), REFUSAL)])
    assert REFUSAL in caplog.text
    tp1 = PDScheduler(BS, MetricsRegistry())
    assert tp1.matched(decode_req(A0, A1), 0) == (0, False)  # and the other way round
    (abandon,) = tp1.build().recvs
    assert abandon.abandon.startswith("PD from a prefill engine at TP 2 to a decode engine at TP 1")
    assert abandon.rank_addresses == (A0, A1)  # decode rank 0 tells both prefill ranks


def test_one_ranks_failed_receive_ends_the_others_and_fails_the_request() -> None:
    s, m = sched2()
    req = decode_req(A0, A1)
    s.matched(req, 0)
    s.allocated(req, [5, 6, 7], 9)
    s.build()
    s.apply([PDResult("d1", "recv", False, "lost the peer", rank=1)])
    assert s.build() == PDStep(ends=[EndOp("d1", "rank 1's recv failed: lost the peer")])
    s.apply([PDResult("d1", "recv", False, "cancelled", rank=0)])
    assert requests(m, "recv", "failed") == 1 and requests(m, "recv", "ok") == 0
    assert s.build() == PDStep()  # ended once
    s.check_integrity()


def test_a_tp2_prefill_names_every_rank_and_holds_its_blocks_until_both_sent() -> None:
    s, m = sched2()
    req = PDRequest("p1", PROMPT, SendParams(None))
    s.scheduled(req, 10, [1, 2, 3])
    s.build()
    done, params = s.finished(req, "p1")
    assert done is True and params is not None
    assert (params["kvplane_pd"], params["kvplane_pd_ranks"]) == (A0, [A0, A1])
    s.apply([PDResult("p1", "send", True, rank=0)])
    assert held(s)  # rank 1 may still read the blocks
    with pytest.raises(UnsupportedError, match="1 partly reported"):
        s.check_integrity()
    s.apply([PDResult("p1", "send", True, rank=1)])
    assert not held(s)
    assert requests(m, "send", "ok") == 1
    s.check_integrity()


def test_a_failed_rank_send_stops_the_prefills_slices_on_every_rank() -> None:
    s, m = sched2()
    req = PDRequest("p1", PROMPT, SendParams(None))
    s.scheduled(req, 4, [1])
    s.build()
    s.apply([PDResult("p1", "send", False, "lease expired", rank=0)])
    assert s.build() == PDStep(ends=[EndOp("p1", "rank 0's send failed: lease expired")])
    s.scheduled(req, 8, [1, 2])  # vLLM goes on computing: no more slices
    assert s.build() == PDStep()
    done, _ = s.finished(req, "p1")  # vLLM ends it: its blocks wait for rank 1's session
    assert done is True and held(s)
    s.apply([PDResult("p1", "send", False, "cancelled", rank=1)])
    assert not held(s) and requests(m, "send", "failed") == 1
    s.check_integrity()
