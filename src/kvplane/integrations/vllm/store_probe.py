"""The scheduler side's window on the shared store: which chunks other engines published.

Owns :class:`StoreId` (where one rank's worker publishes: servers, namespace, the fingerprint
its headers carry; plain data for the start-up handshake), :func:`store_id` (a worker's, from
its lower tiers) and :class:`StoreProbe` (one ``held`` batch per rank's store, answered only
where every rank's copy is held). It asks; it never reads, writes or decides: the tier book
decides what to ask and what to adopt (:mod:`kvplane.offload.discovery`). Why the scheduler
process asks: ``docs/vllm.md`` ("The shared store").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.offload.tiers.base import Tier
from kvplane.offload.tiers.shared import SharedTier
from kvplane.validators import require_finite_positive, require_size


@dataclass(frozen=True, slots=True)
class StoreId:
    """Where one rank's worker publishes chunks of ``chunk_bytes`` bytes: namespace
    ``namespace`` on ``urls`` (the first, then replicas), under ``fingerprint`` (the tier's,
    codec mixed in: exactly what its headers and key names carry)."""

    urls: tuple[str, ...]
    namespace: str
    fingerprint: bytes
    chunk_bytes: int

    def __post_init__(self) -> None:
        if not self.urls or not self.namespace or not self.fingerprint:
            raise InvalidArgumentError(f"a store id needs urls, namespace, fingerprint: {self}")
        require_size("StoreId.chunk_bytes", self.chunk_bytes, min=1)


def store_id(tiers: Mapping[str, Tier]) -> StoreId | None:
    """The shared store among a worker's lower ``tiers`` (by name), or ``None``."""
    for tier in tiers.values():
        if isinstance(tier, SharedTier):
            return StoreId(tier.urls, tier.namespace, tier.fingerprint, tier.chunk_bytes)
    return None


class StoreProbe:
    """Asks each distinct rank store of ``ids`` (rank order) whether it holds chunks.

    Each store is a :class:`~kvplane.offload.tiers.shared.SharedTier` opened with that id's
    fingerprint as is (no codec: it only asks), so its key names are the worker's. Opening
    registers a writer that never publishes. Errors as ``SharedTier``'s constructor; a server
    that fails a question is skipped (a miss, never an error). Not thread-safe."""

    def __init__(self, ids: Sequence[StoreId], timeout_s: float) -> None:
        if not ids:
            raise InvalidArgumentError("a store probe needs at least one rank's store id")
        timeout_s = require_finite_positive("StoreProbe.timeout_s", timeout_s, InvalidArgumentError)
        self.ids = tuple(dict.fromkeys(ids))  # MLA shared keys: one store for every rank
        self._stores: list[SharedTier] = []
        try:
            for sid in self.ids:
                self._stores.append(
                    SharedTier(
                        sid.urls, 1, sid.chunk_bytes, sid.fingerprint,
                        namespace=sid.namespace, timeout_s=timeout_s,
                    )
                )  # fmt: skip
        except BaseException:
            self.close()
            raise

    def held(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Per key: held now by every rank's store (a later read may still miss it). One
        pipelined round trip per store and server asked (:meth:`SharedTier.held`)."""
        found = [True] * len(keys)
        for store in self._stores:
            todo = [i for i, f in enumerate(found) if f]
            if not todo:
                break
            for i, h in zip(todo, store.held([keys[i] for i in todo]), strict=True):
                found[i] = h
        return found

    def close(self) -> None:
        """Close every store's connections; idempotent."""
        while self._stores:
            self._stores.pop().close()
