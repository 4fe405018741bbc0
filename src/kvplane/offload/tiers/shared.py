"""The shared store: a content-addressed remote tier that many engines read and write at once.

Chunks live under namespace + fingerprint + chunk key on one Redis server or several
(replicas), published in two phases by fenced writers (:mod:`~.shared_server`); this module
owns the tier protocol, replica fan-out, verification and metrics. Slots are this engine's
accounting only. The ``redis`` client is imported here. See docs/offload.md ("The shared store").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from kvplane.errors import (
    InvalidArgumentError,
    MalformedMessageError,
    OffloadError,
)
from kvplane.ids import ChunkKey, SlotId
from kvplane.metrics import MetricsRegistry
from kvplane.offload.codecs.coder import ChunkCoder
from kvplane.offload.tiers.base import (
    ReadOutcome,
    TierCounters,
    as_buffer,
    check_batch,
    check_stored_tier,
    encode_payload,
    stored_fault,
)
from kvplane.offload.tiers.fence import STAGE_TTL_S
from kvplane.offload.tiers.header import (
    HEADER_BYTES,
    ChunkHeader,
    payload_checksum,
    verify_header,
)
from kvplane.offload.tiers.mget import stream_mgets
from kvplane.offload.tiers.remote import (
    check_redis_settings,
    import_redis,
    pipeline_groups,
    redis_client,
)
from kvplane.offload.tiers.resp import ReplyReader
from kvplane.offload.tiers.shared_server import PublishOutcome, PublishResult, SharedServer
from kvplane.validators import require_finite_positive

T = TypeVar("T")
_RANK = {PublishOutcome.PUBLISHED: 0, PublishOutcome.DEDUPED: 1, PublishOutcome.EXPIRED: 2}


class SharedTier:
    """``num_slots`` chunks of ``chunk_bytes`` bytes of this engine in the shared store
    ``namespace`` on ``urls`` (the first, then replicas)."""

    def __init__(
        self,
        urls: Sequence[str],
        num_slots: int,
        chunk_bytes: int,
        fingerprint: bytes,
        *,
        namespace: str = "kvplane",
        timeout_s: float = 5.0,
        lease_s: float | None = None,
        stage_ttl_s: float = STAGE_TTL_S,
        metrics: MetricsRegistry | None = None,
        name: str = "remote",
        coder: ChunkCoder | None = None,
    ) -> None:
        """Connect to every server and register a writer on each (``lease_s``: its key's
        time to live, renewed; default as :class:`~.remote.RemoteTier`'s lease). Bad arguments
        raise :class:`InvalidArgumentError` before anything connects; a missing client
        :class:`UnsupportedError`; an unreachable server :class:`OffloadError` (servers
        opened before it are closed). ``coder`` codes every chunk and goes into the
        fingerprint, so engines of another codec or layout never share a chunk."""
        coder, fp = check_stored_tier("SharedTier", num_slots, chunk_bytes, fingerprint, coder)
        urls = list(urls) if not isinstance(urls, str) else [urls]
        timeout_s, lease_s = check_redis_settings("SharedTier", urls, namespace, timeout_s, lease_s)
        stage_ttl_s = require_finite_positive(
            "SharedTier.stage_ttl_s", stage_ttl_s, InvalidArgumentError
        )
        redis = import_redis()
        self.name, self.urls, self.namespace = name, tuple(urls), namespace
        self.num_slots, self.chunk_bytes = num_slots, chunk_bytes
        self.fingerprint = fp
        self._coder = coder
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._faults = (*self._errors, OffloadError)
        self._read_errors = (*self._faults, MalformedMessageError)
        self._counters = TierCounters(metrics, name)
        self._published = None
        if metrics is not None:
            self._published = metrics.counter(
                "offload_shared_publish", "Chunks offered to a shared store, by outcome",
                ("tier", "outcome"),
            )  # fmt: skip
        self.servers: list[SharedServer] = []
        for url in urls:
            client = redis_client(url, timeout_s)
            try:
                self.servers.append(
                    SharedServer(
                        client, namespace, self.fingerprint, self._errors,
                        redis.exceptions.NoScriptError, timeout_s=timeout_s, lease_s=lease_s,
                        stage_ttl_s=stage_ttl_s,
                    )
                )  # fmt: skip
            except self._errors as exc:
                client.close()
                self.close()
                raise OffloadError(f"shared store {url!r} is unreachable: {exc}") from exc
            except BaseException:
                client.close()
                self.close()
                raise

    def _count(self, outcome: str, n: int = 1) -> None:
        if self._published is not None and n:
            self._published.labels(tier=self.name, outcome=outcome).inc(n)

    def _each(self, call: Callable[[SharedServer], T]) -> list[tuple[str, T | str]]:
        """``call`` on each server, with its URL; one that fails is counted and answers why
        (a ``str``)."""
        out: list[tuple[str, T | str]] = []
        for url, server in zip(self.urls, self.servers, strict=True):
            try:
                out.append((url, call(server)))
            except self._faults as exc:
                self._counters.error()
                out.append((url, f"{url}: {exc}"))
        return out

    # -- writes ---------------------------------------------------------------------------------
    def publish(self, keys: Sequence[ChunkKey], payloads: Sequence[torch.Tensor]) -> PublishResult:
        """Publish ``payloads[i]`` as chunk ``keys[i]`` on every server: chunks a server holds
        already are not sent (deduplicated), the rest staged and published in one atomic step
        each (docs/offload.md). Never raises for a server that fails: see ``failed``;
        ``outcomes`` is empty when every server failed."""
        slots = [SlotId(0)] * len(keys)
        check_batch(self.name, self.num_slots, self.chunk_bytes, slots, keys, payloads)
        return self._publish(keys, payloads)

    def _publish(self, keys: Sequence[ChunkKey], payloads: Sequence[torch.Tensor]) -> PublishResult:
        made: dict[int, tuple[bytes, memoryview]] = {}

        def encoded(i: int) -> tuple[bytes, memoryview]:
            """Chunk ``i``'s header and stored bytes, coded and checksummed once, and only
            for a server that lacks it (a deduplicated chunk costs no CRC or codec)."""
            if i not in made:
                tag, v = encode_payload(self._coder, payloads[i])
                crc = payload_checksum(v)
                header = ChunkHeader(keys[i], self.fingerprint, self.chunk_bytes, crc, tag, len(v))
                made[i] = (header.encode(), v)
            return made[i]

        def one(server: SharedServer) -> list[PublishOutcome]:
            out = [PublishOutcome.DEDUPED] * len(keys)
            for group in pipeline_groups(len(keys), self.chunk_bytes):
                held = server.held([keys[i] for i in group])
                todo = [i for i, h in zip(group, held, strict=True) if not h]
                got = server.publish(
                    [keys[i] for i in todo],
                    [encoded(i)[0] for i in todo],
                    [encoded(i)[1] for i in todo],
                )
                for i, outcome in zip(todo, got, strict=True):
                    out[i] = outcome
            return out

        best = [PublishOutcome.EXPIRED] * len(keys)
        failed: list[str] = []
        for _url, got in self._each(one):
            if isinstance(got, str):
                failed.append(got)
                continue
            for o in got:
                self._count(o.value)
            best = [min(a, b, key=_RANK.__getitem__) for a, b in zip(best, got, strict=True)]
        return PublishResult(tuple(best) if len(failed) < len(self.servers) else (), tuple(failed))

    def write(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], payloads: Sequence[torch.Tensor]
    ) -> None:
        """The tier protocol's write (``slots`` are this engine's accounting): publish, and
        raise :class:`OffloadError` unless every chunk is readable on some server now."""
        check_batch(self.name, self.num_slots, self.chunk_bytes, slots, keys, payloads)
        got = self._publish(keys, payloads)
        if not got.outcomes and keys:
            raise OffloadError(f"shared store: every server failed the write: {got.failed}")
        if PublishOutcome.EXPIRED in got.outcomes:
            raise OffloadError(
                "shared store: a staged payload expired before its publish; not all written"
            )

    def read(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]
    ) -> list[ReadOutcome]:
        """Read chunk ``keys[i]`` into ``outs[i]`` from the first server that holds it whole
        and verified (``slots`` unused but checked; ``outs[i]`` holds garbage unless OK). A
        header without its payload or the other way round (an eviction race) is MISSING, a
        header or checksum that does not verify CORRUPT (and that copy deleted), never wrong
        bytes. Raises :class:`OffloadError` only when no server answered."""
        check_batch(self.name, self.num_slots, self.chunk_bytes, slots, keys, outs)
        result = [ReadOutcome.MISSING] * len(keys)
        todo = list(range(len(keys)))
        answered = 0
        for server in self.servers:
            if not todo:
                break
            bad: list[tuple[ChunkKey, bytes]] = []
            asked = todo

            def on_group(reader: ReplyReader, group: range) -> None:
                for j in group:
                    i = asked[j]  # noqa: B023 - called before the loop moves on
                    got = self._receive(reader, keys[i], outs[i], bad)  # noqa: B023
                    if got is ReadOutcome.OK or result[i] is ReadOutcome.MISSING:
                        result[i] = got

            names = [server.names(keys[i]) for i in asked]
            try:
                stream_mgets(
                    server.client, names, pipeline_groups(len(asked), self.chunk_bytes), on_group
                )
                answered += 1
            except self._read_errors:
                self._counters.error()  # what it did not read whole is asked of the next one
            for key, raw in bad:
                try:
                    server.forget(key, raw)
                except self._errors:
                    self._counters.error()
            todo = [i for i in asked if result[i] is not ReadOutcome.OK]
        if keys and not answered:
            raise OffloadError(f"shared store: no server answered a read: {list(self.urls)}")
        return result

    def _receive(
        self,
        reader: ReplyReader,
        key: ChunkKey,
        out: torch.Tensor,
        bad: list[tuple[ChunkKey, bytes]],
    ) -> ReadOutcome:
        """One ``MGET`` reply of header and payload, checked (header, length, CRC, codec): a
        raw payload lands straight in ``out``, a coded one in a buffer of its own and is
        decoded into ``out``. A copy that fails a check is appended to ``bad``."""
        if reader.array() != 2:
            raise MalformedMessageError("an MGET of header and payload did not answer two values")
        n = reader.bulk_length()
        raw = None if n is None else reader.bulk_bytes(n) if n == HEADER_BYTES else b""
        if n is not None and n != HEADER_BYTES:
            reader.skip(n)  # not a header we wrote: never an allocation of its size
        length = reader.bulk_length()
        if raw is None or length is None:  # one half of it evicted (or never published)
            if length is not None:
                reader.skip(length)
            if raw is not None or length is not None:
                self._counters.corrupt("missing")
            return ReadOutcome.MISSING
        header = verify_header(raw, key, self.fingerprint, self.chunk_bytes)
        if not isinstance(header, str) and length != header.stored:
            header = "length"
        if isinstance(header, str):
            reader.skip(length)
            reason: str | None = header
        else:
            data = as_buffer(torch.empty(length, dtype=torch.uint8) if header.coded else out)
            reader.bulk_into(data)
            reason = stored_fault(header, payload_checksum(data), data, self._coder, out)
        if reason is None:
            return ReadOutcome.OK
        self._counters.corrupt(reason)
        bad.append((key, raw))
        return ReadOutcome.CORRUPT

    def held(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Per key: whether some server holds it now (a later read may still miss it). One
        pipelined round trip per server asked: the first, then each next one for the keys
        still not found (as a read goes); a server that fails is counted and skipped."""
        found = [False] * len(keys)
        for server in self.servers:
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            try:
                got = server.held([keys[i] for i in todo])
            except self._faults:
                self._counters.error()
                continue
            for i, h in zip(todo, got, strict=True):
                found[i] = h
        return found

    def scan(self) -> dict[ChunkKey, SlotId]:
        """Up to ``num_slots`` chunks of this fingerprint that some server holds, in key order,
        on slots ``0, 1, ...``; :class:`OffloadError` when no server answered."""
        found: set[ChunkKey] = set()
        answered = [got for _url, got in self._each(SharedServer.scan)]
        if all(isinstance(got, str) for got in answered):
            raise OffloadError(f"shared store: no server answered a re-index: {answered}")
        for got in answered:
            if not isinstance(got, str):
                found.update(got)
        return {k: SlotId(i) for i, k in enumerate(sorted(found)[: self.num_slots])}

    def close(self) -> None:
        """Deregister the writers and close every connection; idempotent."""
        servers: list[SharedServer] = getattr(self, "servers", [])
        while servers:
            server = servers.pop()
            try:
                server.close()
            except self._errors:
                self._counters.error()
