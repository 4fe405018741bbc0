"""What prefill and decode workers share: memory, PD endpoint, order socket and the worker loop.

The worker loop alone mutates pools, tables and request state; other threads post to its inbox.
See docs/serving.md.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from kvplane.errors import KVPlaneError, ProtocolError
from kvplane.ids import PeerId
from kvplane.metrics import FALLBACK_RATIO, MetricsRegistry, MetricsServer
from kvplane.offload.manager import OffloadManager
from kvplane.pd.actions import Action
from kvplane.pd.endpoint import Endpoint
from kvplane.pd.participant import Participant
from kvplane.pd.states import Role, SessionState
from kvplane.pipeline.advert import advert_refusal
from kvplane.pipeline.observe import RuntimeMetrics
from kvplane.pipeline.timeline import Timeline
from kvplane.serving.kv_describe import KeyScheme
from kvplane.serving.kv_publisher import KVEventPublisher, KVEventSettings
from kvplane.serving.live_peers import LivePeers
from kvplane.serving.messages import (
    MAX_PEERS,
    REPLY_MARGIN,
    Ack,
    AnyMessage,
    ErrorReply,
    InfoQuery,
    Shutdown,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
    fit_timeline,
)
from kvplane.serving.pools import WorkerPools
from kvplane.serving.prefix_offload import PrefixOffload
from kvplane.serving.producers.base import KVModel
from kvplane.serving.rpc import Reply, RpcServer
from kvplane.serving.worker_config import SECRET_TRANSPORTS, WorkerConfig
from kvplane.transports.base import Transport
from kvplane.transports.bounds import ConnectionLimits
from kvplane.transports.registry import create_transport

log = logging.getLogger(__name__)
INSECURE_HELP = "1: this process runs without a secret (unauthenticated peers accepted)"
"""The ``kvplane_insecure`` gauge's help (workers and the router alike)."""
GAUGE_PERIOD_S = 0.5
"""How often the worker loop refreshes the sessions-by-state and live-request gauges."""
PEERS_WAIT_S = 1.0
"""Longest wait of an info query's answer for the PD loop's list of live peers (the order
thread never waits for it: :class:`~kvplane.serving.live_peers.LivePeers`)."""


def make_transport(
    config: WorkerConfig, agent: str, metrics: MetricsRegistry | None = None
) -> Transport:
    """The configured transport (``tcp`` listens on ``transport_host``; ``tcp``/``shm`` copy
    with ``copy_threads`` and drop a connection silent past ``first_byte_timeout_s``), its
    batch metrics in ``metrics`` (the worker's ``/metrics``)."""
    options: dict[str, object] = {"agent": agent, "metrics": metrics}
    if config.transport == "tcp":
        options["host"] = config.transport_host
    if config.transport in SECRET_TRANSPORTS and config.secret is not None:
        options["secret"] = config.secret
    if config.transport in ("tcp", "shm"):
        options["limits"] = ConnectionLimits(first_byte_timeout_s=config.first_byte_timeout_s)
        if config.copy_threads is not None:
            options["copy_threads"] = config.copy_threads
    return create_transport(config.transport, **options)


@dataclass(frozen=True, slots=True)
class WorkerHooks:
    """Seams a harness (fault injection) uses: wrap the transport, build the PD endpoint.

    ``make_endpoint(participant, **options)`` takes :class:`Endpoint`'s own arguments.
    """

    wrap_transport: Callable[[Transport], Transport] | None = None
    make_endpoint: Callable[..., Endpoint] | None = None


