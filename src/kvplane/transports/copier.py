"""Vectorised byte moves between flat ``uint8`` views, and descriptor-list arithmetic.

:func:`copy_runs` picks the C run copier, per-run copies, row indexing or fancy indexing by the
shape of the runs; no Python loop per short run. See docs/transports.md.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

import numpy as np
import numpy.typing as npt
import torch

from kvplane.errors import PlanError
from kvplane.ids import RegionId
from kvplane.transports.descriptors import DescriptorList, Int64Array, RowMap, row_map
from kvplane.transports.native_copy import copy_runs_native
from kvplane.transports.rows import (
    CHUNK_BYTES,
    LONG_RUN,
    NUMPY_MIN,
    PART_BYTES,
    copy_rows_numpy,
    copy_rows_torch,
)
from kvplane.transports.staging import copy_runs_staged
from kvplane.transports.workers import CopyWorkers

LOOP_MAX = 16
"""At most this many runs (of one length) are copied one call each."""
NATIVE_MIN = 512 << 10
"""Up to :data:`LOOP_MAX` runs moving fewer bytes than this are copied by one NumPy slice copy
each (a ``memcpy`` without the GIL, ~1 us to set up), not by the C run copier, whose checks and
set-up cost ~20 us and which copies so few bytes on the calling thread alone anyway (a 256 KiB
run: 8 us against 35 us)."""
STAGE_BYTES = 64 << 20
"""Default device staging per step of a move between a GPU buffer and host memory."""


def _loop(
    src: torch.Tensor, so: Int64Array, dst: torch.Tensor, do: Int64Array, ln: Int64Array
) -> None:
    for s, d, n in zip(so.tolist(), do.tolist(), ln.tolist(), strict=True):
        dst.narrow(0, d, n).copy_(src.narrow(0, s, n))


def _np_loop(
    sn: npt.NDArray[np.uint8], so: Int64Array, dn: npt.NDArray[np.uint8], do: Int64Array,
    ln: Int64Array, *, workers: CopyWorkers | None,
) -> None:  # fmt: skip
    """:func:`_loop` without torch (for transport threads): NumPy slice copies, which release
    the GIL. With ``workers`` the runs, laid end to end, are cut into one contiguous byte range
    per thread (one handoff per copy, not per run: 32 scattered 1.1 MiB runs took 8.8 ms handed
    over run by run, against 4.8 ms on one thread)."""
    total = int(ln.sum())
    runs = list(zip(so.tolist(), do.tolist(), ln.tolist(), strict=True))
    if workers is None or total < 2 * PART_BYTES:
        for s, d, n in runs:
            dn[d : d + n] = sn[s : s + n]
        return
    ends = np.cumsum(ln).tolist()

    def part(a: int, b: int) -> None:  # bytes [a, b) of the runs laid end to end
        i = bisect.bisect_right(ends, a)
        while i < len(runs) and ends[i] - runs[i][2] < b:
            s, d, n = runs[i]
            start = ends[i] - n  # the run's first byte in the end-to-end order
            lo, hi = max(a, start) - start, min(b, ends[i]) - start
            dn[d + lo : d + hi] = sn[s + lo : s + hi]
            i += 1

    workers.run(part, total, min_part=PART_BYTES)


def _strided(buf: npt.NDArray[np.uint8], length: int) -> npt.NDArray[np.void]:
    """An ``L``-byte item starting at every byte offset of ``buf`` (items overlap)."""
    return np.ndarray(
        shape=(buf.size - length + 1,), dtype=np.dtype(f"V{length}"), buffer=buf, strides=(1,)
    )


def _back_to_back(offsets: Int64Array, length: int) -> bool:
    return len(offsets) == 1 or bool(np.all(np.diff(offsets) == length))


def _copy_equal(
    sn: npt.NDArray[np.uint8],
    so: Int64Array,
    dn: npt.NDArray[np.uint8],
    do: Int64Array,
    length: int,
    *,
    workers: CopyWorkers | None,
) -> None:
    """``n`` runs of ``length`` bytes by NumPy fancy assignment (which releases the GIL), the
    index range split among ``workers``; one pass when either side is back to back."""
    n = len(so)
    step = max(1, CHUNK_BYTES // length)
    item = np.dtype(f"V{length}")
    src_b2b, dst_b2b = _back_to_back(so, length), _back_to_back(do, length)
    if src_b2b and dst_b2b:
        s0, d0 = int(so[0]), int(do[0])
        dn[d0 : d0 + n * length] = sn[s0 : s0 + n * length]
        return
    sv, dv = _strided(sn, length), _strided(dn, length)

    def part(a: int, b: int) -> None:
        if src_b2b:
            s0 = int(so[0]) + a * length
            dv[do[a:b]] = sn[s0 : s0 + (b - a) * length].view(item)
        elif dst_b2b:
            d0 = int(do[0]) + a * length
            out = dn[d0 : d0 + (b - a) * length].view(item)
            for i in range(a, b, step):
                out[i - a : i - a + step] = sv[so[i : min(i + step, b)]]
        else:
            for i in range(a, b, step):
                j = min(i + step, b)
                dv[do[i:j]] = sv[so[i:j]]

    if workers is None:
        part(0, n)
    else:
        workers.run(part, n, min_part=max(1, PART_BYTES // length))


def _copy_rows(
    src: torch.Tensor, so: Int64Array, dst: torch.Tensor, do: Int64Array, length: int, *,
    maps: tuple[RowMap | None, RowMap | None] | None, workers: CopyWorkers | None,
    torch_pool: bool,
) -> bool:  # fmt: skip
    """Equal runs as rows (:mod:`kvplane.transports.rows`); False when that path does not
    take them. ``maps``: the runs' row maps when the caller already knows them."""
    if not torch_pool and length < NUMPY_MIN:
        return False
    s, d = maps if maps is not None else (row_map(so, length), row_map(do, length))
    if s is None or d is None:
        return False
    if torch_pool:
        return copy_rows_torch(src, s, dst, d)
    return copy_rows_numpy(src.numpy(), s, dst.numpy(), d, workers=workers)


