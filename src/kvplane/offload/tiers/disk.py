"""The disk tier: one slot file of fixed-size slots, each a payload followed by its header.

The header is the commit record; reads verify header and CRC; :meth:`DiskTier.scan` re-indexes.
With a codec a slot holds the coded payload (no longer than the chunk) and a read fetches the
header first, then only the stored bytes.
``O_DIRECT`` where allowed; an exclusive ``flock``. See docs/offload.md.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from kvplane.errors import InvalidArgumentError, OffloadError
from kvplane.ids import ChunkKey, SlotId
from kvplane.metrics import MetricsRegistry
from kvplane.offload.codecs.coder import ChunkCoder
from kvplane.offload.tiers.base import (
    ReadOutcome,
    SyncPolicy,
    TierCounters,
    as_buffer,
    check_batch,
    check_stored_tier,
)
from kvplane.offload.tiers.header import (
    HEADER_BYTES,
    ChunkHeader,
    is_blank,
    payload_checksum,
    verify_header,
)
from kvplane.offload.tiers.host import ALIGN, round_up


class DiskTier:
    """``num_slots`` chunk slots of ``chunk_bytes`` bytes in the file ``path``."""

    def __init__(
        self,
        path: str | Path,
        num_slots: int,
        chunk_bytes: int,
        fingerprint: bytes,
        *,
        sync: SyncPolicy = SyncPolicy.NONE,
        direct_io: bool = True,
        metrics: MetricsRegistry | None = None,
        name: str = "disk",
        coder: ChunkCoder | None = None,
    ) -> None:
        """Open (creating) the slot file; ``coder`` codes every chunk (default: raw) and goes
        into the tier's fingerprint. ``OffloadError`` when the file cannot be opened or is
        locked; ``InvalidArgumentError`` for bad arguments."""
        self._coder, fp = check_stored_tier("DiskTier", num_slots, chunk_bytes, fingerprint, coder)
        if not isinstance(sync, SyncPolicy):
            raise InvalidArgumentError(f"DiskTier.sync must be a SyncPolicy, got {sync!r}")
        self.name = name
        self.path = Path(path)
        self.num_slots = num_slots
        self.chunk_bytes = chunk_bytes
        self.fingerprint = fp
        self.codec = "raw" if coder is None else coder.plan.ident
        self.sync = sync
        self.payload_span = round_up(chunk_bytes)
        self.slot_stride = self.payload_span + ALIGN
        self._counters = TierCounters(metrics, name)
        self._fd: int | None = None  # None: closed
        self._direct_fd: int | None = None  # None: no O_DIRECT descriptor
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self._fd)
                self._fd = None
                raise OffloadError(
                    f"disk tier {str(self.path)!r} is in use by another process"
                ) from None
            os.ftruncate(self._fd, num_slots * self.slot_stride)
            if direct_io and hasattr(os, "O_DIRECT"):
                try:
                    self._direct_fd = os.open(self.path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise
        except OSError as exc:
            self.close()
            raise OffloadError(f"disk tier {str(self.path)!r} cannot be opened: {exc}") from exc
        self.direct = self._direct_fd is not None
        self._bounce = mmap.mmap(-1, self.payload_span)  # page aligned, for unaligned buffers
        self._header = mmap.mmap(-1, ALIGN)
        self._pad = mmap.mmap(-1, ALIGN)  # zeros written over the padding of a buffered slot
        self._lock = threading.Lock()  # the store and the load job threads share the buffers

    # -- helpers ----------------------------------------------------------------------------------
    def _io_fd(self) -> int:
        if self._fd is None:
            raise OffloadError(f"disk tier {str(self.path)!r} is closed")
        if self._direct_fd is not None:
            return self._direct_fd
        return self._fd

    def _direct_ok(self, t: torch.Tensor) -> bool:
        """A buffer direct I/O may use as is: aligned, and no padding to overreach into."""
        return self.payload_span == self.chunk_bytes and t.data_ptr() % ALIGN == 0

    def _offset(self, slot: SlotId) -> int:
        return slot * self.slot_stride

    def _pwritev_all(self, fd: int, bufs: list[memoryview], offset: int) -> None:
        """Write ``bufs`` back to back from ``offset``, finishing any short write in order."""
        done = os.pwritev(fd, bufs, offset)
        for buf in bufs:  # rare: a short write; finish it buffer by buffer, in order
            if done >= len(buf):
                done -= len(buf)
                offset += len(buf)
                continue
            rest, done = buf[done:], 0
            while len(rest):
                n = os.pwrite(fd, rest, offset + len(buf) - len(rest))
                rest = rest[n:]
            offset += len(buf)

    # -- Tier protocol ----------------------------------------------------------------------------
    def write(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], payloads: Sequence[torch.Tensor]
    ) -> None:
        """Write each payload, then its header (see the module docstring for the order).

        With ``SyncPolicy.NONE`` a payload that fills its slot and its header go in one
        ``pwritev``, header last (a write cut short by process death leaves the old header,
        which then fails its checksum); a shorter (coded) payload and its header go in two, in
        that order. With ``SyncPolicy.DATA``: payload, fdatasync, header, fdatasync.
        """
        check_batch(self.name, self.num_slots, self.chunk_bytes, slots, keys, payloads)
        hdr_len = ALIGN if self.direct else HEADER_BYTES
        with self._lock:
            fd = self._io_fd()
            try:
                for slot, key, payload in zip(slots, keys, payloads, strict=True):
                    body, header = self._frame(key, payload)
                    self._header[:HEADER_BYTES] = header.encode()
                    head = memoryview(self._header)[:hdr_len]
                    base = self._offset(slot)
                    whole = sum(len(b) for b in body) == self.payload_span
                    if self.sync is SyncPolicy.NONE and whole:
                        self._pwritev_all(fd, [*body, head], base)
                        continue
                    self._pwritev_all(fd, body, base)
                    if self.sync is SyncPolicy.DATA:
                        os.fdatasync(fd)
                    self._pwritev_all(fd, [head], base + self.payload_span)
                    if self.sync is SyncPolicy.DATA:
                        os.fdatasync(fd)
            except OSError as exc:
                self._counters.error()
                raise OffloadError(f"disk tier {str(self.path)!r}: write failed: {exc}") from exc

    def _frame(self, key: ChunkKey, payload: torch.Tensor) -> tuple[list[memoryview], ChunkHeader]:
        """The buffers to write from the slot's start and the header of ``payload``: coded
        (through the bounce buffer when direct) or, without a codec or when it kept the chunk
        raw, the payload itself (padded to the slot, bounced when direct I/O cannot use it)."""
        enc = self._coder.encode(payload) if self._coder is not None else None
        if enc is not None and not enc.raw:
            n = len(enc.data)
            body = [enc.data]
            if self.direct:
                self._bounce[:n] = enc.data
                body = [memoryview(self._bounce)[: round_up(n)]]
            crc = payload_checksum(enc.data)
            return body, ChunkHeader(key, self.fingerprint, self.chunk_bytes, crc, enc.tag, n)
        view = as_buffer(payload)
        pad = self.payload_span - self.chunk_bytes
        if not self.direct:
            body = [view, memoryview(self._pad)[:pad]] if pad else [view]
        elif self._direct_ok(payload):
            body = [view]
        else:
            self._bounce[: self.chunk_bytes] = view
            body = [memoryview(self._bounce)]
        crc = payload_checksum(view)
        return body, ChunkHeader.raw(key, self.fingerprint, self.chunk_bytes, crc)

    def read(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]
    ) -> list[ReadOutcome]:
        """Read and verify each chunk into ``outs[i]`` (garbage there unless the outcome is OK)."""
        check_batch(self.name, self.num_slots, self.chunk_bytes, slots, keys, outs)
        with self._lock:
            return self._read(slots, keys, outs)

    def _read(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]
    ) -> list[ReadOutcome]:
        fd = self._io_fd()
        outcomes: list[ReadOutcome] = []
        try:
            for slot, key, out in zip(slots, keys, outs, strict=True):
                if self._coder is not None:
                    outcomes.append(self._read_coded(fd, slot, key, out))
                    continue
                view = as_buffer(out)
                bounce = self.direct and not self._direct_ok(out)
                whole = self._read_slot(fd, slot, memoryview(self._bounce) if bounce else view)
                outcome, header = self._check_header(key, whole)
                if header is not None:
                    if bounce:
                        view[:] = self._bounce[: self.chunk_bytes]
                    if payload_checksum(view) != header.checksum:
                        self._counters.corrupt("checksum")
                        outcome = ReadOutcome.CORRUPT
                outcomes.append(outcome)
        except OSError as exc:
            self._counters.error()
            raise OffloadError(f"disk tier {str(self.path)!r}: read failed: {exc}") from exc
        return outcomes

    def _read_coded(self, fd: int, slot: SlotId, key: ChunkKey, out: torch.Tensor) -> ReadOutcome:
        """Read a slot of a coded tier: its header first, then only the stored bytes it names
        (straight into ``out`` when raw and direct I/O allows it), checked, then decoded."""
        hdr_len = ALIGN if self.direct else HEADER_BYTES
        base = self._offset(slot)
        got = os.preadv(fd, [memoryview(self._header)[:hdr_len]], base + self.payload_span)
        outcome, header = self._check_header(key, got == hdr_len)
        if header is None or self._coder is None:
            return outcome
        n = header.stored
        in_place = not header.coded and not (self.direct and not self._direct_ok(out))
        if in_place:
            target = as_buffer(out)
        else:
            target = memoryview(self._bounce)[: round_up(n) if self.direct else n]
        if os.preadv(fd, [target], base) != len(target):
            self._counters.corrupt("truncated")
            return ReadOutcome.CORRUPT
        if payload_checksum(target[:n]) != header.checksum:
            self._counters.corrupt("checksum")
            return ReadOutcome.CORRUPT
        if not in_place and not self._coder.decode(header.codec, target[:n], out):
            self._counters.corrupt("codec")
            return ReadOutcome.CORRUPT
        return ReadOutcome.OK

    def _read_slot(self, fd: int, slot: SlotId, target: memoryview) -> bool:
        """Read a slot's payload into ``target`` and its header into ``self._header`` with one
        ``preadv``; False when the file ended first (truncated)."""
        iov = [target]
        if len(target) < self.payload_span:  # buffered I/O of a padded payload: skip the pad
            iov.append(memoryview(self._bounce)[: self.payload_span - len(target)])
        hdr_len = ALIGN if self.direct else HEADER_BYTES
        iov.append(memoryview(self._header)[:hdr_len])
        return bool(os.preadv(fd, iov, self._offset(slot)) == self.payload_span + hdr_len)

    def _check_header(
        self, key: ChunkKey | None, whole: bool
    ) -> tuple[ReadOutcome, ChunkHeader | None]:
        """Validate the header just read into ``self._header``; OK means "verify the payload"."""
        if not whole:
            self._counters.corrupt("truncated")
            return ReadOutcome.CORRUPT, None
        raw = self._header[:HEADER_BYTES]
        if is_blank(raw):
            if key is not None:
                self._counters.corrupt("missing")
            return ReadOutcome.MISSING, None
        header = verify_header(raw, key, self.fingerprint, self.chunk_bytes)
        if isinstance(header, str):
            self._counters.corrupt(header)
            return ReadOutcome.CORRUPT, None
        return ReadOutcome.OK, header

    def scan(self) -> dict[ChunkKey, SlotId]:
        """Every slot whose header and payload verify, by key (first slot wins on duplicates)."""
        with self._lock:
            return self._scan()

    def _scan(self) -> dict[ChunkKey, SlotId]:
        fd = self._io_fd()
        found: dict[ChunkKey, SlotId] = {}
        scratch = torch.empty(self.chunk_bytes, dtype=torch.uint8)  # a pad target if buffered
        target = memoryview(self._bounce) if self.direct else as_buffer(scratch)
        try:
            for slot in range(self.num_slots):
                whole = self._read_slot(fd, SlotId(slot), target)
                outcome, header = self._check_header(None, whole)
                if header is None or outcome is not ReadOutcome.OK or header.key in found:
                    continue
                if payload_checksum(target[: header.stored]) != header.checksum:
                    self._counters.corrupt("checksum")
                    continue
                found[header.key] = SlotId(slot)
        except OSError as exc:
            self._counters.error()
            raise OffloadError(f"disk tier {str(self.path)!r}: re-index failed: {exc}") from exc
        return found

    def close(self) -> None:
        """Close the file (releasing its lock); idempotent."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            with lock:
                self._close()
        else:
            self._close()

    def _close(self) -> None:
        for attr in ("_direct_fd", "_fd"):
            fd = getattr(self, attr, None)
            if fd is not None:
                os.close(fd)
                setattr(self, attr, None)
