"""Helpers for the connector-logic tests: vLLM-shaped KV tensors and a step driver.

:class:`MiniEngine` plays vLLM's side of the connector protocol around the real
:class:`SchedulerSide` and :class:`WorkerSide` (no vLLM involved): it allocates blocks from a
free list (block 0 reserved, as in vLLM), asks for matches, calls the hooks in vLLM's order and
"computes" KV by writing each block's expected content, a deterministic function of the
token prefix ending in that block. Loaded blocks must hold exactly that content.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvplane.integrations.vllm.config import ConnectorConfig, parse_extra_config
from kvplane.integrations.vllm.env import vllm_support
from kvplane.integrations.vllm.messages import StepMeta
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest, SchedulerSide
from kvplane.integrations.vllm.wakeup import end_step
from kvplane.integrations.vllm.worker import WorkerSide
from kvplane.metrics import MetricsRegistry

FINGERPRINT = bytes(range(16))


def require_vllm() -> None:
    """Skip (saying why) without the vLLM environment; fail with ``KVPLANE_REQUIRE_VLLM=1``."""
    reason = vllm_support()
    if reason is None:
        return
    if os.environ.get("KVPLANE_REQUIRE_VLLM") == "1":
        pytest.fail(f"KVPLANE_REQUIRE_VLLM=1 but {reason}")
    pytest.skip(reason)


def vllm_kv_caches(
    num_layers: int = 2,
    num_blocks: int = 16,
    heads: int = 2,
    block_size: int = 4,
    head_dim: int = 4,
) -> dict[str, torch.Tensor]:
    """Per-layer ``[N, H, B, 2D]`` bf16 views of one layer-major buffer, as vLLM's CPU backend."""
    per_layer = num_blocks * heads * block_size * 2 * head_dim
    buf = torch.zeros(num_layers * per_layer, dtype=torch.bfloat16)
    return {
        f"model.layers.{i}.self_attn.attn": buf[i * per_layer : (i + 1) * per_layer].view(
            num_blocks, heads, block_size, 2 * head_dim
        )
        for i in range(num_layers)
    }


