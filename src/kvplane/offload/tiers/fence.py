"""Fenced writes to a Redis namespace: Lua scripts that change keys only while the owner key
holds our lease token.

Payloads go to per-writer stage keys and are renamed onto their slots. See docs/offload.md.
"""

from __future__ import annotations

import enum
import itertools
import uuid
from collections.abc import Sequence
from typing import Any

STAGE_TTL_S = 300.0
"""The expiry of a stage key (a payload on its way to its slot): it must outlive the send of
the rest of its group (8 MiB at 28 KiB/s), and bounds how long a writer that died part-way
leaves a group's payloads behind. The store script persists the renamed key."""

_STORE = """
local n = #KEYS
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  for i = 2, n, 3 do redis.call('DEL', KEYS[i]) end
  return 0
end
for i = 2, n, 3 do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    for k = 2, n, 3 do redis.call('DEL', KEYS[k]) end
    return 2
  end
end
for i = 2, n, 3 do
  redis.call('DEL', KEYS[i + 2])
  redis.call('RENAME', KEYS[i], KEYS[i + 1])
  redis.call('PERSIST', KEYS[i + 1])
end
return 1
"""
"""KEYS: the owner key, then per payload its stage, target and a key to drop first; ARGV: our
token. 1 stored, 0 refused, 2 a stage key expired (in both: our stage keys deleted, nothing
else touched). Every check comes before any change: a script failing part-way keeps what it
did."""
_SET = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 2, #KEYS do redis.call('SET', KEYS[i], ARGV[i]) end
return 1
"""
"""KEYS: the owner key, then the keys to set; ARGV: our token, then their values. 1 or 0."""
_DELETE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""
"""KEYS: the owner key, then the keys to delete; ARGV: our token. 1 or 0 (refused)."""
DELETE_BATCH = 1000
"""Keys per :meth:`Fence.delete` script (a script blocks the server while it runs)."""


class StoreOutcome(enum.Enum):
    """What a queued store did on the server."""

    STORED = "stored"
    REFUSED = "refused"  # the owner key is not ours: the lease is gone for good
    EXPIRED = "expired"  # a stage key ran out before the store script ran


class Fence:
    """The fenced scripts of one namespace, bound to a ``redis.Redis`` client and a lease's
    owner key and token (``str``)."""

    def __init__(self, client: Any, namespace: str, owner_key: str, token: str) -> None:
        import redis

        self._client = client
        self._owner, self._token = owner_key, token
        self._no_script: type[BaseException] = redis.exceptions.NoScriptError
        self._store = client.register_script(_STORE)
        self._set = client.register_script(_SET)
        self._delete = client.register_script(_DELETE)
        self._stage_prefix = f"{namespace}:stage:{uuid.uuid4().hex[:16]}:"
        self._stage_seq = itertools.count()

    def stage_keys(self, n: int) -> list[bytes]:
        """``n`` fresh stage keys of this writer (never handed out twice)."""
        return [f"{self._stage_prefix}{next(self._stage_seq)}".encode() for _ in range(n)]

    def queue_delete(self, pipe: Any, keys: Sequence[bytes]) -> None:
        """Queue on ``pipe`` a fenced delete of ``keys``; read its reply with
        :meth:`deleted`. Queued before a store's stage ``SET``s, it frees the old values so the
        server reuses their memory for the new ones (a 4 MiB store: 0.75-0.81 of a raw ``SET``
        loop without it, 0.97-0.99 with, two A/B runs)."""
        pipe.evalsha(self._delete.sha, 1 + len(keys), self._owner, *keys, self._token)

    def queue_stage(self, pipe: Any, stages: Sequence[bytes], views: Sequence[memoryview]) -> None:
        """Queue the ``SET PX`` of each payload to its stage key (one reply each)."""
        ttl_ms = int(STAGE_TTL_S * 1000)
        for stage, view in zip(stages, views, strict=True):
            pipe.set(stage, view, px=ttl_ms)

    def store_keys(
        self, stages: Sequence[bytes], targets: Sequence[bytes], drops: Sequence[bytes]
    ) -> list[bytes | str]:
        """The store script's keys: move each stage onto its target, first deleting its drop."""
        keys: list[bytes | str] = [self._owner]
        for triple in zip(stages, targets, drops, strict=True):
            keys += triple
        return keys

    def queue_store(self, pipe: Any, keys: Sequence[bytes | str]) -> None:
        """Queue the store script for :meth:`store_keys`; read its reply with :meth:`stored`."""
        pipe.evalsha(self._store.sha, len(keys), *keys, self._token)

    def deleted(self, reply: Any) -> bool:
        """Whether a queued delete ran (False: refused). A server that lost the script is
        given it again and counted as done, since the store script drops its keys too."""
        if isinstance(reply, self._no_script):
            self._client.script_load(_DELETE)
            return True
        if isinstance(reply, BaseException):
            raise reply
        return bool(reply == 1)

    def stored(self, reply: Any, keys: Sequence[bytes | str]) -> StoreOutcome:
        """The outcome of a queued store (run once more when the server lost the script;
        raises the server's error)."""
        if isinstance(reply, self._no_script):
            reply = self._store(keys=list(keys), args=[self._token])
        elif isinstance(reply, BaseException):
            raise reply
        return {1: StoreOutcome.STORED, 2: StoreOutcome.EXPIRED}.get(reply, StoreOutcome.REFUSED)

    def set(self, keys: Sequence[bytes], values: Sequence[bytes]) -> bool:
        """Set each key to its value in one fenced script; False: refused, nothing set."""
        return bool(self._set(keys=[self._owner, *keys], args=[self._token, *values]) == 1)

    def delete(self, keys: Sequence[bytes]) -> bool:
        """Delete ``keys`` in fenced scripts of :data:`DELETE_BATCH`; False: refused (keys of
        earlier scripts stay deleted)."""
        for a in range(0, len(keys), DELETE_BATCH):
            batch = list(keys[a : a + DELETE_BATCH])
            if self._delete(keys=[self._owner, *batch], args=[self._token]) != 1:
                return False
        return True
