"""PD of a hybrid model between two real vLLM engines, vLLM's hybrid KV cache manager on.

The tiny random-init Gemma-2 of ``test_vllm_hybrid_engine.py`` (layer 0 windowed, window 64 = 2
blocks of 32, group 0; layer 1 full, group 1). One kvplane session per request moves every
group: the full group's whole blocks before the prompt's last token (rounded down: the decode
engine computes the rest), the window group only the 2 blocks its window needs from there.
By default one engine pair over tcp, one prompt pulled and one pipelined, its decode tokens
equal to the prefill engine's own for the same prompts (``reference_prompts``). ``slow``: the
same against an engine without the connector, and a decode engine with the hybrid manager off
(one group), refused at the handshake in one line. Skips without ``.venv-vllm``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from vllm_testlib import require_vllm, window_spec

from kvplane.integrations.vllm.env import run_harness, run_pd_pair

SHAPE = {"vocab": 512, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
WINDOW, BLOCK = 64, 32
GROUP_BLOCK = 2 * 2 * BLOCK * 32 * 2
"""One block of one group (one layer): K,V x 2 KV heads x 32 tokens x head_dim 32 x bf16."""
_rng = random.Random(47)
LONG = [_rng.randrange(1, 512) for _ in range(300)]  # 288 tokens move: 9 + 2 blocks
SHORT = LONG[:100] + [_rng.randrange(1, 512) for _ in range(30)]  # 128 move: 4 + 2 blocks
PROMPTS = [LONG, SHORT]
MAX_TOKENS = 8
SECRET = {"KVPLANE_SECRET": "kvplane-pd-test-secret-0123456789"}
SEQUENCE = ["pull", "pipelined"]


@pytest.fixture(scope="module")
def model(tiny_llama: Callable[[Mapping[str, int]], Path]) -> Path:
    require_vllm()
    return tiny_llama({**SHAPE, "sliding_window": WINDOW, "full_every": 2})


def _spec(model: Path, connector: dict[str, Any] | None, **more: Any) -> dict[str, Any]:
    return window_spec(model, BLOCK, connector, **more)


def _pair(model: Path, **more: Any) -> dict[str, Any]:
    connector = {"host_slots": 16, "pd_transport": "tcp"}
    return _spec(model, connector, prompts=PROMPTS, sequence=SEQUENCE, max_tokens=MAX_TOKENS,
                 **more)  # fmt: skip


def _metric(result: dict[str, Any], side: str, name: str) -> float:
    return float(result[side].get(name, 0.0))


def _tokens(decode: dict[str, Any]) -> list[list[int]]:
    return [decode["decode"][f"r{i}"]["tokens"] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def pair(model: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = _pair(model)
    prefill, decode = run_pd_pair({**spec, "reference_prompts": PROMPTS}, spec, timeout=500,
                                  env=SECRET)  # fmt: skip
    assert decode is not None
    return prefill, decode


def test_pull_and_pipelined_move_every_group_token_exact(
    pair: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    prefill, decode = pair
    assert prefill["modes"] == SEQUENCE
    assert _tokens(decode) == prefill["reference"]
    ok = "kvplane_vllm_pd_requests_total{outcome=ok,role=%s}"
    assert _metric(decode, "scheduler_metrics", ok % "recv") == 2
    assert _metric(prefill, "scheduler_metrics", ok % "send") == 2
    # whole blocks before the last prompt token: 288 of LONG's 300, 128 of SHORT's 130
    tokens = "kvplane_vllm_pd_tokens_total{role=recv}"
    assert _metric(decode, "scheduler_metrics", tokens) == 288 + 128
    # full group: LONG 9 blocks, SHORT 4; window group: the 2 blocks holding tokens from
    # end + 1 - 64 on (LONG 7-8, SHORT 2-3); with the manager off every layer's 10 + 5 blocks
    moved = "kvplane_pd_bytes_moved_total"
    assert _metric(prefill, "worker_metrics", moved) == ((9 + 4) + (2 + 2)) * GROUP_BLOCK
    amplification = "kvplane_pd_transfer_amplification_%s"  # every slice's plans: 1.0
    count = _metric(prefill, "worker_metrics", amplification % "count")
    assert count > 0 and _metric(prefill, "worker_metrics", amplification % "sum") == count
    assert prefill["pending_push_work"] is False and prefill["settled"] is True


@pytest.mark.slow  # one more engine
def test_decode_tokens_equal_an_engine_without_the_connector(
    model: Path, pair: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    rounds = [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS}]
    baseline = run_harness(_spec(model, None, rounds=rounds), timeout=300)["tokens"][0]
    assert _tokens(pair[1]) == baseline


@pytest.mark.slow  # one more engine pair
def test_a_decode_engine_without_the_hybrid_manager_is_refused_at_the_handshake(
    model: Path, pair: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    """Two groups against one: the decode's receives are refused at the handshake (its
    engine computes the prompts itself), nothing moves; the prefill engine, never asked,
    frees the sends at its ``pd_pull_timeout_s`` (a refused peer cannot abandon them)."""
    spec = _pair(model)
    spec["connector"] = {**spec["connector"], "pd_pull_timeout_s": 3}
    decode_spec = {**spec, "hybrid_kv_cache_manager": False}
    prefill, decode = run_pd_pair(spec, decode_spec, timeout=500, env=SECRET)
    assert decode is not None
    failed = "kvplane_vllm_pd_requests_total{outcome=failed,role=recv}"
    assert _metric(decode, "scheduler_metrics", failed) == 2
    assert _metric(prefill, "worker_metrics", "kvplane_pd_bytes_moved_total") == 0
    assert _tokens(decode) == pair[0]["reference"]
