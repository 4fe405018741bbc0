"""Reading Redis (RESP) replies off a socket, with bulk payloads landing in the caller's memory.

After any error the connection's position is unknown: its owner must drop it. See
docs/offload.md.
"""

from __future__ import annotations

import socket

from kvplane.errors import MalformedMessageError, OffloadError

BUFFER_BYTES = 64 << 10
"""Size of the line buffer (payload bytes beyond it go straight to their destination)."""
MAX_LINE = 1024
"""Longest reply line accepted (a length or an error message)."""
MAX_BULK = 1 << 31
"""Largest bulk length accepted."""


class ReplyReader:
    """Sequential reader of RESP replies on ``sock`` (which it never closes). Not thread-safe:
    one reader per connection, used by one thread at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    # -- buffer ------------------------------------------------------------------------------
    def _fill(self) -> None:
        """Read more bytes after the buffered ones (compacting first when the tail is full)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            kept = self._end - self._start
            self._buf[:kept] = self._buf[self._start : self._end]
            self._start, self._end = 0, kept
        got = self._sock.recv_into(self._view[self._end :])
        if got == 0:
            raise ConnectionError("the Redis server closed the connection")
        self._end += got

    def _line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._buf[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start > MAX_LINE:
                raise MalformedMessageError(f"a Redis reply line is over {MAX_LINE} bytes")
            self._fill()

    def _take(self, out: memoryview) -> None:
        """Fill ``out`` exactly: buffered bytes first, the rest straight from the socket."""
        have = min(self._end - self._start, len(out))
        out[:have] = self._view[self._start : self._start + have]
        self._start += have
        done = have
        while done < len(out):
            got = self._sock.recv_into(out[done:])
            if got == 0:
                raise ConnectionError("the Redis server closed the connection mid-reply")
            done += got

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._buf[self._start : self._start + 2] != b"\r\n":
            raise MalformedMessageError("a Redis bulk reply does not end in CRLF")
        self._start += 2

    # -- replies -----------------------------------------------------------------------------
    def _count(self, line: bytes, kind: bytes) -> int:
        if line[:1] == b"-":
            raise OffloadError(f"Redis error reply: {line[1:].decode(errors='replace')}")
        if line[:1] == b"!":  # RESP3 blob error: the message follows as a bulk body
            raise OffloadError(f"Redis error reply: {self._blob_error(line)}")
        if line == b"_":  # RESP3 null
            return -1
        if line[:1] != kind:
            raise MalformedMessageError(f"expected a {kind!r} Redis reply, got {line[:40]!r}")
        try:
            n = int(line[1:])
        except ValueError:
            raise MalformedMessageError(f"bad Redis reply length {line[:40]!r}") from None
        if n < -1 or n > MAX_BULK:
            raise MalformedMessageError(f"Redis reply length {n} is out of range")
        return n

    def _blob_error(self, line: bytes) -> str:
        """The message of a RESP3 blob error whose ``!<len>`` line is ``line`` (read whole:
        at most :data:`MAX_LINE` bytes are kept)."""
        try:
            n = int(line[1:])
        except ValueError:
            raise MalformedMessageError(f"bad Redis reply length {line[:40]!r}") from None
        if not 0 <= n <= MAX_LINE:
            raise MalformedMessageError(f"Redis blob error length {n} is out of range")
        return self.bulk_bytes(n).decode(errors="replace")

    def array(self) -> int:
        """The element count of the next reply, an array (``*n``); -1 for a nil array."""
        return self._count(self._line(), b"*")

    def bulk_length(self) -> int | None:
        """Start the next bulk reply: its length, or None for nil (then it is consumed)."""
        n = self._count(self._line(), b"$")
        return None if n < 0 else n

    def bulk_bytes(self, n: int) -> bytes:
        """The ``n``-byte body of the bulk reply started by :meth:`bulk_length`."""
        out = bytearray(n)
        self._take(memoryview(out))
        self._crlf()
        return bytes(out)

    def bulk_into(self, out: memoryview) -> None:
        """The body of the bulk reply started by :meth:`bulk_length`, whose length is exactly
        ``len(out)``, written into ``out`` (a writable byte view)."""
        self._take(out)
        self._crlf()

    def skip(self, n: int) -> None:
        """Discard the ``n``-byte body of the bulk reply started by :meth:`bulk_length`."""
        left = n
        while left > 0:
            if self._start == self._end:
                self._fill()
            step = min(left, self._end - self._start)
            self._start += step
            left -= step
        self._crlf()
