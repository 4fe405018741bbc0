"""One Redis server of the shared store: content-addressed keys, the writer's fence, the
two-phase publish script and its outcomes, the compare-and-delete of a bad copy, the scan.

Owns one client and one writer registration; checks no chunk (that is
:mod:`~kvplane.offload.tiers.shared`). Key layout and scripts: docs/offload.md ("The shared
store").
"""

from __future__ import annotations

import enum
import itertools
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.errors import OffloadError
from kvplane.ids import ChunkKey
from kvplane.offload.slots import MAX_KEY_BYTES
from kvplane.offload.tiers.header import HEADER_BYTES
from kvplane.offload.tiers.lease import NamespaceLease

FENCED = b"fenced"
"""The value :func:`fence_off_writer` leaves in a writer's key: it never publishes again."""

_PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  for i = 2, #KEYS, 3 do redis.call('DEL', KEYS[i]) end
  return {}
end
local out = {}
for i = 2, #KEYS, 3 do
  if redis.call('EXISTS', KEYS[i + 1], KEYS[i + 2]) == 2 then
    redis.call('DEL', KEYS[i])
    out[#out + 1] = 2
  elseif redis.call('EXISTS', KEYS[i]) == 0 then
    out[#out + 1] = 3
  else
    redis.call('RENAME', KEYS[i], KEYS[i + 1])
    redis.call('PERSIST', KEYS[i + 1])
    redis.call('SET', KEYS[i + 2], ARGV[(i - 2) / 3 + 2])
    out[#out + 1] = 1
  end
end
return out
"""
"""KEYS: the writer key, then per chunk its stage, payload and header keys; ARGV: the writer's
token, then each chunk's header. Per chunk 1 published (stage renamed onto the payload, made
persistent, header set: one atomic step), 2 already held (stage dropped), 3 stage expired;
an empty reply: refused (not our writer key; our stage keys dropped, nothing else touched)."""
_FORGET = """
if redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[2]) or redis.call('GET', KEYS[1]) == ARGV[1]
then return redis.call('DEL', KEYS[1], KEYS[2]) end
return 0
"""
"""KEYS: a header and its payload; ARGV: the bad header read, the header size. Deletes both
only if the header is still that one or not of a header's size (a chunk republished meanwhile
stays)."""


class PublishOutcome(enum.Enum):
    """What publishing one chunk did on one server."""

    PUBLISHED = "published"
    DEDUPED = "deduped"  # the server held the chunk already: nothing was written
    EXPIRED = "expired"  # the staged payload ran out before the publish: nothing was written


@dataclass(frozen=True, slots=True)
class PublishResult:
    """Per chunk, the best outcome over the servers that answered (published, then deduped,
    then expired); ``failed``: per server that did not answer or refused the writer, its URL
    and why."""

    outcomes: tuple[PublishOutcome, ...]
    failed: tuple[str, ...]


REMOTE_MODES = ("private", "shared")
"""The remote tier's modes: a namespace leased to one engine, or the shared store."""


def replica_urls(text: str) -> list[str]:
    """The URLs of a comma-separated ``remote_replicas`` setting (blanks dropped)."""
    return [u.strip() for u in text.split(",") if u.strip()]


_CODES = {1: PublishOutcome.PUBLISHED, 2: PublishOutcome.DEDUPED, 3: PublishOutcome.EXPIRED}


def writer_key(namespace: str, writer_id: str) -> str:
    """The key whose value is writer ``writer_id``'s token while it may publish."""
    return f"{namespace}:writer:{writer_id}"


def fence_off_writer(client: Any, namespace: str, writer_id: str) -> None:
    """Fence writer ``writer_id`` of ``namespace`` off for good (an operator's act, through
    ``client``, a ``redis.Redis``): its publishes are refused from the next one on, and it
    never registers again under that id."""
    client.set(writer_key(namespace, writer_id), FENCED)


