"""The local region table every transport keeps: registration, overlap refusal, pins.

Ids are never reused; a pinned region cannot be removed. Thread-safe. See docs/transports.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvplane.errors import InvalidArgumentError, TransportError
from kvplane.ids import RegionId
from kvplane.transports.base import Region


@dataclass(slots=True)
class RegionEntry:
    """A registered region: its public value, a flat uint8 view, pin count and export flag."""

    region: Region
    view: torch.Tensor
    exported: bool = True
    pins: int = 0
    extra: object = None
    removing: bool = False
    """Being deregistered: no new pin may take it (set by :meth:`RegionTable.begin_removal`)."""


def byte_view(buffer: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's bytes (no copy); typed error otherwise."""
    if not isinstance(buffer, torch.Tensor):
        raise InvalidArgumentError(f"register() needs a torch.Tensor, got {type(buffer).__name__}")
    if not buffer.is_contiguous():
        raise InvalidArgumentError(
            f"register() needs a contiguous tensor, got shape {tuple(buffer.shape)} with strides "
            f"{buffer.stride()}"
        )
    if buffer.numel() == 0:
        raise InvalidArgumentError("register() needs a non-empty tensor")
    return buffer.detach().reshape(-1).view(torch.uint8)


class RegionTable:
    """Registered regions of one transport, keyed by ``RegionId``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[RegionId, RegionEntry] = {}
        self._next = 1

    def add(self, buffer: torch.Tensor, *, exported: bool = True, extra: object = None) -> Region:
        """Register ``buffer``; ``TransportError`` if its bytes overlap a registered region."""
        view = byte_view(buffer)
        base, length = view.data_ptr(), view.numel()
        device = str(view.device)
        with self._lock:
            for entry in self._entries.values():
                r = entry.region
                if r.device == device and base < r.base + r.length and r.base < base + length:
                    raise TransportError(
                        f"buffer [{base:#x}, {base + length:#x}) on {device} overlaps region "
                        f"{r.region_id} [{r.base:#x}, {r.base + r.length:#x})"
                    )
            rid = RegionId(self._next)
            self._next += 1
            region = Region(rid, base, length, device)
            self._entries[rid] = RegionEntry(region, view, exported, 0, extra)
            return region

    def entry(self, region_id: RegionId) -> RegionEntry:
        with self._lock:
            return self._get(region_id)

    def _get(self, region_id: RegionId) -> RegionEntry:
        entry = self._entries.get(region_id)
        if entry is None:
            raise TransportError(f"region {region_id} is not registered")
        return entry

    def _unpinned(self, region_id: RegionId) -> RegionEntry:
        entry = self._get(region_id)
        if entry.removing:
            raise TransportError(f"region {region_id} is already being deregistered")
        if entry.pins:
            raise TransportError(
                f"region {region_id} is in use by {entry.pins} in-flight batch(es); "
                "deregister it after they end"
            )
        return entry

    def begin_removal(self, region_id: RegionId) -> RegionEntry:
        """Start deregistering an unpinned region: from now on :meth:`pin` refuses it, so no
        batch can take it between the engine's deregistration and :meth:`remove`.
        ``TransportError`` if it is unknown, in use or already being removed."""
        with self._lock:
            entry = self._unpinned(region_id)
            entry.removing = True
            return entry

    def cancel_removal(self, region_id: RegionId) -> None:
        """The engine refused to let the region go: it is usable again."""
        with self._lock:
            entry = self._entries.get(region_id)
            if entry is not None:
                entry.removing = False

    def remove(self, region_id: RegionId) -> RegionEntry:
        """Forget an unpinned region (a removal begun, or none: the same refusals otherwise)."""
        with self._lock:
            entry = self._get(region_id)
            if not entry.removing:
                entry = self._unpinned(region_id)
            del self._entries[region_id]
            return entry

    def lengths(self, *, exported_only: bool = False) -> dict[RegionId, int]:
        with self._lock:
            return {
                rid: e.region.length
                for rid, e in self._entries.items()
                if e.exported or not exported_only
            }

    def entries(self) -> list[RegionEntry]:
        with self._lock:
            return list(self._entries.values())

    def views(self, region_ids: Iterable[int]) -> dict[RegionId, torch.Tensor]:
        with self._lock:
            return {RegionId(int(r)): self._get(RegionId(int(r))).view for r in region_ids}

    def pin(
        self, region_ids: Iterable[int], *, exported_only: bool = False
    ) -> tuple[RegionId, ...]:
        """Pin each distinct region once, all or nothing; ``TransportError`` if one is missing."""
        ids = tuple(sorted({RegionId(int(r)) for r in region_ids}))
        with self._lock:
            for rid in ids:
                entry = self._get(rid)
                if exported_only and not entry.exported:
                    raise TransportError(f"region {rid} is not exported to peers")
                if entry.removing:
                    raise TransportError(f"region {rid} is being deregistered")
            for rid in ids:
                self._entries[rid].pins += 1
        return ids

    def unpin(self, region_ids: Iterable[RegionId]) -> None:
        with self._lock:
            for rid in region_ids:
                entry = self._entries.get(rid)
                if entry is not None and entry.pins > 0:
                    entry.pins -= 1

    def total_pins(self) -> int:
        with self._lock:
            return sum(e.pins for e in self._entries.values())

    def clear(self) -> list[RegionEntry]:
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            return entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
