"""What a client may ask ``kvplane serve router`` (the router's order-socket handler).

- ``Generate``: :meth:`Router.submit`; answered with the request's ``RequestResult`` (failed by
  the router's request deadline at the latest), or refused with an ``ErrorReply`` (invalid
  values, a request id already in flight, no worker of a role up). While no worker of a role is
  up, the router first refreshes once (off the server thread), then submits or refuses.
- ``CancelOrder``: :meth:`Router.cancel` on the decode side; ``Ack`` ("cancelling" or
  "unknown request").
- ``InfoQuery``: a ``WorkerInfo`` with role and peer id ``router``.
- ``StatsQuery``: one ``WorkerStats`` aggregated over the workers (peer id ``router``, see
  :func:`aggregate`), gathered off the server thread.
- anything else: ``ErrorReply``.

The handler never blocks the server thread: a refresh and a stats gathering run on a helper
thread each; every message is answered.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from kvplane.errors import KVPlaneError
from kvplane.runtime.messages import (
    Ack,
    AnyMessage,
    CancelOrder,
    ErrorReply,
    Generate,
    InfoQuery,
    RequestResult,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
    fit_timeline,
)
from kvplane.runtime.rpc import Reply

log = logging.getLogger(__name__)
REPLY_MARGIN = 1024
"""Bytes of a frame kept for the envelope when the aggregated stats are fitted to it."""


class Router(Protocol):
    """What serving needs of a :class:`kvplane.runtime.router.Router`."""

    max_frame: int

    @property
    def flights_live(self) -> int: ...

    def ready(self) -> bool: ...

    def refresh_unless_ready(self) -> None: ...

    def worker_counts(self) -> tuple[int, int]:
        """Workers up, workers down."""
        ...

    def submit(
        self,
        request_id: str,
        token_ids: tuple[int, ...] | list[int],
        *,
        max_new_tokens: int = 1,
        step_size: int = 0,
    ) -> Future[RequestResult]: ...

    def cancel(
        self, request_id: str, *, side: str = "decode", reason: str = "cancelled"
    ) -> bool: ...

    def gather_stats(
        self, *, timeline: bool = False
    ) -> tuple[dict[str, WorkerStats], list[str]]: ...


def serve_message(router: Router, msg: AnyMessage, reply: Reply) -> None:
    """Answer one client message (see the module docstring). A ``KVPlaneError`` raised here
    is answered by the order server with an ``ErrorReply``."""
    if isinstance(msg, Generate):
        if router.ready():
            _submit(router, msg, reply)
        else:
            _off_thread(lambda: _refresh_then_submit(router, msg, reply), reply)
    elif isinstance(msg, CancelOrder):
        ok = router.cancel(msg.request_id, reason=msg.reason)
        reply(Ack(detail="cancelling" if ok else "unknown request"))
    elif isinstance(msg, InfoQuery):
        reply(
            WorkerInfo(role="router", peer_id="router", pd_address="", incarnation=0, transport="")
        )
    elif isinstance(msg, StatsQuery):
        _off_thread(lambda: reply(router_stats(router, timeline=msg.timeline)), reply)
    else:
        reply(ErrorReply(reason=f"the router does not take {type(msg).__name__}"))


def _submit(router: Router, msg: Generate, reply: Reply) -> None:
    fut = router.submit(
        msg.request_id, msg.token_ids, max_new_tokens=msg.max_new_tokens, step_size=msg.step_size
    )
    fut.add_done_callback(lambda f: reply(f.result()))


def _refresh_then_submit(router: Router, msg: Generate, reply: Reply) -> None:
    try:
        router.refresh_unless_ready()
    except KVPlaneError as exc:  # some pairing failed: submit to what is up
        log.warning("router refresh: %s", exc)
    _submit(router, msg, reply)


def _off_thread(work: Callable[[], None], reply: Reply) -> None:
    """Run ``work`` on a helper thread; whatever it raises is answered as an ``ErrorReply``."""

    def run() -> None:
        try:
            work()
        except KVPlaneError as exc:
            reply(ErrorReply(reason=str(exc)[:4000]))
        except Exception as exc:  # a bug: answer it, log it
            log.exception("router handler error")
            reply(ErrorReply(reason=f"internal error: {type(exc).__name__}: {exc}"[:4000]))

    threading.Thread(target=run, name="kvplane-router-helper", daemon=True).start()


def router_stats(router: Router, *, timeline: bool = False) -> WorkerStats:
    """The workers' stats aggregated (:func:`aggregate`), fitted to the router's frame limit."""
    got, missing = router.gather_stats(timeline=timeline)
    up, down = router.worker_counts()
    own = {
        "router_flights": router.flights_live,
        "router_workers_up": up,
        "router_workers_down": down,
        "router_workers_missing": len(missing),
    }
    stats = aggregate(list(got.values()), own, requests_live=router.flights_live)
    return fit_timeline(stats, router.max_frame - REPLY_MARGIN)


def aggregate(stats: list[WorkerStats], own: dict[str, int], *, requests_live: int) -> WorkerStats:
    """One ``WorkerStats`` for many: counters summed by name (plus ``own``), pool usage and
    live sessions summed, ``requests_live`` as given (the router's requests in flight), the
    first broken integrity prefixed by its worker's peer id, the timelines merged by time."""
    counters: Counter[str] = Counter()
    for s in stats:
        counters.update(s.counters)
    counters.update(own)
    problems = [f"{s.peer_id}: {s.integrity}" for s in stats if s.integrity]
    events = sorted((e for s in stats for e in s.timeline), key=lambda e: float(e.get("t", 0.0)))
    return WorkerStats(
        peer_id="router",
        counters=dict(counters),
        used_blocks=sum(s.used_blocks for s in stats),
        used_slots=sum(s.used_slots for s in stats),
        sessions_live=sum(s.sessions_live for s in stats),
        requests_live=requests_live,
        integrity=problems[0][:4000] if problems else "",
        timeline=tuple(events),
        timeline_truncated=sum(s.timeline_truncated for s in stats),
    )
