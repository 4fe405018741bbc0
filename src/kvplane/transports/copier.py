"""Vectorised byte moves between flat ``uint8`` views, and descriptor-list arithmetic.

Theory of operation
-------------------
Every CPU-side move in kvplane's own transports (``local`` copies, ``shm`` copies into a mapped
peer segment, ``tcp`` gather-before-send and scatter-after-receive) comes down to
:func:`copy_runs`: ``n`` byte runs from one buffer to another. A run's cost is a memcpy plus, if
issued from Python, a few microseconds of overhead, so the strategy depends on the runs:

* few runs (or long ones, >= ``LARGE_RUN``): one copy each -- ``narrow().copy_()`` on the
  application's thread (``torch_pool``, below), a NumPy slice copy split among the copy workers
  on a transport's thread;
* runs of one length ``L`` that sit a multiple of ``L`` apart on both sides (paged blocks),
  as ``[rows, L]`` row views. Which threads copy them depends on who calls. On the
  application's own thread (``torch_pool=True``: ``local``), torch index ops run them on torch's
  intra-op pool -- the pool the application's compute and ``copy_`` use, so nothing else
  fights it for cores -- one gather pass of byte rows when the destination rows tile their
  span (a permutation included), one scatter pass of 8- or 4-byte-integer rows when the
  sources are back to back (torch scatters byte rows element by element), else two passes
  through a cache-sized chunk. On a transport's background thread (``shm``, ``tcp``) a torch
  parallel op would start a second OpenMP team, whose spinning threads and the first team's
  slow both to a fraction of memcpy; there NumPy row indexing (which releases the GIL) runs
  runs of at least ``NUMPY_MAX`` bytes, split among the transport's
  :class:`~kvplane.transports.workers.CopyWorkers` (shorter ones take the next path);
* other short runs of one length ``L`` (< ``NUMPY_MAX``): NumPy fancy
  indexing over a ``V{L}`` (opaque ``L``-byte) view whose stride is one byte, so a run may start
  at any byte offset -- one pass when one side is back to back, else through cache-sized
  chunks (``CHUNK_BYTES``). NumPy releases the GIL while it copies, so the index range is split
  among the transport's :class:`~kvplane.transports.workers.CopyWorkers` (as many threads as
  torch's own ``copy_`` uses);
* other runs: long ones one copy each (the overhead is amortised), else NumPy. No Python loop
  per run.

:func:`coalesce` merges consecutive pairs that continue each other on both sides, :func:`split`
cuts runs longer than a limit, :func:`check_disjoint` and :func:`check_no_cross_overlap` refuse
ranges that overlap (``PlanError``) -- all vectorised.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import torch

from kvplane.errors import PlanError
from kvplane.ids import RegionId
from kvplane.transports.base import DescriptorList, Int64Array
from kvplane.transports.workers import CopyWorkers

LOOP_MAX = 16
"""At most this many runs (of one length) are copied one call each."""
LARGE_RUN = 128 << 10
"""Runs at least this long are copied one call each."""
CHUNK_BYTES = 1 << 20
"""Chunk of the two-pass path (scattered source and destination)."""
NUMPY_MAX = 64 << 10
"""Equal runs shorter than this go through NumPy fancy assignment (split among the copy
workers); torch's ``index_copy_`` copies element by element and is slower on short rows."""
PART_BYTES = 256 << 10
"""Smallest share of a copy worth handing to a helper thread."""
_OFFSET_BITS = 40
"""Offsets below 1 TiB; region ids are shifted above them to sort (region, offset) as one key."""


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
    the GIL; a run long enough is split among ``workers``."""
    for s, d, n in zip(so.tolist(), do.tolist(), ln.tolist(), strict=True):
        if workers is None or n < 2 * PART_BYTES:
            dn[d : d + n] = sn[s : s + n]
            continue

        def part(a: int, b: int, s: int = s, d: int = d) -> None:
            dn[d + a : d + b] = sn[s + a : s + b]

        workers.run(part, n, min_part=PART_BYTES)


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


_WIDE = {8: torch.int64, 4: torch.int32}


def _row_span(offsets: Int64Array, length: int) -> tuple[int, int, Int64Array] | None:
    """``(base, rows, row index of each run)`` when every run sits a multiple of ``length``
    bytes from the lowest one, else None."""
    base = int(offsets.min())
    rel = offsets - base
    if np.any(rel % length):
        return None
    return base, int(rel.max()) // length + 1, rel // length


def _rows(
    buf: torch.Tensor, offsets: Int64Array, length: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``buf`` seen as ``[rows, length]`` bytes holding every run, and each run's row index;
    None unless all runs sit a multiple of ``length`` apart."""
    found = _row_span(offsets, length)
    if found is None:
        return None
    base, rows, idx = found
    return buf.narrow(0, base, rows * length).view(rows, length), torch.from_numpy(idx)


