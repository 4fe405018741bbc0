"""The shared store across real processes: three engines with their own prefix offload share
one namespace (another fingerprint never reads it; engines already running find a prefix
published after they started), a writer SIGKILLed mid-write leaves
misses and expiring stage keys, and a SIGKILLed redis-server gives misses, never wrong KV.

Children run this file as a script (``python this.py ROLE ...``), each its own engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_testlib import filled_pool, key, keys, tiny_layout

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.ids import BlockId, RequestId, SlotId
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.offload import (
    LoadDone,
    OffloadConfig,
    build_cascade,
)
from kvplane.offload.tiers import ReadOutcome, SharedTier
from kvplane.serving.prefix_offload import PrefixOffload, PrefixSettings
from kvplane.serving.producers.base import PoolTensor
from kvplane.testing.redis_server import LocalRedisServer

BS, BPC, N = 4, 2, 4  # block size, blocks per chunk, chunks of the shared prefix
PROMPT = list(range(100, 100 + N * BPC * BS + 1))  # N full chunks and one token more
HASHER = BlockHasher(seed=7, fingerprint=b"tiny-model")
FP = bytes(range(16))
WRITER_CHUNK = 256 << 10


def layout(other: bool) -> KVLayout:
    """The engines' layout; ``other``: the same bytes per block, another fingerprint."""
    if not other:
        return tiny_layout(num_blocks=32)
    return KVLayout.gqa(
        num_blocks=32, block_size=4, num_layers=4, kv_heads=2, head_dim=8, dtype=torch.float32
    )


def blocks(first: int, n: int) -> list[BlockId]:
    return [BlockId(b) for b in range(first * BPC, (first + n) * BPC)]


def offload_config(url: str, ns: str) -> OffloadConfig:
    return OffloadConfig(
        host_slots=8, pin_memory=False, admission_min_lookups=0, remote_url=url,
        remote_mode="shared", remote_namespace=ns, remote_slots=16, remote_timeout_s=15.0,
        remote_lease_s=30.0,
    )  # fmt: skip


def pattern(i: int) -> torch.Tensor:
    return ((torch.arange(WRITER_CHUNK, dtype=torch.int64) * 31 + i) % 241).to(torch.uint8)


# -- children --------------------------------------------------------------------------------
def engine(url: str, ns: str, role: str) -> None:
    """A prefill pool's prefix offload over the shared store. ``store``: admit the prompt,
    "compute" its KV (a seeded pool) and offload it; ``load``/``other`` (another layout, same
    block hashes): admit the same prompt into other blocks and load its cached prefix;
    ``late``: as ``load``, but say ``ready`` once built and wait for a line on stdin first."""
    lay = layout(role == "other")
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(lay.shape, generator=g) if role == "store" else torch.zeros(lay.shape)
    pool = BlockPool(lay.num_blocks, BS)
    off = PrefixOffload(PrefixSettings(offload_config(url, ns), BPC), PoolTensor(lay, kv), pool)
    if role != "store":  # another engine's free blocks are elsewhere
        BlockTable(RequestId("filler"), BS, HASHER).admit(pool, list(range(5, 5 + 3 * BS)))
    out: dict[str, object] = {"known": off.cascade.managers()[-1].table.num_used}
    if role == "late":
        print("ready", flush=True)
        sys.stdin.readline()
    table = BlockTable(RequestId("r"), BS, HASHER)
    assert table.admit(pool, PROMPT) is not None
    started = off.begin_load(RequestId("r"), table)
    out["sources"] = None if started is None else list(started.sources)
    if role == "store":
        assert off.store(RequestId("r"), table) == N
    events = []
    while off.busy or off.loading:
        events += off.wait(1.0)
    out["events"] = [repr(e) for e in events]
    remote = off.cascade.managers()[-1]
    out["remote"] = [remote.status(k).value for k in off.chunk_keys(table)]
    blocks = list(table.block_ids[: N * BPC])
    canon = lay.canonical_view(kv)[blocks].contiguous()
    out["digest"] = hashlib.sha256(canon.view(torch.uint8).numpy().tobytes()).hexdigest()
    off.check_integrity()
    off.close()
    print(json.dumps(out), flush=True)


def writer(url: str, ns: str) -> None:
    """Publish batches of 8 chunks forever; says ``go`` after the first."""
    tier = SharedTier([url], 8, WRITER_CHUNK, FP, namespace=ns, stage_ttl_s=1.0)
    for b in range(10**6):
        ids = range(8 * b, 8 * b + 8)
        tier.write([SlotId(i - 8 * b) for i in ids], keys(*ids), [pattern(i) for i in ids])
        if b == 0:
            print("go", flush=True)


def stager(url: str, ns: str) -> None:
    """Stage chunk 0's payload (phase one) and stop there, as if killed before publishing."""
    tier = SharedTier([url], 8, WRITER_CHUNK, FP, namespace=ns, stage_ttl_s=1.0)
    server = tier.servers[0]
    server.client.set(f"{ns}:stage:{server.writer_id}:0", pattern(0).numpy().tobytes(), px=1000)
    print("staged", flush=True)
    time.sleep(600)


# -- tests -----------------------------------------------------------------------------------
def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    got: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return got


