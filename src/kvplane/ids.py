"""Typed identifiers and the half-open token range shared by every layer.

Ids are ``NewType`` wrappers: free at run time, distinct to mypy, so a ``BlockId`` cannot be
passed where a ``SlotId`` is expected. ``TokenRange`` is the one value type for ``[start, end)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

from kvplane.errors import InvalidArgumentError
from kvplane.validators import require_int

BlockId = NewType("BlockId", int)
"""Index of a block inside one block pool."""
SlotId = NewType("SlotId", int)
"""Index of a chunk slot inside one offload tier."""
LayerId = NewType("LayerId", int)
"""Model layer index (global, not local to a pipeline stage)."""
RegionId = NewType("RegionId", int)
"""Handle of a memory region registered with one transport."""
SliceId = NewType("SliceId", int)
"""Sequence number of a pipelined prefill slice within one session (0, 1, 2, ...)."""
JobId = NewType("JobId", int)
"""Identity of one offload transfer job."""
RequestId = NewType("RequestId", str)
"""Identity of one inference request, chosen by the caller (router / engine)."""
SessionId = NewType("SessionId", str)
"""Identity of one PD transfer session (one request between one sender and one receiver)."""
PeerId = NewType("PeerId", str)
"""Identity of a remote participant (worker / engine)."""
BlockHash = NewType("BlockHash", bytes)
"""Chained content hash of one full block (32 bytes); see ``kvplane.blocks.hashing``."""
ChunkKey = NewType("ChunkKey", bytes)
"""Identity of a chunk: the block hash of its last block, so it commits to the whole prefix."""


@dataclass(frozen=True, slots=True, order=True)
class TokenRange:
    """Half-open ``[start, end)`` token positions of one sequence; ``start <= end``, both >= 0."""

    start: int
    end: int

    def __post_init__(self) -> None:
        require_int("TokenRange.start", self.start)
        require_int("TokenRange.end", self.end)
        if self.start < 0 or self.end < self.start:
            raise InvalidArgumentError(
                f"TokenRange needs 0 <= start <= end, got [{self.start}, {self.end})"
            )

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def empty(self) -> bool:
        return self.end == self.start

    def contains(self, other: TokenRange) -> bool:
        """True when ``other`` lies inside this range (an empty range lies inside any range)."""
        return other.empty or (self.start <= other.start and other.end <= self.end)

    def intersect(self, other: TokenRange) -> TokenRange:
        """The overlap of two ranges; an empty range at ``max(start)`` when they are disjoint."""
        lo = max(self.start, other.start)
        hi = min(self.end, other.end)
        return TokenRange(lo, max(lo, hi))

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"
