"""The remote tier: chunk slots in a Redis server (Valkey speaks the same protocol).

Payload and header strings per slot, fenced writes under the namespace lease, pipelined groups,
replies read straight into host slots (a coded payload into its own buffer, then decoded). The
``redis`` client is imported only here and in :mod:`~kvplane.offload.tiers.fence`. See
docs/offload.md.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, NoReturn

import torch

from kvplane.errors import (
    InvalidArgumentError,
    MalformedMessageError,
    OffloadError,
    UnsupportedError,
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
from kvplane.offload.tiers.fence import STAGE_TTL_S, Fence, StoreOutcome
from kvplane.offload.tiers.header import (
    HEADER_BYTES,
    ChunkHeader,
    payload_checksum,
    verify_header,
)
from kvplane.offload.tiers.lease import NamespaceLease, check_lease_timing
from kvplane.offload.tiers.mget import stream_mgets
from kvplane.offload.tiers.resp import ReplyReader
from kvplane.validators import require_finite_positive

_HEADER = b":h"
_SLOT = re.compile(rb"[0-9]+")
NAMESPACE_BAD = re.compile(r"[:*?\[\]\\]")
"""Characters a namespace may not hold: ':' separates key parts, and the rest would make the
``SCAN MATCH`` patterns of :meth:`RemoteTier.scan` and :meth:`RemoteTier.clear` reach other
namespaces (``kv*`` cleared ``kvplane``)."""
"""Suffix of a slot's header key."""
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
"""The URL schemes a Redis tier accepts."""
DEFAULT_LEASE_S = 10.0
"""The namespace lease when none is given and ``2 * timeout_s`` is not longer."""
_Received = tuple[ChunkHeader, memoryview]
"""A chunk whose header checked out and whose stored bytes arrived (in ``out`` when raw)."""
PIPELINE_BYTES = 8 << 20
"""Payload bytes per pipelined round trip of a batch (a read has the server hold up to two
groups of replies: the one being read and the next)."""


def check_redis_settings(
    what: str, urls: Sequence[object], namespace: object, timeout_s: object, lease_s: object
) -> tuple[float, float]:
    """``(timeout_s, lease_s)`` of a Redis tier ``what`` (``lease_s`` ``None``: the default,
    :data:`DEFAULT_LEASE_S` or ``2 * timeout_s`` when longer), after checking that ``urls``
    are one or more redis URLs and ``namespace`` a valid one; else
    :class:`InvalidArgumentError` naming the field. Checks only."""
    if not urls or not all(isinstance(u, str) and u.startswith(REDIS_SCHEMES) for u in urls):
        raise InvalidArgumentError(f"{what}.url must be a redis:// URL, got {list(urls)!r}")
    if not isinstance(namespace, str) or not namespace or NAMESPACE_BAD.search(namespace):
        raise InvalidArgumentError(
            f"{what}.namespace must be non-empty without ':' or a glob character "
            f"(*?[]\\): {namespace!r}"
        )
    timeout = require_finite_positive(f"{what}.timeout_s", timeout_s, InvalidArgumentError)
    if lease_s is None:
        lease_s = max(DEFAULT_LEASE_S, 2.0 * timeout)
    lease = require_finite_positive(f"{what}.lease_s", lease_s, InvalidArgumentError)
    check_lease_timing(
        lease, timeout, lease_name=f"{what}.lease_s", timeout_name=f"{what}.timeout_s"
    )
    return timeout, lease


def redis_support() -> str | None:
    """``None`` when the redis client is importable, else why the remote tier is unsupported."""
    if importlib.util.find_spec("redis") is None:
        return "the remote tier needs the redis client: pip install 'kvplane[redis]'"
    return None


def import_redis() -> Any:
    """The ``redis`` module, or :class:`UnsupportedError` with :func:`redis_support`'s reason."""
    reason = redis_support()
    if reason is not None:
        raise UnsupportedError(reason)
    import redis

    return redis


def redis_client(url: str, timeout_s: float) -> Any:
    """A lazy client of ``url`` whose every call, connecting included, fails after
    ``timeout_s`` and is never re-sent (``from_url`` leaves ``retry`` unset)."""
    return import_redis().Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )


def pipeline_groups(n: int, chunk_bytes: int) -> list[range]:
    """Index ranges over ``n`` chunks of ``chunk_bytes`` bytes, each at most
    :data:`PIPELINE_BYTES` of payload (at least one chunk): one pipelined round trip each."""
    per = max(1, PIPELINE_BYTES // chunk_bytes)
    return [range(a, min(a + per, n)) for a in range(0, n, per)]


class RemoteTier:
    """``num_slots`` chunk slots of ``chunk_bytes`` bytes under ``namespace`` on ``url``."""

    def __init__(
        self,
        url: str,
        num_slots: int,
        chunk_bytes: int,
        fingerprint: bytes,
        *,
        namespace: str = "kvplane",
        timeout_s: float = 5.0,
        lease_s: float | None = None,
        metrics: MetricsRegistry | None = None,
        name: str = "remote",
        coder: ChunkCoder | None = None,
    ) -> None:
        """Connect and claim ``namespace`` (see the module docstring): waits up to
        ``lease_s`` for another holder's lease to run out, then raises :class:`OffloadError`
        naming the holder; an unreachable server is an :class:`OffloadError` too. ``lease_s``
        defaults to :data:`DEFAULT_LEASE_S`, or ``2 * timeout_s`` when that is longer. Bad
        arguments, among them ``lease_s < 2 * timeout_s`` (``timeout_s`` bounds each Redis
        call; see :mod:`~kvplane.offload.tiers.lease`), raise :class:`InvalidArgumentError`
        before anything connects. ``coder`` codes every chunk (default: raw) and goes into
        the tier's fingerprint."""
        coder, fp = check_stored_tier("RemoteTier", num_slots, chunk_bytes, fingerprint, coder)
        timeout_s, lease_s = check_redis_settings(
            "RemoteTier", [url], namespace, timeout_s, lease_s
        )
        redis = import_redis()
        self.name = name
        self.url = url
        self.num_slots = num_slots
        self.chunk_bytes = chunk_bytes
        self.fingerprint = fp
        self.codec = "raw" if coder is None else coder.plan.ident
        self._coder = coder
        self.namespace = namespace
        self._counters = TierCounters(metrics, name)
        self._helper_pool: ThreadPoolExecutor | None = None
        self._helper_lock = threading.Lock()
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._read_errors = (*self._errors, MalformedMessageError, OffloadError)
        # A failed call raises within ``timeout_s``, counted, and its chunks become misses.
        # Safety does not rest on it: the writes are fenced on the server (module docstring).
        self._client: Any = redis_client(url, timeout_s)
        self._lease: NamespaceLease | None = None
        self._fence: Fence | None = None
        try:
            self._client.ping()
            self._lease = NamespaceLease(
                self._client, namespace, lease_s, self._errors, timeout_s=timeout_s
            )
            self._fence = Fence(self._client, namespace, self._lease.key, self._lease.token)
        except self._errors as exc:
            self.close()
            raise OffloadError(f"remote tier {url!r} is unreachable: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def _key(self, slot: int) -> bytes:
        """The payload's key (the header's is this plus ``:h``)."""
        return f"{self.namespace}:slot:{slot}".encode()

    def _fail(self, what: str, exc: BaseException) -> OffloadError:
        self._counters.error()
        return OffloadError(f"remote tier {self.url!r}: {what} failed: {exc}")

    # -- Tier protocol ----------------------------------------------------------------------------
    def write(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], payloads: Sequence[torch.Tensor]
    ) -> None:
        """Per chunk: stage the payload, then (fenced) drop the old header and move the
        payload onto its slot, then (fenced) set the header (module doc).

        The server refuses every change to a slot unless the owner key still holds our token
        when it runs, however late it arrives: a refusal, or a lease already found lost on the
        client (:attr:`NamespaceLease.lost`, asked before every round trip), fails the rest of
        the batch with :class:`OffloadError` (chunks already written are whole: header after
        payload; the refused group's chunks are misses, no slot of the new owner touched)."""
        check_batch(self.name, self.num_slots, self.chunk_bytes, slots, keys, payloads)
        fence = self._fenced()

        def send(group: range) -> None:
            names = [self._key(slots[i]) for i in group]
            coded = [encode_payload(self._coder, payloads[i]) for i in group]
            views = [data for _, data in coded]
            stages = fence.stage_keys(len(group))
            store = fence.store_keys(stages, names, [name + _HEADER for name in names])
            crcs = self._helper().submit(_checksums, views)  # overlaps the payload send
            try:
                self._check_lease()
                pipe = self._client.pipeline(transaction=False)
                fence.queue_delete(pipe, [k for name in names for k in (name + _HEADER, name)])
                fence.queue_stage(pipe, stages, views)
                fence.queue_store(pipe, store)
                replies = pipe.execute(raise_on_error=False)
            finally:
                wait([crcs])  # the helper is done with ``payloads`` even when the send failed
            for reply in replies[1:-1]:  # a stage SET refused (say, out of memory)
                if isinstance(reply, BaseException):
                    raise reply
            dropped, outcome = fence.deleted(replies[0]), fence.stored(replies[-1], store)
            if outcome is StoreOutcome.EXPIRED:
                self._counters.error()
                raise OffloadError(
                    f"remote tier {self.url!r}: write failed: a staged payload expired "
                    f"before its commit (STAGE_TTL_S={STAGE_TTL_S}); nothing was written"
                )
            if not dropped or outcome is not StoreOutcome.STORED:
                self._refused()
            sums = crcs.result()
            self._check_lease()
            headers = [
                ChunkHeader(keys[i], self.fingerprint, self.chunk_bytes, crc, tag, len(v)).encode()
                for i, crc, (tag, v) in zip(group, sums, coded, strict=True)
            ]
            if not fence.set([name + _HEADER for name in names], headers):
                self._refused()

        try:
            for group in pipeline_groups(len(slots), self.chunk_bytes):
                send(group)
        except self._errors as exc:
            raise self._fail("write", exc) from exc

    def _check_lease(self) -> None:
        """Raise (counted) unless the lease is held for at least one more round trip (the
        fast path: the server refuses a write of a lost lease anyway)."""
        if self._lease is None or self._lease.lost:
            self._refused()

    def _fenced(self) -> Fence:
        """The fence, once the lease is held for at least one more round trip (else raise)."""
        self._check_lease()
        if self._fence is None:  # no lease, no fence: _check_lease raised already
            self._refused()
        return self._fence

    def _refused(self) -> NoReturn:
        """Raise the lease-lost :class:`OffloadError` (counted); when the server refused, the
        lease is marked lost for good (the key is gone or another's)."""
        if self._lease is not None:
            self._lease.mark_lost()
        self._counters.error()
        raise OffloadError(
            f"remote tier {self.url!r}: write refused, the lease on namespace "
            f"{self.namespace!r} was lost (another engine may own it now)"
        )

    def _helper(self) -> ThreadPoolExecutor:
        with self._helper_lock:
            if self._helper_pool is None:
                name = f"kvplane-{self.name}-helper"
                self._helper_pool = ThreadPoolExecutor(1, thread_name_prefix=name)
            return self._helper_pool

    def read(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]
    ) -> list[ReadOutcome]:
        """``MGET`` each chunk's header and payload, the payload read straight into
        ``outs[i]`` (garbage there unless the outcome is OK), then check both (module doc)."""
        check_batch(self.name, self.num_slots, self.chunk_bytes, slots, keys, outs)
        if not slots:
            return []
        names = [(self._key(slot) + _HEADER, self._key(slot)) for slot in slots]
        received: list[ReadOutcome | _Received] = []
        sums: list[Future[list[int]]] = []

        def on_group(reader: ReplyReader, group: range) -> None:
            got = [self._receive(reader, keys[i], outs[i]) for i in group]
            views = [g[1] for g in got if isinstance(g, tuple)]
            sums.append(self._helper().submit(_checksums, views))  # while the next arrives
            received.extend(got)

        groups = pipeline_groups(len(slots), self.chunk_bytes)
        try:
            stream_mgets(self._client, names, groups, on_group)
        except self._read_errors as exc:
            raise self._fail("read", exc) from exc
        finally:
            wait(sums)  # the helper is done with ``outs`` even when the read failed
        crcs = iter([c for fut in sums for c in fut.result()])
        return [
            self._verify(g, next(crcs), out) if isinstance(g, tuple) else g
            for g, out in zip(received, outs, strict=True)
        ]

    def _receive(
        self, reader: ReplyReader, key: ChunkKey, out: torch.Tensor
    ) -> ReadOutcome | _Received:
        """One ``MGET`` reply: the header, then the payload when its length is the stored
        length the header names (else skipped): a raw one straight into ``out``, a coded one
        into a buffer of its own. The outcome, or what :meth:`_verify` checks and decodes."""
        if reader.array() != 2:
            raise MalformedMessageError("an MGET of header and payload did not answer two values")
        n = reader.bulk_length()
        if n is None or n == HEADER_BYTES:
            raw_header = None if n is None else reader.bulk_bytes(n)
        else:  # not a header we wrote: skipped unread (never an allocation of its size)
            reader.skip(n)
            raw_header = b""
        header = self._check(key, raw_header)
        length = reader.bulk_length()
        target = None
        if header is not None and length == header.stored:
            target = as_buffer(torch.empty(length, dtype=torch.uint8) if header.coded else out)
            reader.bulk_into(target)
        elif length is not None:
            reader.skip(length)
        if header is None:
            return ReadOutcome.MISSING if raw_header is None else ReadOutcome.CORRUPT
        if target is None:  # no payload, or one of another length than its header says
            self._counters.corrupt("missing" if length is None else "length")
            return ReadOutcome.CORRUPT
        return header, target

    def _verify(self, got: _Received, crc: int, out: torch.Tensor) -> ReadOutcome:
        """OK when the stored bytes match their checksum and, coded, decode into ``out``."""
        header, data = got
        reason = stored_fault(header, crc, data, self._coder, out)
        if reason is None:
            return ReadOutcome.OK
        self._counters.corrupt(reason)
        return ReadOutcome.CORRUPT

    def _check(self, key: ChunkKey | None, raw_header: bytes | None) -> ChunkHeader | None:
        if raw_header is None:
            if key is not None:
                self._counters.corrupt("missing")
            return None
        header = verify_header(raw_header, key, self.fingerprint, self.chunk_bytes)
        if isinstance(header, str):
            self._counters.corrupt(header)
            return None
        return header

    def scan(self) -> dict[ChunkKey, SlotId]:
        """Chunks whose headers name this layout and size, by key (lowest slot wins)."""
        prefix, suffix = f"{self.namespace}:slot:", _HEADER.decode()
        found: dict[ChunkKey, SlotId] = {}
        try:
            names = (  # a foreign key under our prefix is skipped, never a startup error
                _SLOT.fullmatch(k[len(prefix) : -len(suffix)])
                for k in self._client.scan_iter(match=f"{prefix}*{suffix}", count=1000)
            )
            for slot in sorted(int(m[0]) for m in names if m is not None):
                if slot >= self.num_slots:
                    continue
                header = self._check(None, self._client.get(self._key(slot) + _HEADER))
                if header is not None and header.key not in found:
                    found[header.key] = SlotId(slot)
        except self._errors as exc:
            raise self._fail("re-index", exc) from exc
        return found

    def clear(self) -> int:
        """Delete every slot of this namespace (a fresh start); returns how many slots went.
        Fenced like a write: a lost lease raises :class:`OffloadError` (slots deleted by an
        earlier batch of deletes stay deleted)."""
        fence = self._fenced()
        try:
            names = list(self._client.scan_iter(match=f"{self.namespace}:slot:*", count=1000))
            if not fence.delete(names):
                self._refused()
            return len({n.removesuffix(_HEADER) for n in names})
        except self._errors as exc:
            raise self._fail("clear", exc) from exc

    def close(self) -> None:
        """Release the namespace, stop the helper threads and close the connection pool;
        idempotent."""
        lease: NamespaceLease | None = getattr(self, "_lease", None)
        if lease is not None:
            lease.release()
        helper: ThreadPoolExecutor | None = getattr(self, "_helper_pool", None)
        if helper is not None:
            helper.shutdown(wait=True)
            self._helper_pool = None
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()


def _checksums(views: list[memoryview]) -> list[int]:
    """The payload checksums of ``views`` (on the helper thread: the CRC releases the GIL)."""
    return [payload_checksum(v) for v in views]
