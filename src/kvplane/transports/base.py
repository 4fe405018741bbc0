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
(``PlanError``), then returns a :class:`Handle`. ``poll`` reports a :class:`Poll`: PENDING until
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from kvplane.errors import PlanError
from kvplane.ids import PeerId, RegionId

Int64Array = npt.NDArray[np.int64]


def _frozen_int64(values: npt.ArrayLike, what: str) -> Int64Array:
    arr = np.ascontiguousarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise PlanError(f"{what} must be one-dimensional, got shape {arr.shape}")
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, slots=True, eq=False)
class DescriptorList:
    """Columnar list of ``(region, offset, length)`` byte ranges; arrays are read-only int64."""

    regions: Int64Array
    offsets: Int64Array
    lengths: Int64Array

    def __post_init__(self) -> None:
        regions = _frozen_int64(self.regions, "regions")
        offsets = _frozen_int64(self.offsets, "offsets")
        lengths = _frozen_int64(self.lengths, "lengths")
        if not len(regions) == len(offsets) == len(lengths):
            raise PlanError(
                f"descriptor columns differ in length: {len(regions)}, {len(offsets)}, "
                f"{len(lengths)}"
            )
        if len(offsets) and (int(offsets.min()) < 0 or int(lengths.min()) <= 0):
            raise PlanError("descriptor offsets must be >= 0 and lengths > 0")
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "lengths", lengths)

    @classmethod
    def of(cls, triples: Sequence[tuple[int, int, int]]) -> DescriptorList:
        """Build from ``(region, offset, length)`` tuples (convenience for tests and tools)."""
        if not triples:
            return cls.empty()
        cols = np.asarray(triples, dtype=np.int64).reshape(-1, 3)
        return cls(cols[:, 0], cols[:, 1], cols[:, 2])

    @classmethod
    def empty(cls) -> DescriptorList:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z)

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum())

    def equals(self, other: DescriptorList) -> bool:
        return (
            np.array_equal(self.regions, other.regions)
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.lengths, other.lengths)
        )

    def check_bounds(self, region_lengths: dict[RegionId, int], side: str) -> None:
        """Raise ``PlanError`` if a descriptor names an unknown region or runs past its end."""
        if not len(self):
            return
        one = int(self.regions.min()) == int(self.regions.max())  # common: skip the sort
        ids = self.regions[:1] if one else np.unique(self.regions)
        unknown = [int(r) for r in ids if RegionId(int(r)) not in region_lengths]
        if unknown:
            raise PlanError(f"{side} descriptors name unknown region(s) {unknown}")
        limits = np.array([region_lengths[RegionId(int(r))] for r in ids], dtype=np.int64)
        per_desc = limits[np.searchsorted(ids, self.regions)]
        over = np.nonzero(self.offsets + self.lengths > per_desc)[0]
        if len(over):
            i = int(over[0])
            raise PlanError(
                f"{side} descriptor {i} (region {int(self.regions[i])}, offset "
                f"{int(self.offsets[i])}, length {int(self.lengths[i])}) runs past the region "
                f"end {int(per_desc[i])}"
            )


def check_pairing(src: DescriptorList, dst: DescriptorList) -> None:
    """Raise ``PlanError`` unless ``src[i]`` and ``dst[i]`` exist pairwise with equal lengths."""
    if len(src) != len(dst):
        raise PlanError(f"{len(src)} source descriptors but {len(dst)} destination descriptors")
    bad = np.nonzero(src.lengths != dst.lengths)[0]
    if len(bad):
        i = int(bad[0])
        raise PlanError(
            f"descriptor pair {i}: source length {int(src.lengths[i])} != destination length "
            f"{int(dst.lengths[i])}"
        )


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
        """Release every region, connection and thread; idempotent."""
        ...
