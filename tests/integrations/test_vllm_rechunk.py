"""The connector with per-tier chunk sizes: host chunks of 2 blocks, disk and Redis 4x and 8x.

The real :class:`SchedulerSide` and :class:`WorkerSide` on CPU tensors
(``vllm_testlib.MiniEngine``), a real redis-server: a gather's whole groups are written down as
one tier chunk each, a restarted engine promotes them into host chunks and loads them, every
loaded block byte-exact (checked by the engine) and every pool and book balanced at the end;
a property test draws the span, the prompt and vLLM's own prefix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_testlib import FINGERPRINT, MiniEngine, block_content

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest, SchedulerSide
from kvplane.metrics import MetricsRegistry
from kvplane.serving.router.route_policy import ChunkKeyScheme

PROMPT = [1 + (37 * t) % 500 for t in range(70)]  # 17 full blocks of 4: 8 chunks of 2 blocks
SCHEME = ChunkKeyScheme(BlockHasher(0, FINGERPRINT), ChunkSpec(4, 2))
KEYS = SCHEME.keys(PROMPT)


def extra(disk: Path | None, disk_span: int = 4, **more: object) -> dict[str, object]:
    """Host chunks of 2 blocks (16 slots); a disk tier of ``disk_span`` host chunks a chunk."""
    got: dict[str, object] = {"blocks_per_chunk": 2, "host_slots": 16, **more}
    if disk is not None:
        got |= {"disk_path": str(disk), "disk_slots": 8, "disk_direct_io": False}
        got["disk_blocks_per_chunk"] = 2 * disk_span
    return got


def remote(url: str, ns: str, span: int, **more: object) -> dict[str, object]:
    return {
        "remote_url": url,
        "remote_namespace": ns,
        "remote_slots": 4,
        "remote_blocks_per_chunk": 2 * span,
        **more,
    }


def held(eng: MiniEngine, tier: str) -> set[ChunkKey]:
    """The chunks tier ``tier`` holds READY, as the scheduler side's book has them."""
    return {ChunkKey(k) for k in eng.sched.book.lower[tier].policy.order()}


def chunk_bytes(eng: MiniEngine) -> int:
    return 2 * eng.pool.bytes_per_block


def test_a_restarted_engine_loads_disk_chunks_of_4_host_chunks(tmp_path: Path) -> None:
    one = MiniEngine(extra(tmp_path / "d.bin"))
    assert one.sched.book.spans == {"disk": 4}
    assert one.worker.lower["disk"].chunk_bytes == 4 * chunk_bytes(one)
    assert one.run(PROMPT).loaded == 0
    one.settle()  # the gather's report decided two write-downs; the next steps carry them
    assert held(one, "disk") == {KEYS[3], KEYS[7]}  # keyed by each group's last host key
    path = {"path": "host_to_disk"}
    assert one.wmetrics.value("offload_bytes", path, "_total") == 8 * chunk_bytes(one)
    one.close()

    two = MiniEngine(extra(tmp_path / "d.bin"))
    assert {k for k, _s in dict(two.worker.index.tiers)["disk"]} == {KEYS[3], KEYS[7]}
    got = two.run(PROMPT)
    assert got.loaded == 64 and got.failed_blocks == set()  # byte-exact: checked by run()
    assert two.metrics.value("vllm_hit_chunks", {"tier": "disk"}, "_total") == 8
    assert two.metrics.value("vllm_loads", {"mode": "async"}, "_total") == 1
    two.close()

    three = MiniEngine(extra(tmp_path / "d.bin"))
    cut = three.run([*PROMPT[:44], 900, 901, 902, 903])  # chunk 4 is group 1's first only
    assert cut.loaded == 32 and cut.failed_blocks == set()
    three.close()


def test_a_group_goes_down_once_host_holds_all_its_chunks(tmp_path: Path) -> None:
    eng = MiniEngine(extra(tmp_path / "d.bin"))
    eng.run(PROMPT[:21])  # chunks 0 and 1: half a group
    eng.settle()
    assert held(eng, "disk") == set()
    second = eng.run(PROMPT[:40])  # loads 0-1 from host, stores 2-4: group 0 is whole
    assert second.loaded == 16
    eng.settle()
    assert held(eng, "disk") == {KEYS[3]}
    assert eng.metrics.value("vllm_stored_chunks", suffix="_total") == 5
    eng.close()


def test_a_local_prefix_inside_a_disk_chunk_loads_the_rest_and_not_vllms_blocks(
    tmp_path: Path,
) -> None:
    one = MiniEngine(extra(tmp_path / "d.bin"))
    one.run(PROMPT)
    one.close()
    eng = MiniEngine(extra(tmp_path / "d.bin", load_mode="sync"))
    view = RequestView("local", PROMPT)
    assert eng.sched.match(view, 16) == (48, False)  # vLLM holds chunks 0-1 of group 0
    blocks = eng.take_blocks(18)
    mark = torch.full(eng.block_shape(), 3.0, dtype=torch.bfloat16)
    for b in blocks[:4]:
        eng.layout_view()[b] = mark
    op = eng.sched.allocated(view, blocks, 48)
    assert op is not None
    assert (op.first_chunk, op.skip_blocks, op.block_ids) == (0, 4, tuple(blocks[4:16]))
    assert [p.part for p in op.promotions] == [0, 1, 2, 3, 0, 1, 2, 3]
    meta = eng.step([ScheduledRequest(view, 70, blocks, 16)])
    assert eng.worker.take_load_errors() == set()
    for i, b in enumerate(blocks[:4]):
        assert torch.equal(eng.layout_view()[b], mark), f"vLLM's block {i} was written"
    for i, b in enumerate(blocks[4:16], start=4):
        want = block_content(PROMPT, i, 4, eng.block_shape())
        assert torch.equal(eng.layout_view()[b], want), f"block {i} holds wrong KV"
    eng.finish_step(meta)
    eng.sched.finished("local")
    eng.free.extend(blocks)
    assert eng.metrics.value("vllm_hit_tokens", suffix="_total") == 48
    assert eng.metrics.value("vllm_hit_chunks", {"tier": "disk"}, "_total") == 6
    eng.close()


