"""Byte runs between a device (GPU) buffer and host memory, through a device staging buffer.

:func:`copy_runs_staged` cuts the runs into pieces of one length ``L`` and, when the device-side
pieces sit on rows of ``L`` bytes, moves them as row copies in host order: per step of at most
``stage_bytes``, one gather on the device (``index_select`` into the stage) and one
device-to-host copy, or one host-to-device copy and one scatter (``index_copy_``). The host side
is one slice when its pieces lie back to back, else row index ops. Owns no memory between
calls (the stage comes from torch's caching allocator); runs that fit no rows are left to the
caller.
"""

from __future__ import annotations

import numpy as np
import torch

from kvplane.transports.descriptors import Int64Array, RowMap, row_map

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _width(length: int, *ptrs: int) -> torch.dtype:
    """The widest integer type dividing ``length`` and every pointer."""
    return next(dt for w, dt in _WIDE if length % w == 0 and all(p % w == 0 for p in ptrs))


class _Rows:
    """Pieces of ``length`` bytes at byte ``offsets`` of the flat buffer ``buf``, as rows of
    ``dtype``: a slice when they lie back to back, else rows of their row map ``m`` (if any)."""

    def __init__(
        self, buf: torch.Tensor, offsets: Int64Array, length: int, dtype: torch.dtype,
        m: RowMap | None,
    ) -> None:  # fmt: skip
        self.buf, self.offsets, self.length, self.dtype, self.map = buf, offsets, length, dtype, m

    def table(self) -> torch.Tensor:
        """The row-map span as ``[rows, length]`` of ``dtype`` (needs a row map)."""
        m = self.map
        if m is None:  # pragma: no cover - callers check ``map`` first
            raise ValueError("these pieces sit on no rows")
        return self.buf.narrow(0, m.base, m.rows * m.length).view(self.dtype).view(m.rows, -1)

    def index(self, a: int, b: int, device: torch.device) -> torch.Tensor:
        m = self.map
        if m is None:  # pragma: no cover - callers check ``map`` first
            raise ValueError("these pieces sit on no rows")
        return torch.from_numpy(m.index[a:b]).to(device)

    def flat(self, a: int, b: int) -> torch.Tensor | None:
        """Pieces ``a..b`` as one ``[b - a, length]`` view, if they lie back to back."""
        off = self.offsets[a:b]
        if len(off) > 1 and not bool(np.all(np.diff(off) == self.length)):
            return None
        raw = self.buf.narrow(0, int(off[0]), (b - a) * self.length)
        return raw.view(self.dtype).view(b - a, -1)

    def put(self, a: int, b: int, data: torch.Tensor) -> None:
        """Pieces ``a..b`` <- the rows of ``data`` (any device)."""
        flat = self.flat(a, b)
        if flat is not None:
            flat.copy_(data)
            return
        rows = data.to(self.buf.device)
        if self.map is not None:
            self.table().index_copy_(0, self.index(a, b, self.buf.device), rows)
            return
        for i, off in enumerate(self.offsets[a:b].tolist()):
            self.buf.narrow(0, off, self.length).view(self.dtype).copy_(rows[i])

    def take(self, a: int, b: int) -> torch.Tensor:
        """Pieces ``a..b`` as ``[b - a, length]`` rows (a view when back to back)."""
        flat = self.flat(a, b)
        if flat is not None:
            return flat
        if self.map is not None:
            return torch.index_select(self.table(), 0, self.index(a, b, self.buf.device))
        return torch.stack(
            [self.buf.narrow(0, off, self.length).view(self.dtype)
             for off in self.offsets[a:b].tolist()]
        )  # fmt: skip


def _pieces(so: Int64Array, do: Int64Array, ln: Int64Array) -> tuple[Int64Array, Int64Array, int]:
    """The runs cut into pieces of their common length (the gcd of ``ln``)."""
    length = int(np.gcd.reduce(ln))
    counts = ln // length
    if int(counts.max()) == 1:
        return so, do, length
    owner = np.repeat(np.arange(len(ln)), counts)
    piece = (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)) * length
    return so[owner] + piece, do[owner] + piece, length


def copy_runs_staged(
    src: torch.Tensor, so: Int64Array, dst: torch.Tensor, do: Int64Array, ln: Int64Array, *,
    stage_bytes: int,
) -> bool:  # fmt: skip
    """Copy run ``i`` (``ln[i]`` bytes from ``src[so[i]:]`` to ``dst[do[i]:]``) for every i,
    where one of the flat ``uint8`` buffers is on a device and the other on the CPU; the caller
    has checked bounds and overlap. False (nothing copied) unless the device-side pieces all
    sit a multiple of their length from the lowest. Mutates ``dst`` only; returns once every
    byte has landed (a CUDA device is synchronised)."""
    if dst.device.type == "cpu":
        return stage_rows(src, so, dst, do, ln, to_host=True, stage_bytes=stage_bytes)
    return stage_rows(dst, do, src, so, ln, to_host=False, stage_bytes=stage_bytes)


def stage_rows(
    dev_buf: torch.Tensor, dev_off: Int64Array, host_buf: torch.Tensor, host_off: Int64Array,
    ln: Int64Array, *, to_host: bool, stage_bytes: int,
) -> bool:  # fmt: skip
    """Run ``i``: ``ln[i]`` bytes at ``dev_buf[dev_off[i]:]`` to ``host_buf[host_off[i]:]``
    (``to_host``) or back, through a stage on ``dev_buf``'s device (any device, the CPU
    included); see :func:`copy_runs_staged`."""
    if not len(ln):
        return True
    dev_off, host_off, length = _pieces(dev_off, host_off, ln)
    if len(host_off) > 1 and bool(np.any(np.diff(host_off) < 0)):  # host order: slices there
        order = np.argsort(host_off, kind="stable")
        dev_off, host_off = dev_off[order], host_off[order]
    probe = row_map(dev_off, length)
    if probe is None:
        return False
    host_align = host_buf.data_ptr() | int(np.bitwise_or.reduce(host_off))
    dtype = _width(length, dev_buf.data_ptr() + probe.base, host_align)
    dev = _Rows(dev_buf, dev_off, length, dtype, probe)
    host = _Rows(host_buf, host_off, length, dtype, row_map(host_off, length))
    table = dev.table()
    n = len(dev_off)
    step = max(1, stage_bytes // length)
    stage = torch.empty((min(step, n), table.shape[1]), dtype=dtype, device=dev_buf.device)
    for a in range(0, n, step):
        b = min(a + step, n)
        part = stage[: b - a]
        idx = dev.index(a, b, dev_buf.device)
        if to_host:
            torch.index_select(table, 0, idx, out=part)
            host.put(a, b, part)
        else:
            part.copy_(host.take(a, b))
            table.index_copy_(0, idx, part)
    if dev_buf.device.type == "cuda":
        torch.cuda.synchronize(dev_buf.device)
    return True