def block_content(
    tokens: list[int], block: int, block_size: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """The KV a block "holds" after a forward: a function of every token up to its end."""
    digest = hashlib.blake2b(repr(tokens[: (block + 1) * block_size]).encode(), digest_size=8)
    gen = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
    return torch.randint(-100, 100, shape, generator=gen).to(torch.bfloat16)


def disk_extra(tmp_path: Path, **more: object) -> dict[str, object]:
    """A connector config with host and disk tiers (chunks of 2 blocks) under ``tmp_path``."""
    return {
        "blocks_per_chunk": 2,
        "host_slots": 8,
        "disk_path": str(tmp_path / "chunks.bin"),
        "disk_slots": 8,
        "disk_direct_io": False,
        **more,
    }


def window_spec(
    model: Path, block: int, connector: dict[str, object] | None, **more: object
) -> dict[str, object]:
    """A harness spec of a windowed tiny model (max_model_len 512, 128 tokens a step) with
    ``connector`` (its extra config; None: without it) and ``more`` keys."""
    return {
        "model": str(model), "block_size": block, "max_model_len": 512,
        "max_num_batched_tokens": 128, "connector": connector, **more,
    }  # fmt: skip


@dataclass
class Running:
    view: RequestView
    blocks: list[int]
    loaded: int
    done: bool = False
    failed_blocks: set[int] = field(default_factory=set)


class MiniEngine:
    """Drives one scheduler side and one worker side like vLLM's engine loop (one request per
    step, whole prompt in one forward)."""

    def __init__(
        self,
        extra: dict[str, object],
        tmp: Path | None = None,
        num_blocks: int = 64,
        block_size: int = 4,
    ) -> None:
        self.config: ConnectorConfig = parse_extra_config(extra, {})
        self.kv = vllm_kv_caches(num_blocks=num_blocks, block_size=block_size)
        self.pool = VllmPool.from_kv_caches(self.kv)
        self.block_size = block_size
        self.metrics = MetricsRegistry()
        self.wmetrics = MetricsRegistry()
        self.sched = SchedulerSide(self.config, block_size, self.metrics)
        self.worker = WorkerSide(self.config, self.pool, FINGERPRINT, self.wmetrics)
        self.sched.set_index(self.worker.index)
        self.free = list(range(1, num_blocks))
        self._n = 0

    # -- vLLM's side ---------------------------------------------------------------------------
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.layout_view().shape[1:])

    def layout_view(self) -> torch.Tensor:
        return self.pool.layout.canonical_view(self.pool.tensor)

    def step(self, scheduled: list[ScheduledRequest], preempted: Sequence[str] = ()) -> StepMeta:
        meta = self.sched.build_step(scheduled, list(preempted))
        w = self.worker
        w.begin_step(meta)
        w.start_loads(meta)
        w.wait_loads()
        return meta

    def finish_step(self, meta: StepMeta) -> None:
        w = self.worker
        w.submit_stores(meta)
        w.progress()
        self.sched.apply(w.take_report())

    def idle_step(self) -> None:
        self.finish_step(self.step([]))

    def receive(self, req_id: str, steps: int = 500) -> set[int]:
        """vLLM's idle steps while ``req_id`` waits in ``WAITING_FOR_REMOTE_KVS``, in its hook
        order, until ``get_finished`` names it; returns the failed blocks reported meanwhile."""
        errors: set[int] = set()
        for _ in range(steps):
            meta = self.step([])
            self.worker.submit_stores(meta)
            _, got = end_step([self.worker], [], True, self.worker.wake)
            errors |= self.worker.take_load_errors()
            self.sched.apply(self.worker.take_report())
            if req_id in got:
                return errors
        raise AssertionError(f"{req_id}'s asynchronous load never ended")

    def release(self, r: Running) -> None:
        self.free.extend(r.blocks)

    def run(self, tokens: list[int], req_id: str | None = None) -> Running:
        """Admit, load, compute and finish one request; returns what happened."""
        self._n += 1
        rid = req_id or f"r{self._n}"
        view = RequestView(rid, tokens)
        matched, load_async = self.sched.match(view, 0)
        tries = 0
        while matched is None:
            tries += 1
            assert tries < 50, "ask-again never resolved"
            self.worker.wait(1.0)  # time passes between engine steps
            self.idle_step()
            matched, load_async = self.sched.match(view, 0)
        n_blocks = -(-len(tokens) // self.block_size)
        blocks, self.free = self.free[:n_blocks], self.free[n_blocks:]
        assert len(blocks) == n_blocks, "test pool too small"
        self.sched.allocated(view, blocks, matched)
        if load_async:
            return self.complete(view, blocks, matched, self.receive(rid))
        scheduled = [ScheduledRequest(view, len(tokens), blocks)]
        meta = self.step(scheduled)
        errors = self.worker.take_load_errors()
        r = Running(view, blocks, matched, failed_blocks=set(errors))
        loaded = matched // self.block_size
        first_bad = min((i for i, b in enumerate(blocks) if b in errors), default=n_blocks)
        self.check_blocks(tokens, blocks[: min(loaded, first_bad)])
        if errors:
            # vLLM's forward of this step ran with the failed blocks as context: what it
            # wrote is wrong. It recomputes from the first failed block in the next step.
            garbage = torch.full(self.block_shape(), 7.0, dtype=torch.bfloat16)
            for b in blocks[loaded:]:
                self.layout_view()[b] = garbage
            self.finish_step(meta)
            meta = self.step(scheduled)
            loaded = first_bad
        for i in range(loaded, n_blocks):
            self.layout_view()[blocks[i]] = block_content(
                tokens, i, self.block_size, self.block_shape()
            )
        self.finish_step(meta)
        r.done = True
        self.sched.finished(rid)  # vLLM frees its blocks now; gathers still reading are fenced
        self.release(r)
        return r

    def take_blocks(self, n: int) -> list[int]:
        blocks, self.free = self.free[:n], self.free[n:]
        assert len(blocks) == n, "test pool too small"
        return blocks

    def complete(
        self, view: RequestView, blocks: list[int], matched: int, errors: set[int]
    ) -> Running:
        """The rest of :meth:`run` once an asynchronous load ended with ``errors``: vLLM
        schedules the request from its first failed block (no forward ever read a bad one)."""
        tokens = list(view.token_ids)
        r = Running(view, blocks, matched, failed_blocks=errors)
        first_bad = min((i for i, b in enumerate(blocks) if b in errors), default=len(blocks))
        loaded = min(matched // self.block_size, first_bad)
        self.check_blocks(tokens, blocks[:loaded])
        meta = self.step([ScheduledRequest(view, len(tokens), blocks, loaded * self.block_size)])
        for i in range(loaded, len(blocks)):
            self.layout_view()[blocks[i]] = block_content(
                tokens, i, self.block_size, self.block_shape()
            )
        self.finish_step(meta)
        r.done = True
        self.sched.finished(view.req_id)
        self.release(r)
        return r

    def check_blocks(self, tokens: list[int], blocks: list[int]) -> None:
        view_all = self.layout_view()
        for i, b in enumerate(blocks):
            want = block_content(tokens, i, self.block_size, self.block_shape())
            assert torch.equal(view_all[b], want), f"block {i} (pool block {b}) holds wrong KV"

    def settle(self) -> None:
        """Steps until every job finished and was reported."""
        for _ in range(200):
            if not self.worker.busy and not self.sched.jobs_in_flight:
                return
            self.worker.drain()
            self.idle_step()
        raise AssertionError("engine did not settle")

    def close(self) -> None:
        self.settle()
        self.sched.check_integrity()
        self.worker.close()
        assert sorted(self.free) == list(range(1, len(self.free) + 1)), "blocks leaked"