def _wide(
    src_rows: torch.Tensor, dst_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Both sides' byte rows seen as rows of 8- or 4-byte integers (torch scatters those in
    bulk; it scatters byte rows element by element), or None if they are not so aligned."""
    length = src_rows.shape[1]
    for width, dtype in _WIDE.items():
        if length % width == 0 and src_rows.data_ptr() % width == dst_rows.data_ptr() % width == 0:
            return src_rows.view(dtype), dst_rows.view(dtype)
    return None


def _copy_rows_torch(src: torch.Tensor, so: Int64Array, dst: torch.Tensor, do: Int64Array,
               length: int) -> bool:  # fmt: skip
    """Equal runs by torch index ops on row views (torch runs them on its own intra-op
    threads); False if the runs are not row-aligned or the two row views share memory."""
    s, d = _rows(src, so, length), _rows(dst, do, length)
    if s is None or d is None:
        return False
    (sv, si), (dv, di) = s, d
    s_lo, d_lo = sv.data_ptr(), dv.data_ptr()
    if s_lo < d_lo + dv.numel() and d_lo < s_lo + sv.numel():
        return False
    n = len(so)
    if dv.shape[0] == n:  # the destination rows tile their span: one gather pass of byte rows
        if not bool(torch.equal(di, torch.arange(n))):
            si = torch.empty_like(si).index_copy_(0, di, si)  # the source row of each dest row
        torch.index_select(sv, 0, si, out=dv)
        return True
    wide = _wide(sv, dv)
    if wide is None:
        return False
    swide, dwide = wide
    if sv.shape[0] == n and bool(torch.equal(si, torch.arange(n))):
        dwide.index_copy_(0, di, swide)  # sources back to back: one scatter pass
    else:
        step = max(1, CHUNK_BYTES // length)
        stage = torch.empty((min(step, n), swide.shape[1]), dtype=swide.dtype)
        for i in range(0, n, step):
            part = stage[: min(step, n - i)]
            torch.index_select(swide, 0, si[i : i + step], out=part)
            dwide.index_copy_(0, di[i : i + step], part)
    return True


def _copy_rows_numpy(
    sn: npt.NDArray[np.uint8], so: Int64Array, dn: npt.NDArray[np.uint8], do: Int64Array,
    length: int, *, workers: CopyWorkers | None,
) -> bool:  # fmt: skip
    """Equal row-aligned runs by NumPy row indexing over ``[rows, length]`` byte views (which
    releases the GIL, unlike opaque ``V{L}`` items of this size), split among ``workers``;
    False if the runs are not row-aligned or the two row views may share memory."""
    s, d = _np_rows(sn, so, length), _np_rows(dn, do, length)
    if s is None or d is None:
        return False
    (sv, si), (dv, di) = s, d
    if np.may_share_memory(sv, dv):
        return False
    n = len(so)
    src_b2b = sv.shape[0] == n and bool(np.all(si == np.arange(n)))
    dst_b2b = dv.shape[0] == n and bool(np.all(di == np.arange(n)))
    step = max(1, CHUNK_BYTES // length)

    def part(a: int, b: int) -> None:
        if src_b2b:
            dv[di[a:b]] = sv[a:b]  # one scatter pass
        elif dst_b2b:
            np.take(sv, si[a:b], axis=0, out=dv[a:b])  # one gather pass
        else:
            stage = np.empty((min(step, b - a), length), dtype=np.uint8)
            for i in range(a, b, step):
                j = min(i + step, b)
                np.take(sv, si[i:j], axis=0, out=stage[: j - i])
                dv[di[i:j]] = stage[: j - i]

    if workers is None:
        part(0, n)
    else:
        workers.run(part, n, min_part=max(1, PART_BYTES // length))
    return True


def _copy_rows(
    src: torch.Tensor, so: Int64Array, dst: torch.Tensor, do: Int64Array, length: int, *,
    workers: CopyWorkers | None, torch_pool: bool,
) -> bool:  # fmt: skip
    """Equal row-aligned runs on torch's pool, or on NumPy + ``workers`` when they are at least
    ``NUMPY_MAX`` long (shorter ones copy faster as opaque items: see module doc); False when
    this path does not take them."""
    if torch_pool:
        return _copy_rows_torch(src, so, dst, do, length)
    if length < NUMPY_MAX:
        return False
    return _copy_rows_numpy(src.numpy(), so, dst.numpy(), do, length, workers=workers)


def _np_rows(
    buf: npt.NDArray[np.uint8], offsets: Int64Array, length: int
) -> tuple[npt.NDArray[np.uint8], Int64Array] | None:
    """NumPy twin of :func:`_rows`."""
    found = _row_span(offsets, length)
    if found is None:
        return None
    base, rows, idx = found
    return buf[base : base + rows * length].reshape(rows, length), idx


def copy_runs(
    src: torch.Tensor, src_offsets: Int64Array, dst: torch.Tensor, dst_offsets: Int64Array,
    lengths: Int64Array, *, workers: CopyWorkers | None = None, torch_pool: bool = False,
) -> None:  # fmt: skip
    """Copy ``lengths[i]`` bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]``.

    ``src`` and ``dst`` are flat ``uint8`` tensors; the caller has checked bounds and that no two
    destination runs overlap. Mutates ``dst`` only. Non-CPU tensors use per-run torch copies.
    ``workers`` (optional) share the NumPy copies with the calling thread. ``torch_pool``: the
    caller is the application's own thread, so torch's intra-op pool (the one its compute
    uses) may run row copies; a transport's background thread leaves it False, because a torch
    parallel op there starts a second OpenMP team that fights the first for the cores (measured:
    both teams' copies fall to a fraction of memcpy).
    """
    n = len(lengths)
    if n == 0:
        return
    if src.device.type != "cpu" or dst.device.type != "cpu":
        _loop(src, src_offsets, dst, dst_offsets, lengths)
        return
    sn, dn = src.numpy(), dst.numpy()

    def each(so: Int64Array, do: Int64Array, ln: Int64Array) -> None:  # one call per run
        if torch_pool:
            _loop(src, so, dst, do, ln)
        else:
            _np_loop(sn, so, dn, do, ln, workers=workers)

    if n <= LOOP_MAX:
        each(src_offsets, dst_offsets, lengths)
        return
    if int(lengths.min()) == int(lengths.max()):  # the common case: equal blocks
        uniq, inverse = lengths[:1], np.zeros(n, dtype=np.int64)
    else:
        uniq, inverse = np.unique(lengths, return_inverse=True)
    for k, length in enumerate(uniq.tolist()):
        idx = np.flatnonzero(inverse == k) if len(uniq) > 1 else np.arange(n)
        so, do = src_offsets[idx], dst_offsets[idx]
        if len(idx) <= LOOP_MAX:
            each(so, do, lengths[idx])
        elif _copy_rows(src, so, dst, do, length, workers=workers, torch_pool=torch_pool):
            continue
        elif length < NUMPY_MAX:
            _copy_equal(sn, so, dn, do, length, workers=workers)
        elif length >= LARGE_RUN:
            each(so, do, lengths[idx])
        else:
            _copy_equal(sn, so, dn, do, length, workers=workers)


def distinct(regions: Int64Array) -> list[int]:
    """The distinct region ids of a descriptor column (no sort when there is only one)."""
    if not len(regions):
        return []
    if int(regions.min()) == int(regions.max()):
        return [int(regions[0])]
    return [int(r) for r in np.unique(regions)]


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
) -> None:
    """Move ``src[i]`` to ``dst[i]`` for every i (validated, equal lengths); mutates dst views.
    ``workers`` and ``torch_pool`` as in :func:`copy_runs`."""
    src, dst = coalesce(src, dst)
    for idx in _groups(src.regions, dst.regions):
        i0 = int(idx[0])
        copy_runs(
            src_views[RegionId(int(src.regions[i0]))], src.offsets[idx],
            dst_views[RegionId(int(dst.regions[i0]))], dst.offsets[idx], src.lengths[idx],
            workers=workers, torch_pool=torch_pool,
        )  # fmt: skip


def _exclusive_cumsum(values: Int64Array) -> Int64Array:
    out = np.zeros(len(values), dtype=np.int64)
    np.cumsum(values[:-1], out=out[1:])
    return out


def packed_offsets(descs: DescriptorList) -> Int64Array:
    """Where each descriptor's bytes start when the list is packed back to back."""
    return _exclusive_cumsum(descs.lengths)


def gather(
    views: Mapping[RegionId, torch.Tensor], descs: DescriptorList, out: torch.Tensor,
    workers: CopyWorkers | None = None,
) -> None:  # fmt: skip
    """Pack the bytes of ``descs`` back to back into ``out`` (flat uint8, >= total bytes)."""
    packed = packed_offsets(descs)
    for idx in _groups(descs.regions):
        view = views[RegionId(int(descs.regions[int(idx[0])]))]
        copy_runs(view, descs.offsets[idx], out, packed[idx], descs.lengths[idx], workers=workers)


def scatter(
    views: Mapping[RegionId, torch.Tensor], descs: DescriptorList, data: torch.Tensor,
    workers: CopyWorkers | None = None,
) -> None:  # fmt: skip
    """Unpack back-to-back bytes in ``data`` into ``descs``; mutates the views."""
    packed = packed_offsets(descs)
    for idx in _groups(descs.regions):
        view = views[RegionId(int(descs.regions[int(idx[0])]))]
        copy_runs(data, packed[idx], view, descs.offsets[idx], descs.lengths[idx], workers=workers)


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
    cont = (
        (src.regions[1:] == src.regions[:-1])
        & (src.offsets[1:] == src.offsets[:-1] + src.lengths[:-1])
        & (dst.regions[1:] == dst.regions[:-1])
        & (dst.offsets[1:] == dst.offsets[:-1] + dst.lengths[:-1])
    )
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


def _keys(descs: DescriptorList) -> tuple[Int64Array, Int64Array]:
    if len(descs) and int((descs.offsets + descs.lengths).max()) >= 1 << _OFFSET_BITS:
        raise PlanError(f"descriptor offsets beyond {1 << _OFFSET_BITS} bytes are not supported")
    base = descs.regions << _OFFSET_BITS
    return base + descs.offsets, base + descs.offsets + descs.lengths


def _blocks_disjoint(descs: DescriptorList) -> bool | None:
    """Fast answer for one region of equal, equally aligned runs (paged blocks): whether no
    two coincide (counting, no sort); None when the shape does not apply."""
    length, lo = int(descs.lengths[0]), int(descs.offsets.min())
    if (
        int(descs.regions.min()) != int(descs.regions.max())
        or int(descs.lengths.max()) != length
        or np.any((descs.offsets - lo) % length)
    ):
        return None
    counts = np.bincount((descs.offsets - lo) // length)
    return bool(counts.max() <= 1)


def check_disjoint(descs: DescriptorList, side: str) -> None:
    """``PlanError`` if two descriptors of ``descs`` share a byte (e.g. one written twice)."""
    if len(descs) < 2 or _blocks_disjoint(descs):
        return
    start, end = _keys(descs)
    order = np.argsort(start)
    bad = np.flatnonzero(end[order][:-1] > start[order][1:])
    if len(bad):
        i, j = sorted((int(order[bad[0]]), int(order[bad[0] + 1])))
        raise PlanError(f"{side} descriptors {i} and {j} overlap (a byte would be written twice)")


def check_no_cross_overlap(src: DescriptorList, dst: DescriptorList) -> None:
    """``PlanError`` if a destination range overlaps a source range (same memory, loopback)."""
    if not len(src) or not len(dst) or not set(distinct(src.regions)) & set(distinct(dst.regions)):
        return
    s_start, s_end = _keys(src)
    d_start, d_end = _keys(dst)
    order = np.argsort(s_start)
    reach = np.maximum.accumulate(s_end[order])  # furthest end among sources sorted by start
    pos = np.searchsorted(s_start[order], d_end, side="left")  # sources starting before d's end
    hit = (pos > 0) & (reach[np.maximum(pos - 1, 0)] > d_start)
    if hit.any():
        j = int(np.flatnonzero(hit)[0])
        raise PlanError(f"destination descriptor {j} overlaps a source range in the same region")
