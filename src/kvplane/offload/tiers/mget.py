"""Pipelined ``MGET`` streams whose replies a Redis tier reads itself, with
:class:`~kvplane.offload.tiers.resp.ReplyReader` (payloads straight into the caller's memory).

Owns one pooled connection for the length of a stream; never parses a reply. See
docs/offload.md ("The remote tier", "Pipelining").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvplane.offload.tiers.resp import ReplyReader


def stream_mgets(
    client: Any,
    names: Sequence[Sequence[bytes]],
    groups: Sequence[range],
    on_group: Callable[[ReplyReader, range], None],
) -> None:
    """Send ``MGET *names[i]`` for each ``i`` of ``groups`` on one connection of ``client``
    (a ``redis.Redis``), group by group, and let ``on_group(reader, group)`` read each group's
    replies in order. The next group's commands go out before the current group's replies are
    read, so the server prepares them meanwhile.

    Raises what the connection or ``on_group`` raises. A connection whose reply stream failed
    part-way is dropped, never reused (its place in the stream is unknown)."""
    if not groups:
        return
    pool = client.connection_pool
    conn = pool.get_connection()
    clean = False
    try:
        # No health check on send: its PING would read an MGET reply as its answer, and the
        # replies are read here, not by the client, whose health timer never restarts.
        reader = ReplyReader(conn._sock)

        def send(group: range) -> None:
            packed = conn.pack_commands([("MGET", *names[i]) for i in group])
            conn.send_packed_command(list(packed), check_health=False)

        send(groups[0])
        for k, group in enumerate(groups):
            if k + 1 < len(groups):
                send(groups[k + 1])
            on_group(reader, group)
        clean = True
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)
