"""The transport contract: name memory, move bytes, report progress — never decide what moves.

Theory of operation
-------------------
A transport exposes local memory as *regions* (``register``), publishes opaque ``metadata()``
bytes that a peer passes to ``connect`` to obtain a :class:`Peer` (which lists the peer's
regions and their lengths), and executes batches of byte moves described by two aligned
:class:`DescriptorList` s: element ``i`` of ``src`` moves to element ``i`` of ``dst`` and both have
the same length. For ``XferKind.WRITE`` the sources are local and the destinations are the
peer's; for ``READ`` the reverse. Descriptor lists are columnar (three int64 numpy arrays), so a
plan of a hundred thousand runs costs three arrays, not a hundred thousand objects.

``submit`` validates every descriptor against the registered regions before any byte moves
(``PlanError``), then returns a :class:`Handle`; lists already proved by
:mod:`~kvplane.transports.checks` (a validated plan's ops) are checked only for their regions
still being registered. ``poll`` reports a :class:`Poll`: PENDING until
the batch ends in DONE, FAILED(reason) or IN_DOUBT (the transport cannot tell whether the bytes
landed, e.g. the connection broke after the last send). Every batch has a deadline; passing it
turns the handle FAILED with ``FailureKind.TIMEOUT`` — or IN_DOUBT (failure TIMEOUT) when every
byte was already handed over but the peer never acknowledged, since they may have landed. A
peer that dies surfaces as FAILED with ``FailureKind.REMOTE_DISCONNECT``, never a hang.
``notify`` bytes, when given, are delivered to the peer's ``notifications()`` after (and only
after) all of the batch's bytes have landed there.
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
