"""Copies of paged blocks: equal runs on rows of their length, moved by one index op.

Torch on the application's thread, NumPy among copy workers on a transport's thread (never a
second OpenMP team). See docs/transports.md.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvplane.transports.descriptors import Int64Array, RowMap
from kvplane.transports.workers import CopyWorkers

CHUNK_BYTES = 1 << 20
"""Stage of the two-pass paths (scattered source and destination)."""
NUMPY_MIN = 64 << 10
"""Shortest rows the NumPy path takes (shorter ones copy faster as opaque items)."""
LONG_RUN = 32 << 10
"""Rows at least this long that are scattered on both sides are left to per-run copies: two
passes through a stage cost more than one Python call per run (measured: 32 runs of 144 KiB,
2.0 ms staged vs 0.63 ms per run, memcpy 0.44 ms)."""
PART_BYTES = 256 << 10
"""Smallest share of a copy worth handing to a helper thread."""
_WIDE = {8: torch.int64, 4: torch.int32}


def _view(buf: torch.Tensor, m: RowMap) -> torch.Tensor:
    return buf.narrow(0, m.base, m.rows * m.length).view(m.rows, m.length)


def _wide(
    src_rows: torch.Tensor, dst_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Both sides' byte rows seen as rows of 8- or 4-byte integers, or None if they are not so
    aligned."""
    length = src_rows.shape[1]
    for width, dtype in _WIDE.items():
        if length % width == 0 and src_rows.data_ptr() % width == dst_rows.data_ptr() % width == 0:
            return src_rows.view(dtype), dst_rows.view(dtype)
    return None


def source_per_destination_row(s: RowMap, d: RowMap) -> Int64Array | None:
    """When the destination runs tile their rows: the source row feeding each destination row
    (so the move is one gather); else None."""
    if d.identity:
        return s.index
    if d.inverse is None:
        return None
    return d.inverse if s.identity else s.index[d.inverse]


def copy_rows_torch(src: torch.Tensor, s: RowMap, dst: torch.Tensor, d: RowMap) -> bool:
    """Move run i (row ``s.index[i]`` of ``src``) to row ``d.index[i]`` of ``dst`` with torch
    index ops; mutates ``dst`` only. False (nothing copied) if the two row views share memory,
    the rows are too oddly aligned for the scatter path, or both sides are scattered and the
    rows are at least ``LONG_RUN`` long."""
    sv, dv = _view(src, s), _view(dst, d)
    s_lo, d_lo = sv.data_ptr(), dv.data_ptr()
    if s_lo < d_lo + dv.numel() and d_lo < s_lo + sv.numel():
        return False
    gather = source_per_destination_row(s, d)
    if gather is not None:  # the destination rows tile their span: one gather pass
        torch.index_select(sv, 0, torch.from_numpy(gather), out=dv)
        return True
    if not s.identity and s.length >= LONG_RUN:
        return False  # both sides scattered: per-run copies are cheaper than two passes
    wide = _wide(sv, dv)
    if wide is None:
        return False
    swide, dwide = wide
    di = torch.from_numpy(d.index)
    if s.identity:
        dwide.index_copy_(0, di, swide)  # sources back to back: one scatter pass
        return True
    si, n = torch.from_numpy(s.index), len(s.index)
    step = max(1, CHUNK_BYTES // s.length)
    stage = torch.empty((min(step, n), swide.shape[1]), dtype=swide.dtype)
    for i in range(0, n, step):
        part = stage[: min(step, n - i)]
        torch.index_select(swide, 0, si[i : i + step], out=part)
        dwide.index_copy_(0, di[i : i + step], part)
    return True


def copy_rows_numpy(
    sn: npt.NDArray[np.uint8], s: RowMap, dn: npt.NDArray[np.uint8], d: RowMap,
    *, workers: CopyWorkers | None,
) -> bool:  # fmt: skip
    """:func:`copy_rows_torch` by NumPy row indexing (releases the GIL), split among
    ``workers``, for one-pass moves only; False if the views may share memory or both sides
    are scattered. (Callers leave rows shorter than ``NUMPY_MIN`` to opaque-item copies.)"""
    length = s.length
    sv = sn[s.base : s.base + s.rows * length].reshape(s.rows, length)
    dv = dn[d.base : d.base + d.rows * length].reshape(d.rows, length)
    if np.may_share_memory(sv, dv):
        return False
    di = d.index
    gather = source_per_destination_row(s, d)

    def scatter(a: int, b: int) -> None:
        dv[di[a:b]] = sv[a:b]  # one scatter pass

    def take(a: int, b: int) -> None:
        np.take(sv, rows[a:b], axis=0, out=dv[a:b])  # one gather pass

    if s.identity:
        part = scatter
    elif gather is None:
        return False  # both sides scattered (rows this long): per-run copies are cheaper
    else:
        rows, part = gather, take
    n = len(di)
    if workers is None:
        part(0, n)
    else:
        workers.run(part, n, min_part=max(1, PART_BYTES // length))
    return True
