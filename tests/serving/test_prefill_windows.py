"""The prefill side keeps a window group's blocks only while something reads them: a tiny
random transformers Qwen2 (sliding, full, sliding; window 8) served with KV cache groups,
prefilled in steps of 8 through a real prefill worker (blocks of 4) and decoded by a real
decode worker behind a router. After each step the window group holds exactly the blocks from
the next step's window on; with prefix offload the chunks its store reads stay until the store
is issued, and the cascade's fence keeps them until it ends; tokens equal transformers', and
every pool balances. Unit level: a slice and the decode side's admission never reach a block
the prefill dropped."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.blocks import BlockTable, drop_windows
from kvplane.ids import SessionId, TokenRange
from kvplane.offload import OffloadConfig
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
# after the step ending at e the next one reads from window_start(e) = e + 1 - 8: the blocks
# wholly before it, (e - 7) // 4, are dropped; 12 - 0, 12 - 2, ..., 12 - 9 stay (the last 3:
# the final window [38, 45), all a slice ever sends of the window group)
WINDOW_HELD = [12, 10, 8, 6, 4, 3]


class Recording(PrefillWorker):
    """A real prefill worker that notes, on its loop, each request's held blocks per KV cache
    group and each pool's used blocks after every step, and each pool's used blocks against
    what live requests' tables hold whenever a prefix store ends."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.after: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.store_ends: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def _step(self, req: PrefillRequest) -> None:
        super()._step(req)
        held = tuple(t.num_held_blocks for t in req.tables)
        used = tuple(p.num_used_blocks for p in self.pools.block_pools)
        self.after.append((req.order.request_id, held, used))

    def _on_offload(self, events: list[Finished]) -> None:
        super()._on_offload(events)
        if any(isinstance(ev, StoreFinished) for ev in events):
            live = [r.tables for r in self._requests.values() if r.table is not None]
            held = tuple(sum(ts[g].num_held_blocks for ts in live) for g in range(2))
            used = tuple(p.num_used_blocks for p in self.pools.block_pools)
            self.store_ends.append((held, used))


class Cluster:
    def __init__(self, root: Path, offload: PrefixSettings | None) -> None:
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
            ModelProducer.from_spec(spec), offload=offload,
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


def test_the_window_group_holds_only_the_next_window_after_each_step(plain: Cluster) -> None:
    pools = plain.prefill.pools
    assert [p.layout.layer_ids for p in pools.kv.pools] == [(0, 2), (1,)]
    plain.run("r", _prompt(1))
    assert plain.prefill.after == [
        ("r", (w, PROMPT_BLOCKS), (w, PROMPT_BLOCKS)) for w in WINDOW_HELD
    ]
    check_balanced(plain.router)
    plain.prefill.pools.check_idle()
    plain.decode.pools.check_idle()
    assert [p.num_free_blocks for p in pools.block_pools] == [31, 32]  # the null block: 1


def test_a_store_keeps_its_blocks_until_it_ends_then_they_are_freed(offloaded: Cluster) -> None:
    prefill = offloaded.prefill
    offloaded.run("a", _prompt(2))
    # the store (5 chunks of 8: blocks 0-9) is issued after the last step: until then nothing
    # is dropped; then the table keeps the final window's 3 blocks and the fence blocks 0-9
    assert prefill.after == [("a", (12, 12), (12, 12))] * 5 + [("a", (3, 12), (12, 12))]
    check_balanced(offloaded.router)
    assert prefill.store_ends and all(held == used for held, used in prefill.store_ends)
    # the stored chunks are the prompt's KV: a prompt sharing its 40 tokens loads them (the
    # window group only the chunk its window reads) and is token-exact
    off = prefill.offload
    assert off is not None and off.counts["chunks_stored"] == 5
    offloaded.run("b", [*_prompt(2)[:40], *_prompt(3, 7)])
    assert off.hits["host"] == 1 and off.members[0].hits["host"] == 5
    check_balanced(offloaded.router)
    prefill.pools.check_idle()
    off.check_integrity()


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
