"""``kvplane bench offload``'s shared-store rows: the shared store against the private remote
tier on the same Redis server, in the same run.

Three rows of :data:`SHARED_CHUNK`-byte chunks: engine A publishing new chunks (dedup check,
staged ``SET`` s, the publish script) against the private tier's store; engine B offering the
same chunks again (deduplicated: only the ``EXISTS`` round trip) against that store; and engine
B loading A's chunks (checked reads) against the private tier's load. Each repeat times both
sides back to back (:func:`~.offload_rows.measure`); ratios with their spread, no target.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvplane.apps.bench.offload_rows import (
    KeyedOp,
    Limit,
    Measured,
    Timed,
    measure,
    rows,
    seconds,
    tier_ops,
)
from kvplane.apps.bench.offload_sweep import fresh_keys, layout
from kvplane.ids import ChunkKey, SlotId
from kvplane.offload import AdmissionFilter, OffloadManager
from kvplane.offload.tiers import ReadOutcome, RemoteTier, SharedTier

SHARED_CHUNK = 256 << 10
SHARED_CHUNKS = {True: 32, False: 128}
"""Chunks moved per timed run, per ``--quick``."""
LIMIT_NAME = "private remote tier"


def _payloads(n: int, chunk: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return list(torch.randint(0, 256, (n, chunk), dtype=torch.uint8, generator=g).unbind(0))


def shared_rows(quick: bool, url: str) -> tuple[list[dict[str, object]], list[dict[str, Any]]]:
    """The three rows (``shared_store_new``, ``shared_store_dedup``, ``shared_load_other``,
    each ``..._256k``) for the server at ``url`` and one summary per row (``op``, ``gbps``,
    ``private_gbps``, ratio min/median/max). Every key it wrote is deleted after."""
    import redis

    n, chunk = SHARED_CHUNKS[quick], SHARED_CHUNK
    ns = f"kvbench-shared{os.getpid()}"
    fp = layout(1).fingerprint()
    privates: list[RemoteTier] = []  # one stores fresh keys, one keeps the loaded ones
    engines: list[SharedTier] = []
    try:
        for i in range(2):
            privates.append(RemoteTier(url, n, chunk, fp, namespace=f"{ns}p{i}", timeout_s=30.0))
            engines.append(SharedTier([url], n, chunk, fp, namespace=ns, timeout_s=30.0))
        a, b = engines
        bufs = _payloads(n, chunk)
        slots = [SlotId(i) for i in range(n)]
        store, _ = tier_ops(privates[0], _manager(n), bufs)
        keep, load = tier_ops(privates[1], _manager(n), bufs)
        published, stored = fresh_keys(n), fresh_keys(n)
        a.write(slots, published, bufs)
        keep(stored)
        server = a.servers[0]

        def fresh(op: KeyedOp, drop: bool = False) -> Timed:
            def run() -> float:
                keys = fresh_keys(n)
                took = seconds(lambda: op(keys))
                if drop:  # untimed: the store keeps no more than one run's new chunks
                    server.client.delete(*[name for k in keys for name in server.names(k)])
                return took

            return run

        def read_all(keys: list[ChunkKey]) -> None:
            got = b.read(slots, keys, bufs)
            if got.count(ReadOutcome.OK) != n:
                raise RuntimeError(f"bench shared store read back {got}")

        private_store = Limit(LIMIT_NAME, "", fresh(store))
        private_load = Limit(LIMIT_NAME, "", lambda: seconds(lambda: load(stored)))
        got: list[Measured] = [
            measure(("shared", "store_new", chunk, n * chunk),
                    fresh(lambda keys: a.write(slots, keys, bufs), True), [private_store],
                    quick),
            measure(("shared", "store_dedup", chunk, n * chunk),
                    lambda: seconds(lambda: b.write(slots, published, bufs)), [private_store],
                    quick),
            measure(("shared", "load_other", chunk, n * chunk),
                    lambda: seconds(lambda: read_all(published)), [private_load], quick),
        ]  # fmt: skip
    finally:
        for private in privates:
            private.clear()
            private.close()
        for engine in engines:
            engine.close()
        client = redis.Redis.from_url(url)
        names = list(client.scan_iter(match=f"{ns}:*", count=1000))
        for i in range(0, len(names), 1000):
            client.delete(*names[i : i + 1000])
        client.close()
    lines = [row for m in got for row in rows(m, None)]
    return lines, [_summary(m.op, line) for m, line in zip(got, lines, strict=True)]


def _manager(n: int) -> OffloadManager:
    return OffloadManager("remote", n, "lru", AdmissionFilter(0))


def _summary(op: str, line: dict[str, object]) -> dict[str, Any]:
    return {
        "op": op, "gbps": line["figure"], "private_gbps": line["limit"],
        "ratio_min": line["ratio_min"], "ratio_median": line["ratio_median"],
        "ratio_max": line["ratio_max"],
    }  # fmt: skip
