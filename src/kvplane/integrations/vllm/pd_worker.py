"""The connector's PD side in vLLM's worker: sessions, slices and transfers over vLLM's KV buffer.

Owns :class:`PDWorkerSide`: a PD participant and endpoint, a kvplane transport with vLLM's KV
buffer registered as one region, and the slice driver that plans and runs every slice. A prefill
engine cuts each step's KV into slices (block-aligned) and hands them to the session the decode
engine's ``TransferRequest`` opens (before or after the prefill: pipelined or pull); a decode
engine opens receiver sessions into the blocks vLLM allocated. Memory is handed back to vLLM only
on the ledger's release. At TP > 1 there is one per rank: it announces and plans with its head
range (:func:`~.pd_ranks.rank_layout`), names its sessions by rank
(:func:`~.pd_ranks.rank_session`) and pairs with the same rank of the other engine (handshakes:
:mod:`.pd_peers`). Decides nothing about which requests move: :mod:`.pd_scheduler` does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvplane.errors import KVPlaneError, ProtocolError, UnsupportedError
from kvplane.ids import PeerId, RequestId, SessionId
from kvplane.integrations.vllm import pd_groups
from kvplane.integrations.vllm.groups import KVGroup
from kvplane.integrations.vllm.messages import EndOp, PDResult, RecvOp, SendOp, StepMeta
from kvplane.integrations.vllm.pd_config import PDSettings
from kvplane.integrations.vllm.pd_peers import PrefillPeers
from kvplane.integrations.vllm.pd_ranks import heads_refusal, rank_session
from kvplane.integrations.vllm.pd_transport import register_pools
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.tp import TPShard
from kvplane.integrations.vllm.wakeup import Wakeup
from kvplane.metrics import MetricsRegistry
from kvplane.pd.actions import Action, DestinationKnown, Finished, Release, StartSubmit
from kvplane.pd.endpoint import Endpoint
from kvplane.pd.events import Cancel, Fail, StartTransfer, SubmitSlice
from kvplane.pd.handshake import PROTOCOL_VERSION, PeerProfile
from kvplane.pd.participant import Participant
from kvplane.pd.states import Role, SessionState
from kvplane.pipeline.advert import encode_advert
from kvplane.pipeline.driver import SliceDriver
from kvplane.pipeline.driver_records import SliceSource
from kvplane.pipeline.observe import RuntimeMetrics
from kvplane.pipeline.slicing import SliceCutter
from kvplane.pipeline.timeline import Timeline
from kvplane.transports.base import Transport

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Send:
    """One prefill request's send: its cutter, the slices cut before its session existed, and
    the ledger count (admitted vs released) that decides when vLLM may free its blocks."""

    op: SendOp
    cutter: SliceCutter
    parked: list[SubmitSlice] = field(default_factory=list)
    bound: bool = False
    admitted: int = 0
    released: int = 0
    outcome: SessionState | None = None
    reason: str = ""
    stopped: bool = False
    last_at: float | None = None

    @property
    def drained(self) -> bool:
        """Every slice handed to the session was released (none may still be read)."""
        return self.released >= self.admitted


@dataclass(slots=True, eq=False)
class _Recv:
    op: RecvOp
    opened: bool = False


class PDWorkerSide:
    """See the module docstring. ``model_id`` is the engine fingerprint's digest (hex): peers
    with another one are refused at the handshake (it names the TP rank and size). Every
    session's progress notifies ``wake`` (shared with the offload side:
    :func:`~.wakeup.end_step`). ``shard``: this worker's TP rank (settings already per rank:
    :func:`~.pd_ranks.rank_settings`). ``groups``: vLLM's KV cache groups (:mod:`.pd_groups`),
    ``pool`` group 0's and ``group_pools`` the others'."""

    def __init__(
        self,
        settings: PDSettings,
        pool: VllmPool,
        model_id: str,
        metrics: MetricsRegistry,
        transport: Transport,
        *,
        wake: Wakeup | None = None,
        shard: TPShard | None = None,
        groups: Sequence[KVGroup] = (),
        group_pools: Sequence[VllmPool] = (),
    ) -> None:
        pools = (pool, *group_pools)
        self.settings = settings
        self.shard = TPShard() if shard is None else shard
        self.rank = self.shard.rank
        self.wake = Wakeup() if wake is None else wake
        self.pool = pool
        self.layouts = pd_groups.pd_layouts(pools, groups, self.shard)
        self.layout = layout = self.layouts[0]
        self.block_size = layout.block_size
        name = settings.name
        incarnation = time.time_ns() // 1000
        self.transport = transport
        self.regions, local = register_pools(transport, pools)
        self.region = self.regions[0]
        infos = tuple(pd_groups.layout_info(lay) for lay in self.layouts)
        profile = PeerProfile(protocol_version=PROTOCOL_VERSION, model_id=model_id, layouts=infos)
        pairs = list(zip(self.layouts, self.regions, strict=True))
        advert = encode_advert(self.transport.name, self.transport.metadata(), pairs)
        self.participant = Participant(
            PeerId(name),
            profile,
            incarnation=incarnation,
            timings=settings.timings,
            metrics=metrics,
            transport=self.transport.name,
            transport_metadata=advert,
            check_metadata=functools.partial(pd_groups.group_refusal, self.layouts),
        )
        self.endpoint = Endpoint(
            self.participant,
            bind=settings.bind,
            secret=settings.secret,
            metrics=metrics,
            on_action=self._on_action,
        )
        self.timeline = Timeline(name)
        self.driver = SliceDriver(
            self.endpoint,
            self.transport,
            self._source,
            local_regions=local,
            slice_timeout_s=settings.slice_timeout_s,
            metrics=RuntimeMetrics(metrics, "vllm"),
            timeline=self.timeline,
        )
        self._lock = threading.Lock()
        self._sends: dict[SessionId, _Send] = {}
        self._send_of: dict[str, SessionId] = {}
        self._known: dict[SessionId, DestinationKnown] = {}
        self._recvs: dict[SessionId, _Recv] = {}
        self._dials: queue.SimpleQueue[RecvOp | None] = queue.SimpleQueue()
        self._dialing = 0
        """Receives handed to the dial thread and not yet opened or failed (each a handshake
        with a prefill engine that progresses without vLLM): they make the worker :attr:`busy`."""
        self._results: list[PDResult] = []
        self._sent_done: set[str] = set()
        self._recv_done: set[str] = set()
        self._delayed: set[str] = set()
        self._finished: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_recvs: set[str] = set()  # several groups: a failed receive is the request's
        self._failing: list[tuple[SessionId, str]] = []
        self.driver.start()
        self.endpoint.start()
        self.peers = PrefillPeers(self.endpoint, settings.connect_timeout_s, self.shard)
        self._dialer = threading.Thread(target=self._dial_loop, name="kvplane-pd-dial", daemon=True)
        self._dialer.start()

    @property
    def address(self) -> str:
        """The PD endpoint's address, as a finished prefill names it to the decode engine."""
        return self.endpoint.address

    @property
    def engine_id(self) -> str:
        return str(self.participant.peer_id)

    # -- one engine step (model runner thread) ---------------------------------------------------
    def begin_step(self, meta: StepMeta) -> None:
        """Before the forward: end sessions vLLM dropped (a preempted prefill's in-flight slices
        drain first: its blocks may be reused by this very forward) and open receives."""
        self._pump()
        for end in meta.ends:
            self._end(end)
        drain = [self._send_of[e.req_id] for e in meta.ends if e.req_id in self._send_of]
        self._drain(drain)
        with self._lock:
            self._dialing += len(meta.recvs)
        for op in meta.recvs:
            self._dials.put(op)

    def after_forward(self, meta: StepMeta) -> None:
        """After the forward: the step's KV exists; cut and hand over each request's slices."""
        for op in meta.sends:
            self._cut(op)
        with self._lock:
            self._delayed.update(meta.pd_delayed)

    def finished(self, finished_req_ids: Sequence[str] = ()) -> tuple[set[str], set[str]]:
        """(requests whose sends are done and blocks vLLM may free, requests whose receives
        ended), each reported once; a send is reported only once vLLM delayed it. An idle step
        waits for sessions to progress in :func:`~.wakeup.end_step`, not here."""
        self._pump()
        with self._lock:
            self._finished.update(finished_req_ids)
            sent = self._sent_done & self._delayed & self._finished
            self._sent_done -= sent
            self._delayed -= sent
            self._finished -= sent
            got, self._recv_done = self._recv_done, set()
        return sent, got

    def take_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def take_failed(self) -> set[str]:
        """Requests whose receive failed with several KV cache groups (see ``_recv_ended``)."""
        with self._lock:
            out, self._failed_recvs = self._failed_recvs, set()
        return out

    @property
    def has_news(self) -> bool:
        """Session results not yet handed to the scheduler side."""
        with self._lock:
            return bool(self._results)

    def take_results(self) -> list[PDResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    # -- prefill side ----------------------------------------------------------------------------
    def _source(self, sid: SessionId) -> SliceSource | None:
        with self._lock:
            send = self._sends.get(sid)
            if send is None:
                return None
            tables = (send.op.block_ids, *send.op.group_block_ids)
            pools = pd_groups.sources(self.layouts, self.regions, tables)
            return SliceSource(send.op.req_id, pools)

    def _cut(self, op: SendOp) -> None:
        sid = rank_session(op.session_id, self.rank)
        with self._lock:
            send = self._sends.get(sid)
            if send is None:
                cutter = SliceCutter(op.num_tokens, self.block_size)
                send = self._sends[sid] = _Send(op, cutter)
                self._send_of[op.req_id] = sid
                self._sent_done.discard(op.req_id)  # an earlier, ended send of a preempted run
            else:
                send.op = op  # the table grew: later slices read the new blocks
            if send.stopped:
                return
            cut = send.cutter.after_step(op.computed_end, op.last)
            hint = self._known.pop(sid, None)
        self.driver.source_ready(sid)
        if hint is not None:
            self._bind(send, hint)
        tables = (op.block_ids, *op.group_block_ids)
        if (hole := pd_groups.window_hole(self.layouts, tables, op.num_tokens)) is not None:
            self._end(EndOp(op.req_id, hole))  # the decode engine computes the request
            return
        if cut is None:
            return
        slice_id, rng = cut
        command = SubmitSlice(slice_id=slice_id, is_last=op.last, start=rng.start, end=rng.end)
        with self._lock:
            if op.last:
                send.last_at = time.monotonic()
            if not send.bound:
                send.parked.append(command)
                return
            send.admitted += 1
        self.driver.admit(sid, command, lambda ok: self._on_admitted(sid, ok))

    def _bind(self, send: _Send, hint: DestinationKnown) -> None:
        """The decode side's request arrived: check it names our prompt, then release every
        slice parked before it (pull mode: all of them)."""
        sid = hint.session_id
        req = hint.request
        other = self.settings.check_prompt and str(req.request_id) != send.op.prompt
        if other or req.num_tokens != send.op.num_tokens:
            with self._lock:
                self._failing.append((sid, "the decode engine asked for another prompt's KV"))
            return
        with self._lock:
            send.bound = True
            parked, send.parked = send.parked, []
            send.admitted += len(parked)
        for command in parked:
            self.driver.admit(sid, command, lambda ok: self._on_admitted(sid, ok))

    def _on_admitted(self, sid: SessionId, ok: bool) -> None:
        if ok:
            return
        with self._lock:
            send = self._sends.get(sid)
            if send is not None:
                send.admitted -= 1
                send.stopped = True
        self._settle(sid)

    def _end(self, end: EndOp) -> None:
        sid = self._send_of.get(end.req_id)
        if sid is not None:
            with self._lock:
                send = self._sends[sid]
                send.stopped = True
                send.reason = send.reason or end.reason  # an unbound send reports why it ended
                send.parked.clear()
                bound = send.bound
            if bound:
                self._command(sid, Cancel(reason=end.reason))
            self._settle(sid)
            return
        for rsid, rec in list(self._recvs.items()):
            if rec.op.req_id == end.req_id and rec.opened:
                self._command(rsid, Cancel(reason=end.reason))

    def _drain(self, sids: list[SessionId]) -> None:
        """Wait until every slice of ``sids`` the transport may still read was released."""
        deadline = time.monotonic() + self.settings.slice_timeout_s
        while sids and time.monotonic() < deadline:
            with self._lock:
                busy = [s for s in sids if s in self._sends and not self._sends[s].drained]
            if not busy:
                return
            time.sleep(0.001)
        if sids:
            log.warning("kvplane PD: preempted sessions %s did not drain in time", sids)

    # -- decode side -----------------------------------------------------------------------------
    def _dial_loop(self) -> None:
        """Pair with prefill engines and open receives, off the model runner's thread."""
        while True:
            op = self._dials.get()
            if op is None:
                return
            try:
                self._dial(op)
            finally:
                with self._lock:
                    self._dialing -= 1
                self.wake.notify()

    def _dial(self, op: RecvOp) -> None:
        """(Dial thread) Tell the prefill ranks of a refused ``op``, or handshake with this
        rank's prefill endpoint and open the receive; a failure ends the receive."""
        if op.abandon:  # refused up front: every prefill rank must free its blocks now
            self.peers.abandon(op)
            return
        address = op.peer(self.rank)
        if address is None:  # the scheduler sends receives only at equal TP sizes
            return
        try:
            peer = self.peers.peer(address)
            refusal = self.endpoint.call(functools.partial(self._heads, peer, False))
            if refusal is not None:  # not our rank's shard (another rank, another TP size)
                raise refusal
            start = StartTransfer(
                request_id=RequestId(op.prompt),
                dst_block_ids=op.block_ids,
                prefix_tokens=op.prefix_tokens,
                num_tokens=op.num_tokens,
            )
            sid = rank_session(op.session_id, self.rank)
            with self._lock:
                self._recvs[sid] = _Recv(op, opened=True)
            self.endpoint.open_receiver(sid, peer, start)
        except (KVPlaneError, OSError) as exc:
            log.warning("kvplane PD: receive of %s failed: %s", op.req_id, exc)
            with self._lock:
                self._recvs.pop(rank_session(op.session_id, self.rank), None)
            self._recv_ended(op, False, f"cannot open the receive: {exc}")

    def _heads(self, peer: PeerId, sender: bool) -> UnsupportedError | None:
        """(PD loop thread) :func:`~.pd_ranks.heads_refusal` of an admitted ``peer``."""
        rec = self.participant.peers.get(peer)
        theirs = None if rec is None else rec.hello.profile.layouts[0]
        return None if theirs is None else heads_refusal(self.layout, theirs, sender=sender)

    def _recv_ended(self, op: RecvOp, ok: bool, reason: str) -> None:
        with self._lock:
            if not ok and len(self.layouts) > 1:  # vLLM cannot map one group's block ids
                self._failed_recvs.add(op.req_id)
            elif not ok:
                first = op.prefix_tokens // self.block_size
                self._load_errors.update(op.block_ids[first:])
            self._recv_done.add(op.req_id)
            self._results.append(PDResult(op.req_id, "recv", ok, reason, self.rank))
        self.wake.notify()

    # -- protocol actions (PD loop thread) -------------------------------------------------------
    def _on_action(self, act: Action) -> None:
        if isinstance(act, StartSubmit):
            self.driver.submit(act)
        elif isinstance(act, DestinationKnown):
            self.driver.expect(act)
            if (refusal := self._heads(act.peer_id, True)) is not None:
                with self._lock:
                    self._failing.append((act.session_id, str(refusal)))
                return
            with self._lock:
                send = self._sends.get(act.session_id)
                if send is None:
                    self._known[act.session_id] = act  # pipelined: the prefill is not here yet
            if send is not None:
                self._bind(send, act)
        elif isinstance(act, Release) and act.role is Role.SENDER:
            with self._lock:
                send = self._sends.get(act.session_id)
                if send is not None:
                    send.released += 1
            self._settle(act.session_id)
        elif isinstance(act, Finished) and act.role is Role.SENDER:
            self.driver.forget(act.session_id)
            with self._lock:
                self._known.pop(act.session_id, None)
                send = self._sends.get(act.session_id)
                if send is not None:
                    send.outcome, send.reason = act.state, act.reason
                    send.stopped = True
            self._settle(act.session_id)
        elif isinstance(act, Release) and act.role is Role.RECEIVER:
            with self._lock:
                rec = self._recvs.pop(act.session_id, None)
            if rec is not None:
                self._recv_ended(rec.op, act.state is SessionState.SUCCESS, act.state.value)

    def _settle(self, sid: SessionId) -> None:
        """Report a send done once nothing more will be admitted and everything admitted is
        released (the session ended, or it never bound and was stopped)."""
        with self._lock:
            send = self._sends.get(sid)
            if send is None or not send.stopped or not send.drained:
                return
            if send.bound and send.outcome is None:
                return  # a cancel is on its way: the session's end settles it
            del self._sends[sid]
            self._send_of.pop(send.op.req_id, None)
            ok = send.outcome is SessionState.SUCCESS
            self._sent_done.add(send.op.req_id)
            self._results.append(PDResult(send.op.req_id, "send", ok, send.reason, self.rank))
        self.wake.notify()

    def _command(self, sid: SessionId, command: Cancel | Fail) -> None:
        with contextlib.suppress(ProtocolError):  # already ended: its Finished settles it
            self.endpoint.send(sid, command)

    def _pump(self) -> None:
        """Deferred work: fail sessions whose request was refused, expire unclaimed sends."""
        with self._lock:
            failing, self._failing = self._failing, []
            now = time.monotonic()
            unbound = [sid for sid, s in self._sends.items() if not s.bound and not s.stopped]
            expired = [
                sid for sid in unbound
                if (at := self._sends[sid].last_at) is not None
                and now - at > self.settings.pull_timeout_s
            ]  # fmt: skip
            for sid in expired:
                self._sends[sid].stopped = True
                self._sends[sid].reason = "no decode engine asked for it in time"
        abandoned = [sid for sid in unbound if sid not in expired and self._abandoned(sid)]
        with self._lock:
            for sid in abandoned:
                if sid in self._sends:
                    self._sends[sid].stopped = True
                    self._sends[sid].reason = "the decode engine will not ask for it"
        expired += abandoned
        for sid, why in failing:
            self._command(sid, Fail(reason=why))
        for sid in expired:
            self._settle(sid)

    def _abandoned(self, sid: SessionId) -> bool:
        """The decode side ended the session before asking (its abort left a tombstone)."""
        return self.endpoint.call(lambda: self.participant.tombstone(sid)) is not None

    @property
    def busy(self) -> bool:
        """Sends or receives in flight, or receives still dialling their prefill engine: an
        idle step then waits for them (:func:`~.wakeup.end_step`) rather than spin vLLM's loop
        on the cores the handshake needs."""
        with self._lock:
            return bool(self._sends or self._recvs or self._dialing)

    def close(self) -> None:
        self._dials.put(None)
        self.driver.close()
        self.endpoint.close()
        self.transport.close()