RowMaps = tuple[RowMap | None, RowMap | None]
"""The row maps of a batch's source and destination offsets (``None`` where they have none)."""


def copy_runs(
    src: torch.Tensor, src_offsets: Int64Array, dst: torch.Tensor, dst_offsets: Int64Array,
    lengths: Int64Array, *, workers: CopyWorkers | None = None, torch_pool: bool = False,
    maps: Callable[[], RowMaps] | None = None, stage_bytes: int = STAGE_BYTES,
) -> None:  # fmt: skip
    """Copy ``lengths[i]`` bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]``.

    ``src`` and ``dst`` are flat ``uint8`` tensors; the caller has checked bounds and that no two
    destination runs overlap. Mutates ``dst`` only. A move between a device (GPU) tensor and
    host memory goes through device staging of up to ``stage_bytes`` per step
    (:mod:`kvplane.transports.staging`) where its runs sit on rows; other non-CPU moves use
    per-run torch copies.
    ``workers`` (optional) share the NumPy copies with the calling thread. ``torch_pool``: the
    caller is the application's own thread, so torch's intra-op pool (the one its compute
    uses) may run row copies; a transport's background thread leaves it False, because a torch
    parallel op there starts a second OpenMP team that fights the first for the cores (measured:
    both teams' copies fall to a fraction of memcpy). ``maps``: when all runs share one length,
    gives the row maps of both offset arrays (from the lists' cached facts); called only off
    the C path, which needs none.
    """
    n = len(lengths)
    if n == 0:
        return
    on_cpu = (src.device.type == "cpu", dst.device.type == "cpu")
    if not all(on_cpu):
        if not any(on_cpu) or not copy_runs_staged(
            src, src_offsets, dst, dst_offsets, lengths, stage_bytes=stage_bytes
        ):
            _loop(src, src_offsets, dst, dst_offsets, lengths)
        return
    sn, dn = src.numpy(), dst.numpy()

    def each(so: Int64Array, do: Int64Array, ln: Int64Array) -> None:  # one call per run
        if torch_pool:
            _loop(src, so, dst, do, ln)
        else:
            _np_loop(sn, so, dn, do, ln, workers=workers)

    few = n <= LOOP_MAX
    if few and int(lengths.sum()) < NATIVE_MIN:  # cheaper than the kernel's checks and set-up
        _np_loop(sn, src_offsets, dn, dst_offsets, lengths, workers=None)  # one memcpy each
        return
    if copy_runs_native(src, src_offsets, dst, dst_offsets, lengths, workers=workers):
        return
    if few:
        each(src_offsets, dst_offsets, lengths)
        return
    if int(lengths.min()) == int(lengths.max()):  # the common case: equal blocks
        groups: list[tuple[int, Int64Array | None]] = [(int(lengths[0]), None)]
    else:
        maps = None
        uniq, inverse = np.unique(lengths, return_inverse=True)
        groups = [(int(ln), np.flatnonzero(inverse == k)) for k, ln in enumerate(uniq.tolist())]
    for length, idx in groups:
        so, do = (src_offsets, dst_offsets) if idx is None else (src_offsets[idx], dst_offsets[idx])
        if len(so) <= LOOP_MAX:
            each(so, do, np.full(len(so), length))
        elif _copy_rows(src, so, dst, do, length, maps=maps() if maps else None, workers=workers,
                        torch_pool=torch_pool):  # fmt: skip
            continue
        elif length < LONG_RUN:
            _copy_equal(sn, so, dn, do, length, workers=workers)
        else:  # NumPy slice copies: faster per call than torch's on either kind of thread
            _np_loop(sn, so, dn, do, np.full(len(so), length), workers=workers)


