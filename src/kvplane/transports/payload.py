"""Streaming descriptor bytes through a socket: frames out of a batch, payload in and out.

Each run goes direct, vectored or through a staging buffer, by its length. See
docs/transports.md.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from kvplane.ids import RegionId
from kvplane.transports import vectored
from kvplane.transports.base import DescriptorList, Int64Array
from kvplane.transports.copier import copy_packed
from kvplane.transports.wire import recv_exact

DIRECT_MIN = 64 << 10
"""Runs at least this long move between socket and region memory directly."""
STAGING_BYTES = 4 << 20
"""Short runs are packed into fills of about this many bytes."""
FRAME_BYTES = 16 << 20
FRAME_DESCRIPTORS = 8192
VECTORED_MEAN = 1024
"""A frame whose runs average at least this many bytes (and less than ``DIRECT_MIN``, where one
call per run is already amortised) moves by vectored I/O (``vectored``)."""


def staging_buffer() -> torch.Tensor:
    """A staging buffer big enough for one fill (a fill may overrun by one short run)."""
    return torch.empty(STAGING_BYTES + DIRECT_MIN, dtype=torch.uint8)


def sub(descs: DescriptorList, a: int, b: int) -> DescriptorList:
    return DescriptorList(descs.regions[a:b], descs.offsets[a:b], descs.lengths[a:b])


def frames(lengths: Int64Array) -> Iterator[tuple[int, int]]:
    """``[a, b)`` index ranges of at most FRAME_DESCRIPTORS runs and ~FRAME_BYTES payload."""
    n = len(lengths)
    if n == 0:
        return
    starts = np.cumsum(lengths) - lengths
    by_bytes = starts // FRAME_BYTES
    by_count = np.arange(n) // FRAME_DESCRIPTORS
    key = by_bytes * (n + 1) + by_count
    cuts = np.flatnonzero(np.diff(key)) + 1
    bounds = [0, *cuts.tolist(), n]
    yield from itertools.pairwise(bounds)


def _pieces(lengths: Int64Array) -> Iterator[tuple[int, int, bool]]:
    """``[a, b)`` ranges that are either one direct run each or one staging fill of short runs."""
    n = len(lengths)
    if n == 0:
        return
    direct = lengths >= DIRECT_MIN
    fill = (np.cumsum(lengths) - lengths) // STAGING_BYTES
    key = np.where(direct, np.arange(n) + 1, 0) * (int(fill[-1]) + 2) + np.where(direct, 0, fill)
    cuts = np.flatnonzero(np.diff(key) != 0) + 1
    bounds = [0, *cuts.tolist(), n]
    flags = direct[bounds[:-1]].tolist()
    yield from zip(bounds[:-1], bounds[1:], flags, strict=True)


def _span(descs: DescriptorList, a: int, b: int) -> tuple[int, int, int] | None:
    """``(region, offset, length)`` if runs ``[a, b)`` are back to back in one region."""
    regions, offsets, lengths = descs.regions[a:b], descs.offsets[a:b], descs.lengths[a:b]
    if int(regions.min()) != int(regions.max()) or np.any(
        offsets[1:] != offsets[:-1] + lengths[:-1]
    ):
        return None
    return int(regions[0]), int(offsets[0]), int(lengths.sum())


def _vectored(
    sock: socket.socket, views: Mapping[RegionId, torch.Tensor], descs: DescriptorList
) -> bool:
    """Whether ``descs`` go by one vectored call per ``IOV_MAX`` runs rather than staging."""
    n = len(descs)
    mean = descs.total_bytes / max(1, n)
    return n > 1 and VECTORED_MEAN <= mean < DIRECT_MIN and vectored.usable(sock, views)


def byte_views(views: Mapping[RegionId, torch.Tensor]) -> dict[RegionId, memoryview]:
    """Writable memoryviews of CPU region views (for zero-copy socket I/O)."""
    return {rid: t.numpy().data for rid, t in views.items()}


def _runs(descs: DescriptorList) -> Iterator[tuple[int, int, int] | DescriptorList]:
    """``descs`` as the pieces one call moves: a ``(region, offset, length)`` span (one run,
    or runs back to back in one region) or a sub-list of short runs to stage."""
    regions, offsets, lengths = (
        descs.regions.tolist(),
        descs.offsets.tolist(),
        descs.lengths.tolist(),
    )
    for a, b, direct in _pieces(descs.lengths):
        span = (regions[a], offsets[a], lengths[a]) if direct else _span(descs, a, b)
        yield span if span is not None else sub(descs, a, b)


def send_payload(
    sock: socket.socket,
    views: Mapping[RegionId, torch.Tensor],
    descs: DescriptorList,
    staging: torch.Tensor,
) -> None:
    """Send the bytes of ``descs`` back to back (regions in ``views``, CPU ``uint8``): runs that
    lie back to back in one region (a contiguous source, however many) in one ``sendall``."""
    _move(sock, views, descs, staging, receive=False)


def recv_payload(
    sock: socket.socket,
    views: Mapping[RegionId, torch.Tensor],
    descs: DescriptorList,
    staging: torch.Tensor,
) -> None:
    """Receive the bytes of ``descs`` back to back, straight into region memory where long (runs
    back to back in one region: one receive, however many)."""
    _move(sock, views, descs, staging, receive=True)


def _sendall(sock: socket.socket, data: memoryview) -> None:
    sock.sendall(data)


def _move(
    sock: socket.socket,
    views: Mapping[RegionId, torch.Tensor],
    descs: DescriptorList,
    staging: torch.Tensor,
    *,
    receive: bool,
) -> None:
    """Move the bytes of ``descs`` one way (``receive``: socket to memory, else memory to
    socket): one call for a span, vectored I/O for a frame of mid-sized runs, else piece by
    piece, short runs through ``staging``."""
    io = recv_exact if receive else _sendall
    whole = _span(descs, 0, len(descs)) if len(descs) > 1 else None
    if whole is not None:
        region, off, n = whole
        io(sock, views[RegionId(region)].numpy().data[off : off + n])
        return
    if _vectored(sock, views, descs):
        runs = vectored.recv_into_runs if receive else vectored.send_runs
        runs(sock, vectored.iovecs(views, descs))
        return
    mvs = byte_views(views)
    stage = staging.numpy().data
    for piece in _runs(descs):
        if isinstance(piece, tuple):  # no staging
            region, off, n = piece
            io(sock, mvs[RegionId(region)][off : off + n])
        elif receive:
            total = piece.total_bytes
            recv_exact(sock, stage[:total])
            copy_packed(views, piece, staging[:total], unpack=True)
        else:
            copy_packed(views, piece, staging, unpack=False)
            sock.sendall(stage[: piece.total_bytes])


def discard(sock: socket.socket, nbytes: int, staging: torch.Tensor) -> None:
    """Read and drop ``nbytes`` (the payload of a refused frame) to keep the stream in sync."""
    stage = staging.numpy().data
    while nbytes > 0:
        n = min(nbytes, len(stage))
        recv_exact(sock, stage[:n])
        nbytes -= n
