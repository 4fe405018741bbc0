"""Engines that address memory by pointer (``nixl``, ``mooncake``): base tables and addresses.

Such an engine is told ``base[region] + offset``: this module builds the region tables carried
in metadata, reads them back on ``connect``, and turns descriptor lists into addresses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from kvplane.errors import TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.transports.base import DescriptorList, Peer
from kvplane.transports.regions import RegionEntry
from kvplane.transports.wire import Metadata, RegionInfo


def region_infos(entries: Iterable[RegionEntry]) -> list[RegionInfo]:
    """The metadata row of each registered region: id, length and base address."""
    return [RegionInfo(int(e.region.region_id), e.region.length, e.region.base) for e in entries]


def local_bases(entries: Iterable[RegionEntry]) -> dict[RegionId, int]:
    """Base address of each registered region, by id."""
    return {e.region.region_id: e.region.base for e in entries}


def peer_tables(meta: Metadata) -> tuple[Peer, dict[RegionId, int]]:
    """The peer a decoded metadata names (its region lengths) and its regions' base addresses."""
    peer = Peer(PeerId(meta.agent), {RegionId(r.region_id): r.length for r in meta.regions})
    return peer, {RegionId(r.region_id): r.base for r in meta.regions}


def addresses(
    bases: dict[RegionId, int], descs: DescriptorList, engine: str
) -> np.ndarray[Any, Any]:
    """Int64 addresses ``base[region] + offset`` of ``descs``, vectorised. A region missing
    from ``bases`` (say a peer table refreshed between ``submit``'s check and the transfer) is
    a ``TransportError`` naming ``engine``, never a neighbour's base."""
    ids = np.array(sorted(bases), dtype=np.int64)
    base = np.array([bases[RegionId(int(i))] for i in ids], dtype=np.int64)
    at = np.minimum(np.searchsorted(ids, descs.regions), max(len(ids) - 1, 0))
    if len(descs) and (not len(ids) or bool(np.any(ids[at] != descs.regions))):
        unknown = sorted(set(descs.regions.tolist()) - set(ids.tolist()))
        raise TransportError(f"{engine} has no base address for region(s) {unknown}")
    return base[at] + descs.offsets