def _groups(*cols: Int64Array) -> list[Int64Array]:
    """Index arrays of the rows sharing each distinct combination of ``cols``."""
    if len(cols[0]) == 0:
        return []
    if all(int(c.min()) == int(c.max()) for c in cols):  # the common case: one group
        return [np.arange(len(cols[0]))]
    keys = np.stack(cols, axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    if len(uniq) == 1:
        return [np.arange(len(cols[0]))]
    order = np.argsort(inverse.reshape(-1), kind="stable")
    bounds = np.flatnonzero(np.diff(inverse.reshape(-1)[order])) + 1
    return list(np.split(order, bounds))


def copy_pairs(
    src_views: Mapping[RegionId, torch.Tensor],
    dst_views: Mapping[RegionId, torch.Tensor],
    src: DescriptorList,
    dst: DescriptorList,
    workers: CopyWorkers | None = None,
    *,
    torch_pool: bool = False,
    stage_bytes: int = STAGE_BYTES,
) -> None:
    """Move ``src[i]`` to ``dst[i]`` for every i (validated, equal lengths); mutates dst views.
    ``workers``, ``torch_pool`` and ``stage_bytes`` as in :func:`copy_runs`."""
    given = src
    src, dst = coalesce(src, dst)
    if src.facts.single_region and dst.facts.single_region:  # common: no grouping, facts known
        # the lists' own row maps, when not merged just now (needed only off the C path)
        facts = (src.facts, dst.facts)
        maps = (lambda: (facts[0].rows, facts[1].rows)) if src is given else None
        copy_runs(
            src_views[RegionId(int(src.regions[0]))], src.offsets,
            dst_views[RegionId(int(dst.regions[0]))], dst.offsets, src.lengths,
            workers=workers, torch_pool=torch_pool, maps=maps, stage_bytes=stage_bytes,
        )  # fmt: skip
        return
    for idx in _groups(src.regions, dst.regions):
        i0 = int(idx[0])
        copy_runs(
            src_views[RegionId(int(src.regions[i0]))], src.offsets[idx],
            dst_views[RegionId(int(dst.regions[i0]))], dst.offsets[idx], src.lengths[idx],
            workers=workers, torch_pool=torch_pool, stage_bytes=stage_bytes,
        )  # fmt: skip


def _exclusive_cumsum(values: Int64Array) -> Int64Array:
    out = np.zeros(len(values), dtype=np.int64)
    np.cumsum(values[:-1], out=out[1:])
    return out


def packed_offsets(descs: DescriptorList) -> Int64Array:
    """Where each descriptor's bytes start when the list is packed back to back."""
    return _exclusive_cumsum(descs.lengths)


def copy_packed(
    views: Mapping[RegionId, torch.Tensor], descs: DescriptorList, flat: torch.Tensor, *,
    unpack: bool, workers: CopyWorkers | None = None,
) -> None:  # fmt: skip
    """Move the bytes of ``descs`` between ``views`` and ``flat`` (flat uint8, >= their total
    bytes) packed back to back: out of the views into ``flat``, or (``unpack``) from ``flat``
    into the views, which it mutates."""
    packed = packed_offsets(descs)
    for idx in _groups(descs.regions):
        view = views[RegionId(int(descs.regions[int(idx[0])]))]
        ends = [(view, descs.offsets[idx]), (flat, packed[idx])]
        (src, src_at), (dst, dst_at) = ends[::-1] if unpack else ends
        copy_runs(src, src_at, dst, dst_at, descs.lengths[idx], workers=workers)


def coalesce(
    src: DescriptorList, dst: DescriptorList, *, min_gain: float = 2.0
) -> tuple[DescriptorList, DescriptorList]:
    """Merge consecutive pairs that continue each other on both sides (same bytes moved).

    The merge is kept only if it divides the number of pairs by at least ``min_gain``: a few
    accidental merges in a batch of equal blocks would cost more (they break the equal-length,
    row-aligned shape the fast copy paths need) than they save.
    """
    if len(src) < 2:
        return src, dst
    cont = src.facts.continues & dst.facts.continues
    merged = int(cont.sum())
    if not merged or len(src) < min_gain * (len(src) - merged):
        return src, dst
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.add.reduceat(src.lengths, starts)
    return (
        DescriptorList(src.regions[starts], src.offsets[starts], lengths),
        DescriptorList(dst.regions[starts], dst.offsets[starts], lengths),
    )


def split(
    src: DescriptorList, dst: DescriptorList, max_len: int
) -> tuple[DescriptorList, DescriptorList]:
    """Cut every pair longer than ``max_len`` into consecutive pieces of at most ``max_len``."""
    if len(src) == 0 or int(src.lengths.max()) <= max_len:
        return src, dst
    counts = -(-src.lengths // max_len)
    owner = np.repeat(np.arange(len(src)), counts)
    first = np.repeat(_exclusive_cumsum(counts), counts)
    piece = (np.arange(int(counts.sum())) - first) * max_len
    lengths = np.minimum(src.lengths[owner] - piece, max_len)
    return (
        DescriptorList(src.regions[owner], src.offsets[owner] + piece, lengths),
        DescriptorList(dst.regions[owner], dst.offsets[owner] + piece, lengths),
    )


def check_disjoint(descs: DescriptorList, side: str) -> None:
    """``PlanError`` if two descriptors of ``descs`` share a byte (e.g. one written twice)."""
    found = descs.facts.overlap
    if found is not None:
        i, j = found
        raise PlanError(f"{side} descriptors {i} and {j} overlap (a byte would be written twice)")


def check_no_cross_overlap(src: DescriptorList, dst: DescriptorList) -> None:
    """``PlanError`` if a destination range overlaps a source range (same memory, loopback)."""
    shared = set(src.facts.region_ids.tolist()) & set(dst.facts.region_ids.tolist())
    if not len(src) or not len(dst) or not shared:
        return
    s_start, s_end = src.facts.byte_keys()
    d_start, d_end = dst.facts.byte_keys()
    order = np.argsort(s_start)
    reach = np.maximum.accumulate(s_end[order])  # furthest end among sources sorted by start
    pos = np.searchsorted(s_start[order], d_end, side="left")  # sources starting before d's end
    hit = (pos > 0) & (reach[np.maximum(pos - 1, 0)] > d_start)
    if hit.any():
        j = int(np.flatnonzero(hit)[0])
        raise PlanError(f"destination descriptor {j} overlaps a source range in the same region")