def test_three_engines_share_a_prefix_and_another_fingerprint_never_reads_it(
    redis_url: str, redis_namespace: str
) -> None:
    """Engine A computes and offloads a prompt's KV; engines B and C, started after, find its
    prefix in the shared store and load byte-identical KV; engine D, of another layout (same
    block hashes, same bytes per block), never reads it."""
    a = result(spawn("store", redis_url, redis_namespace))
    assert a["sources"] is None and a["remote"] == ["ready"] * N, a
    others = [spawn(role, redis_url, redis_namespace) for role in ("load", "load", "other")]
    b, c, d = (result(p) for p in others)
    for got in (b, c):
        assert got["sources"] == ["remote"] * N, got
        finished = f"LoadFinished(request_id='r', tokens={N * BPC * BS}, chunks={N}, failed=0)"
        assert finished in got["events"], got
        assert got["digest"] == a["digest"]  # byte-identical KV
    assert d["sources"] is None and d["events"] == [] and d["remote"] == ["empty"] * N, d


def test_running_engines_find_a_prefix_published_after_they_started(
    redis_url: str, redis_namespace: str
) -> None:
    """Engines B and C are built (their shared tier re-indexed: empty) before A stores the
    prompt; their next lookup asks the store, and both load A's KV byte-identical."""
    late = [spawn("late", redis_url, redis_namespace) for _ in range(2)]
    for proc in late:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    a = result(spawn("store", redis_url, redis_namespace))
    assert a["sources"] is None and a["remote"] == ["ready"] * N, a
    for proc in late:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    for got in (result(p) for p in late):
        assert got["known"] == 0 and got["sources"] == ["remote"] * N, got
        assert got["remote"] == ["ready"] * N and got["digest"] == a["digest"], got


def stage_keys(client: redis.Redis, ns: str) -> list[bytes]:
    return list(client.scan_iter(match=f"{ns}:stage:*"))


def wait_gone(client: redis.Redis, ns: str) -> None:
    deadline = time.monotonic() + 30
    while stage_keys(client, ns) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stage_keys(client, ns) == []


def test_writer_killed_after_staging_leaves_a_miss_and_its_stage_expires(
    redis_url: str, redis_namespace: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    proc = spawn("stager", redis_url, redis_namespace)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "staged"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    [stage] = stage_keys(client, redis_namespace)
    assert 0 < client.pttl(stage) <= 1000
    reader = SharedTier([redis_url], 8, WRITER_CHUNK, FP, namespace=redis_namespace)
    out = torch.zeros(WRITER_CHUNK, dtype=torch.uint8)
    assert reader.read([SlotId(0)], [key(0)], [out]) == [ReadOutcome.MISSING]
    assert reader.scan() == {}
    wait_gone(client, redis_namespace)
    reader.close()
    client.close()


def test_writer_killed_mid_write_never_leaves_wrong_bytes(
    redis_url: str, redis_namespace: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    proc = spawn("writer", redis_url, redis_namespace)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "go"
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # slots enough for every chunk it may have published: scan() gives at most that many
    reader = SharedTier([redis_url], 4096, WRITER_CHUNK, FP, namespace=redis_namespace)
    found = reader.scan()
    n = 8 * (len(found) // 8 + 2)  # every key the writer may have reached
    assert set(found) <= set(keys(*range(n))) and set(keys(*range(8))) <= set(found)
    outs = [torch.zeros(WRITER_CHUNK, dtype=torch.uint8) for _ in range(n)]
    got = reader.read([SlotId(0)] * n, keys(*range(n)), outs)
    for i, (outcome, out) in enumerate(zip(got, outs, strict=True)):
        assert outcome in (ReadOutcome.OK, ReadOutcome.MISSING)
        assert (outcome is ReadOutcome.OK) == (key(i) in found)
        if outcome is ReadOutcome.OK:
            assert torch.equal(out, pattern(i))
    wait_gone(client, redis_namespace)
    reader.close()
    client.close()


def test_redis_killed_gives_misses_never_wrong_kv_and_writes_resume() -> None:
    lay = tiny_layout(num_blocks=32)
    with LocalRedisServer() as server:
        m = MetricsRegistry()
        pool = filled_pool(lay, seed=3)
        original = pool.clone()
        cfg = OffloadConfig(
            host_slots=8, pin_memory=False, remote_url=server.url, remote_mode="shared",
            remote_namespace="kill", remote_timeout_s=1.0, remote_lease_s=2.0,
        )  # fmt: skip
        c = build_cascade(cfg, lay, BPC, pool, metrics=m)
        ks = keys(*range(N))
        c.lookup(ks)
        c.store(ks, blocks(0, N))
        c.drain()
        host = c.managers()[0]
        host.evict(ks)
        server.kill()
        pool[N * BPC :].zero_()
        ticket = c.load(ks, blocks(N, N))
        assert ticket is not None and ticket.sources == ("remote",) * N
        [done] = [e for e in c.drain() if isinstance(e, LoadDone)]
        assert done.usable == 0  # misses: nothing of it may be used
        restarted = LocalRedisServer(server.port)
        try:
            assert c.lookup(ks).where == (None,) * N  # the failed chunks were dropped
            c.store(ks, blocks(0, N))  # a write registers a fresh writer on the new server
            c.drain()
            c.managers()[0].evict(ks)
            pool[N * BPC :].zero_()
            c.load(ks, blocks(N, N))
            [done] = [e for e in c.drain() if isinstance(e, LoadDone)]
            assert done.ok == (True,) * N
            canon = lay.canonical_view(pool)
            assert torch.equal(
                canon[N * BPC : 2 * N * BPC], lay.canonical_view(original)[: N * BPC]
            )
            c.check_integrity()
            c.close()
        finally:
            restarted.stop()


if __name__ == "__main__":
    role, url, ns = sys.argv[1:4]
    if role in ("store", "load", "late", "other"):
        engine(url, ns, role)
    elif role == "writer":
        writer(url, ns)
    else:
        stager(url, ns)