class SharedServer:
    """The shared store of ``namespace`` for chunks of ``fingerprint`` on one server.

    ``client`` is a ``redis.Redis`` whose calls end within ``timeout_s``; ``errors`` are its
    exception types, ``no_script`` its NOSCRIPT error. Registers a writer (a key of its own,
    renewed every third of ``lease_s``) on construction; stage keys live ``stage_ttl_s``.
    Thread-safe like its client."""

    def __init__(
        self,
        client: Any,
        namespace: str,
        fingerprint: bytes,
        errors: tuple[type[BaseException], ...],
        no_script: type[BaseException],
        *,
        timeout_s: float,
        lease_s: float,
        stage_ttl_s: float,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self._prefix = f"{namespace}:{fingerprint.hex()}:"
        self._errors = errors
        self._timeout_s, self._lease_s = timeout_s, lease_s
        self._stage_ms = max(1, int(stage_ttl_s * 1000))
        self._publish = client.register_script(_PUBLISH)
        self._forget = client.register_script(_FORGET)
        self._no_script: type[BaseException] = no_script
        self.rejoins = 0
        self._rejoin_lock = threading.Lock()
        self._seq = itertools.count()
        self.writer_id, self._writer = self._register()

    def _register(self) -> tuple[str, NamespaceLease]:
        """A fresh writer id and its registration (renewed from now on)."""
        writer_id = uuid.uuid4().hex[:16]
        lease = NamespaceLease(
            self.client, self.namespace, self._lease_s, self._errors,
            timeout_s=self._timeout_s, key=writer_key(self.namespace, writer_id),
        )  # fmt: skip
        return writer_id, lease

    def header_key(self, key: ChunkKey) -> bytes:
        return f"{self._prefix}h:{key.hex()}".encode()

    def payload_key(self, key: ChunkKey) -> bytes:
        return f"{self._prefix}p:{key.hex()}".encode()

    def held(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Per key: whether this server holds both its header and its payload now."""
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self.header_key(k), self.payload_key(k))
        return [n == 2 for n in pipe.execute()]

    def _writer_token(self) -> str:
        """The token to publish with: re-registers when the old writer key is gone (expired,
        or a restarted server); raises :class:`OffloadError` when it is fenced off, or still
        ours but too close to running out for a command sent now."""
        with self._rejoin_lock:  # two job threads finding it lost register once
            if not self._writer.lost:
                return self._writer.token
            current = self.client.get(self._writer.key)
            if current is None:
                self._writer.release()
                self.writer_id, self._writer = self._register()
                self.rejoins += 1
                return self._writer.token
        what = "fenced off" if current == FENCED else "not renewed in time"
        raise OffloadError(f"shared store writer {self.writer_id} is {what}: publish refused")

    def publish(
        self, keys: Sequence[ChunkKey], headers: Sequence[bytes], views: Sequence[memoryview]
    ) -> list[PublishOutcome]:
        """Stage each payload (``SET PX``), then publish all in one atomic script (one
        pipelined round trip). A refusal because the writer key is gone (it lapsed, or the
        server restarted) registers a fresh writer and sends once more; a refusal otherwise
        (fenced off) raises :class:`OffloadError`. Nothing is published by a refused try (its
        stages are dropped). The client's errors propagate."""
        if not keys:
            return []
        for attempt in (0, 1):
            codes = self._send(self._writer_token(), keys, headers, views)
            if codes:
                return [_CODES[int(c)] for c in codes]
            self._writer.mark_lost()
            if attempt or self.client.get(self._writer.key) is not None:
                break
        raise OffloadError(f"shared store writer {self.writer_id} was refused: fenced off")

    def _send(
        self,
        token: str,
        keys: Sequence[ChunkKey],
        headers: Sequence[bytes],
        views: Sequence[memoryview],
    ) -> list[int]:
        """One pipelined try of :meth:`publish`: the script's codes (empty: refused)."""
        stage = f"{self.namespace}:stage:{self.writer_id}:"
        script_keys: list[bytes | str] = [self._writer.key]
        pipe = self.client.pipeline(transaction=False)
        for k, view in zip(keys, views, strict=True):
            name = f"{stage}{next(self._seq)}".encode()
            pipe.set(name, view, px=self._stage_ms)
            script_keys += [name, self.payload_key(k), self.header_key(k)]
        pipe.evalsha(self._publish.sha, len(script_keys), *script_keys, token, *headers)
        replies = pipe.execute(raise_on_error=False)
        for reply in replies[:-1]:  # a stage SET refused (out of memory)
            if isinstance(reply, BaseException):
                raise reply
        codes = replies[-1]
        if isinstance(codes, self._no_script):  # a restarted server: load it and run once more
            codes = self._publish(keys=script_keys, args=[token, *headers])
        elif isinstance(codes, BaseException):
            raise codes
        return list(codes)

    def names(self, key: ChunkKey) -> tuple[bytes, bytes]:
        """The header and payload keys of chunk ``key``: what a read ``MGET``s."""
        return self.header_key(key), self.payload_key(key)

    def forget(self, key: ChunkKey, bad_header: bytes) -> None:
        """Delete chunk ``key`` if its header is still ``bad_header`` (read back bad), so a
        later publish replaces it instead of being deduplicated against it."""
        self._forget(keys=list(self.names(key)), args=[bad_header, HEADER_BYTES])

    def scan(self) -> list[ChunkKey]:
        """The chunk keys whose headers this server holds for the fingerprint (names only;
        payloads are verified when read). Names that do not parse are skipped."""
        head = f"{self._prefix}h:"
        found: list[ChunkKey] = []
        for name in self.client.scan_iter(match=f"{head}*", count=1000):
            try:
                raw = bytes.fromhex(name.decode()[len(head) :])
            except ValueError:
                continue
            if 0 < len(raw) <= MAX_KEY_BYTES:
                found.append(ChunkKey(raw))
        return found

    def close(self) -> None:
        """Stop renewing (deleting the writer key if still ours) and close the client."""
        self._writer.release()
        self.client.close()
