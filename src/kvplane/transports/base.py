"""The transport contract: name memory, move bytes, report progress — never decide what moves.

:class:`Region`, :class:`Peer`, :class:`Poll`, :class:`Handle`, the transfer enums and the
:class:`Transport` protocol: ``register``/``connect`` name memory, ``submit`` moves paired
descriptor lists (checked before any byte moves), ``poll`` reports PENDING until DONE, FAILED or
IN_DOUBT, and ``notify`` arrives only after the batch's bytes. No implementation lives here
(``core`` shares one). See docs/transports.md ("The transport contract").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from kvplane.ids import PeerId, RegionId
from kvplane.transports.descriptors import DescriptorList, Int64Array, check_pairing

__all__ = [
    "DescriptorList", "FailureKind", "Handle", "Int64Array", "Peer", "Poll", "Region",
    "Transport", "XferKind", "XferState", "check_pairing",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Region:
    """A registered contiguous buffer: ``length`` bytes at host/device address ``base``."""

    region_id: RegionId
    base: int
    length: int
    device: str = "cpu"


@dataclass(frozen=True, slots=True)
class Peer:
    """A connected remote participant: its id and the lengths of the regions it exposes."""

    peer_id: PeerId
    regions: dict[RegionId, int] = field(default_factory=dict)


class XferKind(enum.Enum):
    """WRITE: local sources → peer destinations (push). READ: peer sources → local (pull)."""

    WRITE = "write"
    READ = "read"


class XferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    IN_DOUBT = "in_doubt"

    @property
    def terminal(self) -> bool:
        return self is not XferState.PENDING


class FailureKind(enum.Enum):
    """Why a batch failed (``Poll.failure``)."""

    REMOTE_DISCONNECT = "remote_disconnect"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    BACKEND_ERROR = "backend_error"
    LOCAL_ERROR = "local_error"


@dataclass(frozen=True, slots=True)
class Poll:
    """Progress of one batch: state, bytes known to have landed, and why it failed if it did."""

    state: XferState
    bytes_done: int = 0
    failure: FailureKind | None = None
    reason: str = ""
    ended_at: float | None = field(default=None, compare=False)
    """When the transport saw the batch end (its ``time.monotonic()``); None while PENDING, or
    when the transport cannot tell (a remote or injected outcome). A caller that polls later
    learns the state late, not the time. A measurement, not part of the outcome: polls that
    differ only here are equal."""


@dataclass(frozen=True, slots=True)
class Handle:
    """Identity of one submitted batch on one transport."""

    transport: str
    xfer_id: int
    peer_id: PeerId
    num_bytes: int


@runtime_checkable
class Transport(Protocol):
    """A byte mover. Implementations live one per file in ``kvplane.transports``."""

    name: str

    def register(self, buffer: torch.Tensor) -> Region:
        """Expose a contiguous CPU (or device, where supported) tensor's bytes as a region.
        Overlapping an existing region is a ``TransportError``; the tensor must outlive it."""
        ...

    def deregister(self, region_id: RegionId) -> None:
        """Forget a region; refused (``TransportError``) while a batch in flight uses it."""
        ...

    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``connect`` (address, agent name, region table)."""
        ...

    def connect(self, peer_metadata: bytes) -> Peer:
        """Connect to (or refresh) a peer from its metadata; idempotent per peer id."""
        ...

    def submit(
        self,
        kind: XferKind,
        src: DescriptorList,
        dst: DescriptorList,
        peer: Peer,
        *,
        notify: bytes | None = None,
        deadline_s: float = 30.0,
    ) -> Handle:
        """Validate and start one batch; ``PlanError`` before any byte moves if invalid."""
        ...

    def poll(self, handle: Handle) -> Poll:
        """Non-blocking progress of a batch; terminal states are sticky."""
        ...

    def cancel(self, handle: Handle) -> None:
        """Best effort: a batch that may have partially landed ends IN_DOUBT or FAILED."""
        ...

    def notifications(self) -> list[tuple[PeerId, bytes]]:
        """Drain ``notify`` messages that arrived from peers (each after its bytes landed)."""
        ...

    def close(self) -> None:
        """Release every region, connection and thread; idempotent. Batches still live end
        FAILED(LOCAL_ERROR) if no byte of theirs had begun to move, else IN_DOUBT."""
        ...
