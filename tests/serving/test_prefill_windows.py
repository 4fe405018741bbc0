"""The prefill side holds a window group's blocks only while something reads them: a tiny
random transformers Qwen2 (sliding, full, sliding; window 8) served with KV cache groups,
prefilled in steps of 8 through a real prefill worker (blocks of 4) and decoded by a real
decode worker behind a router. The window group's table grows by each step's blocks on a
reservation made at admission, and after each step holds exactly the blocks from the next
step's window on; with prefix offload each step's newly full chunks are stored at once and
their blocks stay until the store ended; tokens equal transformers', a later prompt loads the
per-step stored chunks, a request cancelled mid-prefill returns its blocks and reservation,
and every pool balances. Unit level: a slice and the decode side's admission never reach a
block the prefill dropped."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.blocks import BlockTable, drop_windows, window_peak
from kvplane.ids import RequestId, SessionId, TokenRange
from kvplane.offload import OffloadConfig
from kvplane.pipeline.timeline import Mark
from kvplane.serving import worker_requests as book
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.pools import WorkerPools
from kvplane.serving.prefill_steps import PrefillRequest
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.prefix_offload import Finished, PrefixSettings, StoreFinished
from kvplane.serving.producers.model import ModelDecoder, ModelProducer, ModelSpec
from kvplane.serving.router.router import Router
from kvplane.serving.worker_config import WorkerConfig
from kvplane.testing.cluster import FAST, TEST_SECRET, check_balanced
from kvplane.transfer.resharding import KVBox, window_boxes

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

WINDOW, BS, STEP, NEW, N = 8, 4, 8, 4, 45
TYPES = ("sliding_attention", "full_attention", "sliding_attention")
PROMPT_BLOCKS = -(-N // BS)  # 12
ENDS = (8, 16, 24, 32, 40, 45)
# the step [s, e) grows the window group's table to ceil(e / 4) blocks, from the blocks wholly
# before window_start(s) = s + 1 - 8 on: 2 for the first, then 4 (the whole prompt's 12 before
# blocks were taken step by step); after it the next one reads from window_start(e): the blocks
# wholly before it, (e - 7) // 4, are dropped and 2 stay, then 3 (the final window [38, 45),
# all a slice ever sends of the window group)
WINDOW_DURING = [2, 4, 4, 4, 4, 4]
WINDOW_HELD = [2, 2, 2, 2, 2, 3]
# reserved at admission: window_peak (steps of 8, window 8: 15 positions, 5 blocks; with stores
# of 8-token chunks, one in flight: 23 positions, 7 blocks) less what the table holds, at most
# what it lacks of the prompt's 12 blocks
PEAK, PEAK_STORED = 5, 7


class Recording(PrefillWorker):
    """A real prefill worker that notes, on its loop, for each step of a request: its held
    blocks per KV cache group and the pools' used and reserved blocks while it computes and
    after it (with prefix offload, once the step's store ended: its counts are exact), and
    each pool's used blocks against what live requests' tables hold whenever a prefix store
    ends; ``cancel_after``: cancel a request after that many steps."""

    def __init__(self, *args: Any, cancel_after: int | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.cancel_after = cancel_after
        self.during: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.after: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.store_ends: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def _counts(self, req: PrefillRequest) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        held = tuple(t.num_held_blocks for t in req.tables)
        used = tuple(p.num_used_blocks for p in self.pools.block_pools)
        reserved = tuple(p.num_reserved_blocks for p in self.pools.block_pools)
        assert reserved == tuple(t.num_reserved_blocks for t in req.tables)
        return req.order.request_id, held, used + reserved

    def _grow(self, req: PrefillRequest, rng: TokenRange) -> bool:
        grown = super()._grow(req, rng)
        if grown:
            self.during.append(self._counts(req))
        return grown

    def _step(self, req: PrefillRequest) -> None:
        super()._step(req)
        while self.offload is not None and self.offload.busy:  # the step's store ends
            self._on_offload(self.offload.wait(0.01))
        if req.table is not None:
            self.after.append(self._counts(req))
        if self.cancel_after == req.next_step:
            self._cancel(RequestId(req.order.request_id), "cancelled mid-prefill")

    def _on_offload(self, events: list[Finished]) -> None:
        super()._on_offload(events)
        if any(isinstance(ev, StoreFinished) for ev in events):
            live = [r.tables for r in self._requests.values() if r.table is not None]
            held = tuple(sum(ts[g].num_held_blocks for ts in live) for g in range(2))
            used = tuple(p.num_used_blocks for p in self.pools.block_pools)
            self.store_ends.append((held, used))


class Cluster:
    def __init__(
        self, root: Path, offload: PrefixSettings | None, cancel_after: int | None = None
    ) -> None:
        torch.manual_seed(52)
        cfg = transformers.Qwen2Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            use_sliding_window=True, sliding_window=WINDOW, layer_types=list(TYPES),
        )  # fmt: skip
        self.hf = transformers.Qwen2ForCausalLM(cfg).eval()
        self.hf.save_pretrained(root)
        spec = ModelSpec(str(root), kv_groups=True)
        common = dict(num_blocks=32, num_slots=4, timings=FAST, slice_timeout_s=5.0,
                      secret=TEST_SECRET)  # fmt: skip
        self.prefill = Recording(
            WorkerConfig(name="prefill", block_size=BS, step_size=STEP, **common),  # type: ignore[arg-type]
            ModelProducer.from_spec(spec), offload=offload, cancel_after=cancel_after,
        )  # fmt: skip
        self.decode = DecodeWorker(
            WorkerConfig(name="decode", block_size=BS, **common),  # type: ignore[arg-type]
            ModelDecoder.from_spec(spec),
        )
        self.prefill.start()
        self.decode.start()
        self.router = Router(
            [self.prefill.address], [self.decode.address], timeout_s=30.0, secret=TEST_SECRET
        )
        self.router.connect()

    def greedy(self, tokens: list[int]) -> list[int]:
        ids = torch.tensor([tokens])
        with torch.no_grad():
            out = self.hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        return [int(t) for t in out[0, len(tokens) :]]

    def run(self, rid: str, tokens: list[int]) -> None:
        res = self.router.generate(rid, tokens, max_new_tokens=NEW)
        assert res.state == "success", res.reason
        assert list(res.tokens) == self.greedy(tokens)

    def close(self) -> None:
        self.router.close()
        self.prefill.close()
        self.decode.close()


def _prompt(seed: int, n: int = N) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 128, n)]


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path / "qwen2", None)
    yield cluster
    cluster.close()


@pytest.fixture
def offloaded(tmp_path: Path) -> Iterator[Cluster]:
    host = OffloadConfig(host_slots=8, admission_min_lookups=0, pin_memory=False)
    cluster = Cluster(tmp_path / "qwen2", PrefixSettings(host, 2))  # chunks of 2 blocks: 8
    yield cluster
    cluster.close()


def _expected(
    rid: str, window: list[int], peak: int
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Per step: the window group's held blocks, the full group's 12; the pools' used blocks
    the same, then their reservations: the window group's peak less what it holds, at most
    what it lacks of the 12 (after the last step's growth: none), the full group's none."""
    ends = iter(ENDS)
    lacking = [PROMPT_BLOCKS - -(-e // BS) for e in ENDS]
    return [
        (rid, (w, PROMPT_BLOCKS), (w, PROMPT_BLOCKS, max(0, min(peak - w, lack)), 0))
        for w, lack, _e in zip(window, lacking, ends, strict=True)
    ]


def test_the_window_group_grows_by_each_step_and_holds_only_the_next_window(
    plain: Cluster,
) -> None:
    pools = plain.prefill.pools
    assert [p.layout.layer_ids for p in pools.kv.pools] == [(0, 2), (1,)]
    window = pools.kv.pools[0].layout
    assert window_peak(window, N, BS, STEP) == PEAK
    plain.run("r", _prompt(1))
    assert plain.prefill.during == _expected("r", WINDOW_DURING, PEAK)
    assert plain.prefill.after == _expected("r", WINDOW_HELD, PEAK)
    assert max(held[0] for _r, held, _u in plain.prefill.during) == 4  # was 12: the prompt's
    check_balanced(plain.router)
    plain.prefill.pools.check_idle()
    plain.decode.pools.check_idle()
    assert [p.num_free_blocks for p in pools.block_pools] == [31, 32]  # the null block: 1
    assert [p.num_reserved_blocks for p in pools.block_pools] == [0, 0]


def test_each_step_stores_its_chunks_and_a_later_prompt_loads_them(offloaded: Cluster) -> None:
    prefill = offloaded.prefill
    off = prefill.offload
    assert off is not None and off.store_unit == 8
    offloaded.run("a", _prompt(2))
    # the steps ending at 8, ..., 40 each complete one chunk of 8 (two blocks), stored at once:
    # once each store ended the counts are those without offload (its reservation: 7 blocks)
    assert prefill.during == _expected("a", WINDOW_DURING, PEAK_STORED)
    assert prefill.after == _expected("a", WINDOW_HELD, PEAK_STORED)
    starts = [e.detail for e in prefill.timeline.events("a") if e.mark == Mark.STORE_START.value]
    assert starts == ["1"] * 5
    check_balanced(offloaded.router)
    assert prefill.store_ends and all(held == used for held, used in prefill.store_ends)
    assert off.counts["chunks_stored"] == 5 and off.counts["store_jobs"] == 5
    assert off.members[0].counts["chunks_stored"] == 5
    # the per-step stored chunks are the prompt's KV: a prompt sharing its 40 tokens loads them
    # (the window group only the chunk its window reads) and is token-exact; nothing it loaded
    # is stored again
    offloaded.run("b", [*_prompt(2)[:40], *_prompt(3, 7)])
    assert off.hits["host"] == 1 and off.members[0].hits["host"] == 5
    assert off.counts["chunks_stored"] == 5 and off.members[0].counts["chunks_stored"] == 5
    check_balanced(offloaded.router)
    prefill.pools.check_idle()
    assert [p.num_reserved_blocks for p in prefill.pools.block_pools] == [0, 0]
    off.check_integrity()


def test_a_request_cancelled_mid_prefill_returns_its_blocks_and_reservation(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path / "qwen2", None, cancel_after=2)
    try:
        res = cluster.router.generate("c", _prompt(5), max_new_tokens=NEW)
        assert res.state != "success"
        assert cluster.prefill.after == _expected("c", WINDOW_HELD, PEAK)[:2]
        check_balanced(cluster.router)
        pools = cluster.prefill.pools
        pools.check_idle()
        assert [p.num_reserved_blocks for p in pools.block_pools] == [0, 0]
        cluster.prefill.cancel_after = None
        cluster.run("d", _prompt(6))  # the pools serve the next request in full
        pools.check_idle()
        cluster.decode.pools.check_idle()
    finally:
        cluster.close()


@dataclass(eq=False)
class _Held:
    """A request record as the book's shared rules read and write it."""

    tokens: np.ndarray
    order: Any = field(default_factory=lambda: SimpleNamespace(request_id="u"))
    sid: SessionId = field(default_factory=lambda: SessionId("s"))
    table: BlockTable | None = None
    group_tables: tuple[BlockTable, ...] = ()
    slot: int | None = None
    failed_at: float | None = None


def _release(pools: WorkerPools, req: _Held) -> None:
    assert req.table is not None and req.slot is not None
    for table, pool in zip((req.table, *req.group_tables), pools.block_pools, strict=True):
        table.release(pool)
    pools.free_slot(req.slot)


def test_no_slice_and_no_decode_block_reaches_a_dropped_block(plain: Cluster) -> None:
    """Every drop position ``window_start(e)`` is at most the final window's start: the first
    position a slice of the window group sends (``window_boxes``) and the first the decode
    side admits a block for (``admit_memory(received=True)``: earlier entries are its null
    block, so ``destination_ids`` name none of them)."""
    pools, decode = plain.prefill.pools, plain.decode.pools
    window = pools.kv.pools[0].layout
    final = window.window_start(N)
    assert max(window.window_start(e) for e in ENDS) == final == 38
    box = KVBox(window.head_range, window.layer_ids, TokenRange(0, N))
    assert [b.tokens.start for b in window_boxes(window, box, N)] == [final]
    tokens = np.asarray(_prompt(4), dtype=np.int64)
    received = _Held(tokens)
    assert book.admit_memory(decode, BS, received, received=True) is not None
    ids = book.destination_ids(decode, received)[:PROMPT_BLOCKS]  # the window group's
    null = decode.block_pools[0].null_block
    assert ids[: final // BS] == (null,) * 9 and null not in ids[final // BS :]
    sender = _Held(tokens)  # the prefill side, dropping after every step: all from 38 held
    assert book.admit_memory(pools, BS, sender) is not None
    assert sender.table is not None
    tables = (sender.table, *sender.group_tables)
    layouts = [kv.layout for kv in pools.kv.pools]
    freed = [drop_windows(tables, pools.block_pools, layouts, end) for end in ENDS]
    assert freed == [0, 2, 2, 2, 2, 1]
    assert sender.table.num_dropped_blocks == final // BS == 9
    _release(decode, received)
    _release(pools, sender)
    pools.check_idle()
    decode.check_idle()
