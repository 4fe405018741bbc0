"""Re-chunking between tiers of different chunk sizes: host chunks demote into whole disk and
Redis chunks and promote back byte-exact, whatever the sizes, slots and prefix lengths.

The property test draws a host chunk size and a span per cold tier, fragments the host tier's
free slots (so groups take the staging path as well as the zero-copy one), stores a sequence,
then loads a random prefix from disk, then from Redis, then from host, comparing every byte
with the source blocks, and ends with the cascade's integrity checks (slots, pins, fences,
tickets, promotions all settled).
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from offload_testlib import filled_pool, keys, tiny_layout

from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.ids import BlockId, ChunkKey
from kvplane.offload import LoadDone, OffloadConfig, TierBook, TierCascade, build_cascade
from kvplane.offload.tiers import DiskTier

LAYOUT = tiny_layout(num_blocks=64)
N = 8  # most host chunks of one sequence
_ns = itertools.count()


def run_blocks(bpc: int, start: int, n: int) -> list[BlockId]:
    """Device blocks of ``n`` chunks of ``bpc`` blocks from chunk position ``start`` on."""
    return [BlockId(b) for b in range(start * bpc, (start + n) * bpc)]


def load(c: TierCascade, ks: list[ChunkKey], m: int, dst: list[BlockId]) -> tuple[str, ...]:
    """Load ``ks[:m]`` whole into ``dst``; the tier each chunk came from."""
    ticket = c.load(ks, dst, limit=m)
    assert ticket is not None and list(ticket.keys) == ks[:m]
    done = [e for e in c.drain() if isinstance(e, LoadDone)]
    assert len(done) == 1 and done[0].usable == m
    return ticket.sources


def cascade(
    tmp: Path, bpc: int, spans: tuple[int, int], url: str = "", ns: str = "kv"
) -> tuple[TierCascade, torch.Tensor]:
    pool = filled_pool(LAYOUT, seed=5)
    cfg = OffloadConfig(
        host_slots=2 * N, admission_min_lookups=0, pin_memory=False,
        disk_path=tmp / "slots", disk_slots=N, disk_blocks_per_chunk=spans[0] * bpc,
        remote_url=url, remote_slots=N, remote_namespace=ns,
        remote_blocks_per_chunk=spans[1] * bpc,
    )  # fmt: skip
    return build_cascade(cfg, LAYOUT, bpc, pool), pool


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    case=st.tuples(
        st.sampled_from([1, 2]),  # host blocks per chunk
        st.tuples(st.integers(1, 4), st.integers(1, 4)),  # disk and Redis spans
        st.integers(1, N),  # host chunks of the sequence
        st.integers(0, 6),  # junk chunks fragmenting host's free slots
    ),
    data=st.data(),
)
def test_rechunked_round_trips_are_byte_exact_through_disk_and_redis(
    redis_url: str,
    redis_namespace: str,
    case: tuple[int, tuple[int, int], int, int],
    data: st.DataObject,
) -> None:
    bpc, spans, n, junk = case
    ns = f"{redis_namespace}x{next(_ns)}"
    with tempfile.TemporaryDirectory() as tmp:
        c, pool = cascade(Path(tmp), bpc, spans, redis_url, ns)
        original = pool.clone()
        canon = LAYOUT.canonical_view
        try:
            # fragment host: junk chunks take the low slots, every other one is freed again
            if junk:
                assert c.store(keys(*range(100, 100 + junk)), run_blocks(bpc, 0, junk)) is not None
                c.drain()
                c.book.host.evict(keys(*range(100, 100 + junk, 2)))
            ks = keys(*range(n))
            assert c.store(ks, run_blocks(bpc, 0, n)) is not None
            c.drain()
            c.book.host.evict(ks)
            disk, remote = c.book.lower["disk"], c.book.lower["remote"]
            whole = [(n // s) * s for s in spans]
            for mgr, span, full in zip((disk, remote), spans, whole, strict=True):
                assert set(mgr.table.keys()) & set(ks) == set(ks[span - 1 : full : span])
            dst = N  # device chunk position loads land at
            for tier, full in (("disk", whole[0]), ("remote", whole[1])):
                if full == 0:
                    assert tier not in c.lookup(ks).where
                    continue
                m = data.draw(st.integers(1, full), label=f"{tier} prefix")
                pool[run_blocks(bpc, dst, m)] = 0
                assert load(c, ks, m, run_blocks(bpc, dst, m)) == (tier,) * m
                got = canon(pool)[dst * bpc : (dst + m) * bpc]
                assert torch.equal(got, canon(original)[0 : m * bpc])
                # host now holds the prefix again: a host load gives the same bytes
                pool[run_blocks(bpc, dst, m)] = 0
                assert load(c, ks, m, run_blocks(bpc, dst, m)) == ("host",) * m
                assert torch.equal(canon(pool)[dst * bpc : (dst + m) * bpc], got)
                c.book.host.evict(ks[:m])
                if tier == "disk":
                    disk.evict(list(disk.table.keys()))
            c.check_integrity()
        finally:
            c.close()
            _forget(redis_url, ns)


def _forget(url: str, ns: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    names = list(client.scan_iter(match=f"{ns}:*"))
    if names:
        client.delete(*names)
    client.close()


def test_tier_sizes_must_be_multiples_of_the_host_chunk(tmp_path: Path) -> None:
    pool = filled_pool(LAYOUT)
    cfg = OffloadConfig(disk_path=tmp_path / "d", disk_blocks_per_chunk=3, pin_memory=False)
    with pytest.raises(ConfigError, match="disk_blocks_per_chunk = 3 is not a multiple of"):
        build_cascade(cfg, LAYOUT, 2, pool)
    cfg = OffloadConfig(host_slots=3, disk_path=tmp_path / "f", disk_blocks_per_chunk=8,
                        remote_blocks_per_chunk=8, pin_memory=False)  # fmt: skip
    with pytest.raises(ConfigError, match=r"tier chunks of \{'disk': 4\} host chunks need"):
        build_cascade(cfg, LAYOUT, 2, pool)
    c = build_cascade(OffloadConfig(host_slots=4, pin_memory=False), LAYOUT, 2, pool)
    disk = DiskTier(tmp_path / "e", 4, 2 * LAYOUT.bytes_per_block, LAYOUT.fingerprint())
    mgr = TierBook.build(OffloadConfig(), [("disk", 4)]).lower["disk"]
    with pytest.raises(InvalidArgumentError, match="does not match 2 host chunks"):
        TierCascade(c.copier, c.book.host, [(disk, mgr)], spans={"disk": 2})
    disk.close()
    c.close()