@pytest.mark.parametrize(("disk_span", "remote_span"), [(4, 8), (8, 4), (1, 8)])
def test_redis_and_disk_of_other_sizes_round_trip(
    tmp_path: Path, redis_url: str, redis_namespace: str, disk_span: int, remote_span: int
) -> None:
    more = remote(redis_url, redis_namespace, remote_span)
    one = MiniEngine(extra(tmp_path / "d.bin", disk_span, **more))
    assert one.sched.book.spans == {"disk": disk_span, "remote": remote_span}
    one.run(PROMPT)
    one.settle()
    assert held(one, "remote") == {KEYS[i] for i in range(remote_span - 1, 8, remote_span)}
    assert held(one, "disk") == {KEYS[i] for i in range(disk_span - 1, 8, disk_span)}
    for tier in ("disk", "remote"):
        moved = one.wmetrics.value("offload_bytes", {"path": f"host_to_{tier}"}, "_total")
        assert moved == 8 * chunk_bytes(one)
    one.close()

    two = MiniEngine(extra(tmp_path / "empty.bin", disk_span, **more))  # Redis alone holds it
    got = two.run(PROMPT)
    assert got.loaded == 64 and got.failed_blocks == set()
    assert two.metrics.value("vllm_hit_chunks", {"tier": "remote"}, "_total") == 8
    two.close()


def test_a_shared_store_of_8x_chunks_is_discovered_and_loaded(
    redis_url: str, redis_namespace: str
) -> None:
    more = remote(redis_url, redis_namespace, 8, remote_mode="shared")

    def engine() -> MiniEngine:
        eng = MiniEngine(extra(None, **more))
        eng.metrics = MetricsRegistry()
        eng.sched.close()
        eng.sched = SchedulerSide(eng.config, eng.block_size, eng.metrics)
        eng.sched.set_index(eng.worker.index, [eng.worker.store])
        return eng

    a, c = engine(), engine()  # C started before A published
    assert c.worker.store is not None and c.worker.store.chunk_bytes == 8 * chunk_bytes(c)
    a.run(PROMPT)
    a.settle()
    got = c.run(PROMPT)
    assert got.loaded == 64 and got.failed_blocks == set()
    assert c.metrics.value("vllm_discovered_chunks", suffix="_total") == 1  # one tier chunk
    assert c.metrics.value("vllm_hit_chunks", {"tier": "remote"}, "_total") == 8
    for eng in (a, c):
        eng.close()
        eng.sched.close()


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    span=st.sampled_from([1, 2, 4, 8]),
    tokens=st.integers(min_value=9, max_value=70),
    local=st.integers(min_value=0, max_value=17),
)
def test_any_span_prompt_and_local_prefix_load_byte_exact(
    tmp_path: Path, span: int, tokens: int, local: int
) -> None:
    """A prompt stored at disk span ``span``, loaded by a restarted engine after ``local``
    blocks vLLM holds itself: exactly the blocks past them up to the last whole disk chunk
    inside ``tokens - 1`` tokens are loaded, byte-exact, and vLLM's own are never written."""
    prompt = PROMPT[:tokens]
    disk = tmp_path / f"p{span}-{tokens}-{local}.bin"
    one = MiniEngine(extra(disk, span))
    one.run(prompt)
    one.close()
    eng = MiniEngine(extra(disk, span, load_mode="sync"))
    n_blocks = -(-tokens // 4)
    local = min(local, (tokens - 1) // 4)
    group = 8 * span  # tokens per disk chunk
    stored = tokens // group * group  # whole disk chunks of the prompt
    loadable = min(stored, (tokens - 1) // 8 * 8) // group * group
    view = RequestView("p", prompt)
    matched, _ = eng.sched.match(view, 4 * local)
    assert matched == max(loadable - 4 * local, 0)
    blocks = eng.take_blocks(n_blocks)
    mark = torch.full(eng.block_shape(), 3.0, dtype=torch.bfloat16)
    for b in blocks:
        eng.layout_view()[b] = mark
    eng.sched.allocated(view, blocks, matched)
    meta = eng.step([ScheduledRequest(view, tokens, blocks, 4 * local + matched)])
    assert eng.worker.take_load_errors() == set()
    for i, b in enumerate(blocks):
        loaded = local <= i < local + matched // 4
        want = block_content(prompt, i, 4, eng.block_shape()) if loaded else mark
        assert torch.equal(eng.layout_view()[b], want), f"block {i}"
    eng.finish_step(meta)
    eng.sched.finished("p")
    eng.free.extend(blocks)
    eng.close()
