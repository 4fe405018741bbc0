"""Sliding windows in the connector's decisions, without vLLM: vLLM's window rule
(:class:`KVWindow`), reading it from a KV cache group's spec, the fences on freed blocks, and
what the scheduler side and the PD scheduler load, store, fence and receive when vLLM's table
holds null blocks (id 0) before the window.

Block size 4, chunks of 2 blocks (8 tokens), window 8 tokens unless a test says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from kvplane.errors import InvalidArgumentError, UnsupportedError
from kvplane.integrations.vllm.config import parse_extra_config
from kvplane.integrations.vllm.fences import Fences
from kvplane.integrations.vllm.messages import JobReport, LoadOp, RecvOp, TierIndex, WorkerReport
from kvplane.integrations.vllm.pd_params import RecvParams, prompt_key
from kvplane.integrations.vllm.pd_scheduler import PDRequest, PDScheduler, PDStep
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest, SchedulerSide
from kvplane.integrations.vllm.windows import (
    KVWindow,
    first_kept_block,
    freed_any,
    holds_null,
    spec_window,
)
from kvplane.metrics import MetricsRegistry

FP = b"f" * 16
TOKENS = list(range(1, 21))  # 20 tokens: 2 full chunks, a 3rd partial


# -- vLLM's rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("computed", "skipped", "block"),
    [(0, 0, 0), (7, 0, 0), (8, 1, 0), (12, 5, 1), (16, 9, 2), (20, 13, 3)],
)
def test_the_window_skips_what_the_next_token_cannot_read(
    computed: int, skipped: int, block: int
) -> None:
    w = KVWindow(8, 4)  # the token at p reads (p - 8, p]
    assert w.skipped_tokens(computed) == skipped
    assert w.first_kept_block(computed) == block == first_kept_block(w, computed)
    assert first_kept_block(None, computed) == 0


def test_retained_tokens_keep_blocks_below_the_window() -> None:
    assert KVWindow(8, 4, retained=4).first_kept_block(16) == 1
    with pytest.raises(InvalidArgumentError, match="sliding window must be an int >= 2"):
        KVWindow(1, 4)
    with pytest.raises(InvalidArgumentError, match="extra retained tokens must be an int >= 0"):
        KVWindow(8, 4, retained=-1)


def test_null_and_freed_blocks() -> None:
    assert holds_null([3, 0]) and not holds_null([3, 4])
    assert not freed_any([0, 0, 5, 6], [2, 3], [5, 6])
    assert freed_any([0, 0, 5, 6], [0, 1], [1, 2])  # nulled
    assert freed_any([0, 0, 3, 4, 2, 1], [0, 1], [1, 2])  # nulled, then reused further on
    assert freed_any([5], [1], [6])  # past the table: a preempted request's new table


# -- reading vLLM's KV cache groups (class names, as vLLM's kv_cache_interface) -------------------
@dataclass
class AttentionSpec:
    block_size: int = 4


@dataclass
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None  # vLLM's promoted window layers keep it


@dataclass
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 8
    extra_retained_tokens: int = 0


class SlidingWindowMLASpec(SlidingWindowSpec):
    pass


class MambaSpec(AttentionSpec):
    pass


@dataclass
class UniformTypeKVCacheSpecs:
    first_spec: object


def test_a_window_spec_gives_the_window_and_a_full_one_none() -> None:
    assert spec_window(SlidingWindowSpec(4, 64, 2)) == KVWindow(64, 4, 2)
    assert spec_window(SlidingWindowMLASpec()) == KVWindow(8, 4)
    assert spec_window(UniformTypeKVCacheSpecs(SlidingWindowSpec())) == KVWindow(8, 4)
    assert spec_window(FullAttentionSpec(4, 64)) is None  # vLLM keeps every block


def test_unfollowed_specs_are_refused() -> None:
    with pytest.raises(UnsupportedError, match="does not support MambaSpec layers"):
        spec_window(MambaSpec())


def test_fences_count_each_job_once() -> None:
    f = Fences()
    f.fence(1, [3, 4])
    f.fence(1, [3, 4])
    f.fence(2, [4])
    assert f.blocks == [3, 4] and f.hit([9, 4]) and not f.hit([5])
    f.release(1, [3, 4])
    assert f.blocks == [4]
    f.release(1, [3, 4])  # not fenced any more: nothing
    f.release(2, [4])
    assert not f and f.blocks == []


# -- the scheduler side --------------------------------------------------------------------------
def side(tmp_path: Path, window: int | None) -> SchedulerSide:
    config = parse_extra_config({"blocks_per_chunk": 2, "host_slots": 8}, {})
    kv = None if window is None else KVWindow(window, 4)
    s = SchedulerSide(config, 4, MetricsRegistry(), window=kv)
    s.set_index(TierIndex(FP, 128))
    return s


def stored(s: SchedulerSide, tokens: list[int], blocks: list[int]) -> None:
    """Request ``a`` computes ``tokens`` into ``blocks``; its gathers reported done."""
    a = RequestView("a", tokens)
    s.allocated(a, blocks, 0)
    meta = s.build_step([ScheduledRequest(a, len(tokens), blocks)])
    s.apply(WorkerReport(tuple(JobReport(op.job_id, "host", (True,) * 2) for op in meta.stores)))
    s.finished("a")


@pytest.mark.parametrize(
    ("window", "table", "want"),
    [
        (None, [21, 22, 23, 24, 25], (0, 0, (21, 22, 23, 24))),  # every block
        (8, [0, 0, 23, 24, 25], (1, 0, (23, 24))),  # blocks 0-1 left the window of token 16
        (12, [0, 22, 23, 24, 25], (0, 1, (22, 23, 24))),  # block 1 is still in it
    ],
)
def test_a_load_writes_only_the_blocks_vllm_holds(
    tmp_path: Path, window: int | None, table: list[int], want: tuple[int, int, tuple[int, ...]]
) -> None:
    """(first chunk, blocks skipped in it, blocks written) of the load."""
    s = side(tmp_path, window)
    stored(s, TOKENS, [1, 2, 3, 4, 5])
    b = RequestView("b", [*TOKENS[:16], 99, 98])
    assert s.matched_tokens(b, 0) == 16  # the hit claims every token: vLLM reads the window
    op = s.allocated(b, table, 16)
    assert isinstance(op, LoadOp)
    assert (op.first_chunk, op.skip_blocks, op.block_ids) == want
    assert len(op.keys) == 2 - want[0]


def test_a_chunk_holding_a_freed_block_is_never_stored(tmp_path: Path) -> None:
    s = side(tmp_path, 8)
    a = RequestView("a", TOKENS)
    s.allocated(a, [0, 0, 3, 4, 5], 0)  # chunked prefill: blocks 0-1 already left the window
    (op,) = s.build_step([ScheduledRequest(a, 20, [0, 0, 3, 4, 5], 8)]).stores
    assert op.block_ids == (3, 4) and len(op.keys) == 1  # chunk 1 only


def test_a_gather_whose_blocks_left_the_window_is_fenced(tmp_path: Path) -> None:
    s = side(tmp_path, 8)
    long = list(range(1, 33))
    a = RequestView("a", long)
    s.allocated(a, [1, 2, 3, 4, 5, 6, 7, 8], 0)
    meta = s.build_step([ScheduledRequest(a, 16, [1, 2, 3, 4, 5, 6, 7, 8])])  # chunks 0, 1
    assert [o.block_ids for o in meta.stores] == [(1, 2, 3, 4)]
    # next step: vLLM freed blocks 0-1 (token 16's window starts at 9) and gave them to `a`
    # again further on; the forward writes them while the first gather may still read them
    table = [0, 0, 3, 4, 2, 1, 7, 8]
    meta = s.build_step([ScheduledRequest(a, 24, table, 16)])
    assert s.fenced_blocks == [1, 2, 3, 4] and meta.flush
    s.apply(WorkerReport((JobReport(1, "host", (True, True)),)))
    assert s.fenced_blocks == []


def test_without_a_window_a_kept_table_fences_nothing(tmp_path: Path) -> None:
    s = side(tmp_path, None)
    a = RequestView("a", list(range(1, 33)))
    table = [1, 2, 3, 4, 5, 6, 7, 8]
    s.allocated(a, table, 0)
    s.build_step([ScheduledRequest(a, 16, table)])
    assert not s.build_step([ScheduledRequest(a, 24, table, 16)]).flush
    assert s.fenced_blocks == []


# -- PD: the decode side receives only the window ------------------------------------------------
@pytest.mark.parametrize(
    ("window", "computed", "prefix"),
    [(None, 0, 0), (8, 0, 8), (4, 0, 12), (16, 0, 0), (8, 12, 12)],
)
def test_a_receive_starts_at_the_first_block_vllm_holds(
    window: int | None, computed: int, prefix: int
) -> None:
    kv = None if window is None else KVWindow(window, 4)
    s = PDScheduler(4, MetricsRegistry(), window=kv)
    prompt = list(range(50, 67))  # 17 tokens: 16 move (4 blocks); token 16 is computed here
    req = PDRequest("d1", prompt, RecvParams("sess-1", "tcp://x:1", 17, prompt_key(prompt)))
    left, _ = s.matched(req, computed)
    table = [9, 8, 7, 6, 5]
    s.allocated(req, table, left)
    want = RecvOp("d1", "sess-1", "tcp://x:1", prompt_key(prompt), 16, prefix, (9, 8, 7, 6))
    assert s.build() == PDStep(recvs=[want])