class Worker:
    """Base of :class:`PrefillWorker` and :class:`DecodeWorker` (see the module docstring).

    ``transport`` may be given (tests: a ``LocalTransport`` on a shared fabric); otherwise it is
    built from the config. ``metrics`` is injected (a fresh registry by default). ``hooks``
    may wrap the transport and build the PD endpoint (fault injection in chaos runs).
    ``kv_events``: publish the offload tiers' chunk changes (``kv_publisher``; None: not).
    """

    role: ClassVar[str] = "worker"
    kv_role: ClassVar[Role | None] = None
    """Which way this worker's KV flows (prefill: ``SENDER``; decode: ``RECEIVER``)."""

    def __init__(
        self,
        config: WorkerConfig,
        model: KVModel,
        *,
        metrics: MetricsRegistry | None = None,
        transport: Transport | None = None,
        hooks: WorkerHooks | None = None,
        kv_events: KVEventSettings | None = None,
    ) -> None:
        self.config = config
        self.kv_event_settings = kv_events
        self.kv_events: KVEventPublisher | None = None
        self.metrics = metrics if metrics is not None else MetricsRegistry()
        self.rmetrics = RuntimeMetrics(self.metrics, self.role)
        self.metrics.gauge(*FALLBACK_RATIO)  # the sixth seed metric: 0 until a model plans
        self.metrics.gauge("insecure", INSECURE_HELP).set(0 if config.secret is not None else 1)
        self.timeline = Timeline(config.name)
        self.incarnation = config.incarnation or time.time_ns() // 1000
        self.transport = transport or make_transport(
            config, f"{config.name}.{self.incarnation}", self.metrics
        )
        hooks = hooks or WorkerHooks()
        if hooks.wrap_transport is not None:
            self.transport = hooks.wrap_transport(self.transport)
        self.pools = WorkerPools(
            model,
            self.transport,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            num_slots=config.num_slots,
            head_range=config.head_range,
            hash_seed=config.hash_seed,
            metrics=self.metrics,
            name=self.role,
        )
        self.participant = Participant(
            PeerId(config.name),
            self.pools.profile(),
            incarnation=self.incarnation,
            timings=config.timings,
            metrics=self.metrics,
            transport=self.transport.name,
            transport_metadata=self.pools.advert(),
            kv_role=self.kv_role,
            check_metadata=advert_refusal,
        )
        pd_options: dict[str, Any] = {
            "bind": config.pd_bind, "secret": config.secret, "metrics": self.metrics,
            "on_action": self._on_action,
        }  # fmt: skip
        make_endpoint = hooks.make_endpoint or Endpoint
        self.endpoint: Endpoint = make_endpoint(self.participant, **pd_options)
        self.rpc = RpcServer(
            config.control_bind, self._on_message, name=f"kvplane-rpc-{config.name}",
            secret=config.secret, metrics=self.metrics,
        )  # fmt: skip
        self.live_peers = LivePeers(
            self._read_peers, wait_s=PEERS_WAIT_S, max_peers=MAX_PEERS,
            name=f"kvplane-peers-{config.name}",
        )  # fmt: skip
        self.counters: Counter[str] = Counter()
        self.exit_requested = threading.Event()
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvplane-{self.role}", daemon=True)
        self._started = False
        self._metrics_server: MetricsServer | None = None
        self._next_gauges = 0.0

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The order socket's address (what a router connects to)."""
        return self.rpc.address

    def start(self) -> None:
        self._started = True
        self.endpoint.start()
        self._start_kv_events()
        self._thread.start()
        self.rpc.start()
        if self.config.metrics_port:
            self._metrics_server = self.metrics.serve(self.config.metrics_port)

    def close(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None
        self.rpc.close()
        self.live_peers.close()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        self._close_parts()
        if self.kv_events is not None:
            self.kv_events.close()
        self.endpoint.close()
        self.transport.close()

    def _start_kv_events(self) -> None:
        """Bind the KV event publisher (when configured) and watch the offload tiers, each
        with its own tokens per chunk (a lower tier's chunk spans host chunks), before the
        worker loop (their owner) starts."""
        if self.kv_event_settings is None:
            return
        offload = getattr(self, "offload", None)  # a prefill worker's prefix offload, if any
        tiers: list[OffloadManager] = []
        tokens, spans, scheme = 0, {}, None
        if isinstance(offload, PrefixOffload):
            tiers, tokens = offload.cascade.managers(), offload.spec.tokens_per_chunk
            spans = offload.cascade.book.spans  # host chunks per chunk of each lower tier
            scheme = KeyScheme.of(self.pools.hasher, offload.spec)  # answers a describe
        self.kv_events = KVEventPublisher(
            self.config.name, self.incarnation, self.kv_event_settings,
            secret=self.config.secret, block_size=tokens, scheme=scheme,
        )  # fmt: skip
        self.kv_events.watch_tiers(tiers, tokens, spans)
        self.kv_events.start()

    def _close_parts(self) -> None:
        """Subclass hook: stop helper threads (before the endpoint and transport close)."""

    def info(self) -> WorkerInfo:
        """Who this worker is, with its pools' TP head ranges (the router pairs by them); its
        ``peers`` is None (does not say): only the answer to an ``InfoQuery`` lists them
        (:meth:`_answer_info`). Any thread; never waits."""
        offload = getattr(self, "offload", None)  # a prefill worker's prefix offload, if any
        chunks = offload.spec.blocks_per_chunk if isinstance(offload, PrefixOffload) else 0
        return WorkerInfo(
            role=self.role,
            peer_id=self.config.name,
            pd_address=self.endpoint.address,
            incarnation=self.incarnation,
            transport=self.transport.name,
            metrics_port=self.config.metrics_port,
            head_ranges=tuple(lay.head_range for lay in self.pools.layouts),
            kv_events_address=self.kv_events.address if self.kv_events else "",
            kv_replay_address=self.kv_events.replay_address if self.kv_events else "",
            hash_seed=self.pools.hasher.seed,
            hash_fingerprint=self.pools.hasher.fingerprint,
            block_size=self.pools.kv.layout.block_size,
            blocks_per_chunk=chunks,
            layer_ids=self.pools.layer_ids,  # every KV cache group's
            paged_pools=self.pools.num_kv_pools,
            pp_stage=self.pools.placement.pp_stage,
            tp_rank=self.pools.placement.tp_rank,
        )

    def _read_peers(self, timeout_s: float) -> list[str]:
        """The PD peers with a live connection (accepted handshake, lease current), sorted,
        read on the PD loop; ``TimeoutError`` when it does not answer within ``timeout_s``."""
        return [str(p) for p in self.endpoint.call(self.participant.peers.live_peers, timeout_s)]

    def _answer_info(self, reply: Reply) -> None:
        """Answer an ``InfoQuery`` with :meth:`info` and the PD peers live when it arrived or
        later (the router re-pairs by them), read off the calling thread: the order thread
        never waits on the PD loop (None after :data:`PEERS_WAIT_S`, or beyond ``MAX_PEERS``)."""
        info = self.info()
        self.live_peers.ask(lambda peers: reply(msgspec.structs.replace(info, peers=peers)))

    # -- threads other than the loop -------------------------------------------------------------
    def _on_action(self, act: Action) -> None:
        """PD loop thread: hand the action to the worker loop."""
        self._inbox.put(act)

    def _on_message(self, msg: AnyMessage, reply: Reply) -> None:
        """Order-server thread: answer what needs no state, queue the rest."""
        if isinstance(msg, InfoQuery):
            self._answer_info(reply)
        elif isinstance(msg, Shutdown):
            reply(Ack(detail="exiting"))
            self.exit_requested.set()
        else:
            self._inbox.put((msg, reply))

    # -- the worker loop -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._inbox.get(timeout=0 if self._has_work() else 0.02)
            except queue.Empty:
                item = None
            try:
                while item is not None:
                    self._handle(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            except Exception:  # a bug must not stop the worker: count it and keep serving
                self.counters["loop_errors"] += 1
                log.exception("%s worker loop error", self.role)
            if self._has_work():
                try:
                    self._work()
                except Exception:
                    self.counters["loop_errors"] += 1
                    log.exception("%s worker step error", self.role)
            if time.monotonic() >= self._next_gauges:
                self._next_gauges = time.monotonic() + GAUGE_PERIOD_S
                self._refresh_gauges()

    def _handle(self, item: object) -> None:
        """One inbox item. An order is always answered: a ``KVPlaneError`` (a refusal) and any
        other exception (a bug: logged and counted in ``order_errors``) become an
        ``ErrorReply``."""
        if isinstance(item, tuple):
            msg, reply = item
            try:
                if isinstance(msg, StatsQuery):
                    stats = self.stats(timeline=msg.timeline)
                    reply(fit_timeline(stats, self.rpc.max_frame - REPLY_MARGIN))
                else:
                    self._on_order(msg, reply)
            except KVPlaneError as exc:
                reply(ErrorReply(reason=str(exc)[:4000]))
            except Exception as exc:
                self.counters["order_errors"] += 1
                log.exception("%s worker failed on %s", self.role, type(msg).__name__)
                reply(ErrorReply(reason=f"internal error: {type(exc).__name__}: {exc}"[:4000]))
        else:
            self._on_pd(item)

    def _has_work(self) -> bool:
        return False

    def _work(self) -> None:
        """One unit of the worker's own work (a prefill step); called between inbox items."""

    def _on_order(self, msg: AnyMessage, reply: Reply) -> None:
        reply(ErrorReply(reason=f"a {self.role} worker does not take {type(msg).__name__}"))

    def _on_pd(self, act: object) -> None:
        raise NotImplementedError

    def _requests_live(self) -> int:
        return 0

    # -- observation -------------------------------------------------------------------------------
    def _refresh_gauges(self) -> Counter[str]:
        """Live sessions by state and live requests into their gauges (worker loop)."""
        by_state: Counter[str] = self.endpoint.call(
            lambda: Counter(s.state.value for s in self.participant.sessions.values())
        )
        for state in SessionState:
            self.rmetrics.sessions.labels(state.value).set(by_state.get(state.value, 0))
        self.rmetrics.live.set(self._requests_live())
        return by_state

    def stats(self, *, timeline: bool = False) -> WorkerStats:
        """Counters, pool usage, sessions and the integrity verdict (call on the worker loop).
        A ``StatsQuery`` reply keeps only the newest events that fit in one frame
        (``timeline_truncated`` counts the others)."""
        snap = self.endpoint.snapshot()
        snap.update({f"worker_{k}": v for k, v in self.counters.items()})
        snap.update({f"rpc_{k}": v for k, v in self.rpc.snapshot().items()})
        if self.kv_events is not None:
            snap.update({f"kv_events_{k}": v for k, v in self.kv_events.snapshot().items()})
        by_state = self._refresh_gauges()
        problem = ""
        try:
            self.pools.check_integrity()
            self.endpoint.call(self.participant.check_integrity)
        except (KVPlaneError, ProtocolError) as exc:
            problem = str(exc)[:4000]
        events: tuple[dict[str, str | int | float], ...] = ()
        if timeline:
            events = tuple(_plain(e.as_dict()) for e in self.timeline.events())
        return WorkerStats(
            peer_id=self.config.name,
            counters=dict(snap),
            used_blocks=self.pools.num_used_blocks,  # every KV cache group's
            used_slots=self.pools.slots.num_used_blocks,
            sessions_live=sum(by_state.values()),
            requests_live=self._requests_live(),
            integrity=problem,
            timeline=events,
        )


def _plain(d: dict[str, object]) -> dict[str, str | int | float]:
    return {k: v for k, v in d.items() if isinstance(v, str | int | float)}
