""":class:`RouterService`: the order socket of ``kvplane serve router``.

``Generate``, ``CancelOrder``, ``InfoQuery`` and ``StatsQuery``; the server thread never
blocks. The socket authenticates with the router's secret; ``/metrics`` serves the router's
registry. See docs/serving.md.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvplane.errors import KVPlaneError
from kvplane.metrics import MetricsServer
from kvplane.serving.messages import (
    REPLY_MARGIN,
    Ack,
    AnyMessage,
    CancelOrder,
    ErrorReply,
    Generate,
    InfoQuery,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
    fit_timeline,
)
from kvplane.serving.router.router import Router
from kvplane.serving.rpc import DEFAULT_MAX_FRAME, Reply, RpcServer
from kvplane.validators import require_int

log = logging.getLogger(__name__)
HELPERS = 4
"""Default number of helper threads of a :class:`RouterService`."""


class RouterService:
    """``router`` served on an order socket bound at ``bind`` (see the module docstring).
    :meth:`start` serves, :meth:`close` stops the socket and the helpers (not the router).
    Only clients holding ``router.secret`` are served (CURVE; None: anyone). ``metrics_port``
    (0: none): :meth:`start` serves ``router.metrics`` there (127.0.0.1), the order socket's
    drops included. ``InvalidArgumentError`` for ``helpers`` < 1 or a port outside 0..65535."""

    def __init__(
        self,
        router: Router,
        bind: str,
        *,
        name: str = "kvplane-router",
        max_frame: int = DEFAULT_MAX_FRAME,
        helpers: int = HELPERS,
        metrics_port: int = 0,
    ) -> None:
        require_int("helpers", helpers, min=1)
        self.metrics_port = require_int("metrics_port", metrics_port, min=0, max=65535)
        self.router = router
        self._pool = ThreadPoolExecutor(helpers, thread_name_prefix="kvplane-router-helper")
        self.server = RpcServer(
            bind, self.handle, name=name, max_frame=max_frame, secret=router.secret,
            metrics=router.metrics,
        )  # fmt: skip
        self.address = self.server.address
        self._metrics_server: MetricsServer | None = None

    def start(self) -> None:
        """Serve orders, and ``/metrics`` with ``metrics_port`` (``OSError`` if it is taken)."""
        if self.metrics_port:
            self._metrics_server = self.router.metrics.serve(self.metrics_port)
        self.server.start()

    def close(self) -> None:
        """Stop ``/metrics``, the order socket and the helpers, joining them. A helper still
        waiting on a worker (a refresh before a ``Generate``) is waited for: close the router
        first (:meth:`Router.close` fails every such wait at once) for a prompt close."""
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None
        self.server.close()
        self._pool.shutdown(wait=True, cancel_futures=True)  # a running refresh: by probe_s

    def handle(self, msg: AnyMessage, reply: Reply) -> None:
        """Answer one client message (see the module docstring). A ``KVPlaneError`` raised here
        is answered by the order server with an ``ErrorReply``."""
        router = self.router
        if isinstance(msg, Generate):
            if router.ready():
                _submit(router, msg, reply)
            else:
                since = router.refreshes
                self._off_thread(lambda: _refresh_then_submit(router, since, msg, reply), reply)
        elif isinstance(msg, CancelOrder):
            ok = router.cancel(msg.request_id, reason=msg.reason)
            reply(Ack(detail="cancelling" if ok else "unknown request"))
        elif isinstance(msg, InfoQuery):
            reply(
                WorkerInfo(
                    role="router", peer_id="router", pd_address="", incarnation=0, transport=""
                )
            )
        elif isinstance(msg, StatsQuery):
            limit = self.server.max_frame - REPLY_MARGIN
            self._off_thread(
                lambda: reply(router_stats(router, limit, timeline=msg.timeline)), reply
            )
        else:
            reply(ErrorReply(reason=f"the router does not take {type(msg).__name__}"))

    def _off_thread(self, work: Callable[[], None], reply: Reply) -> None:
        """Run ``work`` on a helper; whatever it raises is answered as an ``ErrorReply``."""

        def run() -> None:
            try:
                work()
            except KVPlaneError as exc:
                reply(ErrorReply(reason=str(exc)[:4000]))
            except Exception as exc:  # a bug: answer it, log it
                log.exception("router handler error")
                reply(ErrorReply(reason=f"internal error: {type(exc).__name__}: {exc}"[:4000]))

        try:
            self._pool.submit(run)
        except RuntimeError:  # closing: the executor takes no more work
            reply(ErrorReply(reason="the router is shutting down"))


def _submit(router: Router, msg: Generate, reply: Reply) -> None:
    fut = router.submit(
        msg.request_id, msg.token_ids, max_new_tokens=msg.max_new_tokens, step_size=msg.step_size
    )
    fut.add_done_callback(lambda f: reply(f.result()))


def _refresh_then_submit(router: Router, since: int, msg: Generate, reply: Reply) -> None:
    try:
        router.refresh_unless_ready(since)
    except KVPlaneError as exc:  # some pairing failed: submit to what is up
        log.warning("router refresh: %s", exc)
    _submit(router, msg, reply)


def router_stats(router: Router, max_bytes: int, *, timeline: bool = False) -> WorkerStats:
    """The workers' stats aggregated (:func:`aggregate`), fitted to ``max_bytes``."""
    got, missing = router.gather_stats(timeline=timeline)
    up, down = router.worker_counts()
    own = {
        "router_flights": router.flights_live,
        "router_gathered": router.gathered,
        "router_workers_up": up,
        "router_workers_down": down,
        "router_workers_missing": len(missing),
    }
    stats = aggregate(list(got.values()), own, requests_live=router.flights_live)
    return fit_timeline(stats, max_bytes)


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
