"""The connector's PD decisions on vLLM's scheduler side: what to send, receive, hold and return.

Owns :class:`PDScheduler`: per-request PD state of a prefill engine (which steps' KV to send,
which finished requests keep their blocks until sent) and of a decode engine (how many prompt
tokens arrive asynchronously, into which blocks), plus the ``kv_transfer_params`` a finished
prefill returns. At TP > 1 it decides once for every rank and joins the ranks' session results
(:class:`~.pd_ranks.RankResults`). Plain data in, :class:`~.messages.SendOp` /
:class:`~.messages.RecvOp` / :class:`~.messages.EndOp` out: no tensors, no sockets, no vLLM
import. See docs/vllm.md ("PD").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvplane.errors import UnsupportedError
from kvplane.integrations.vllm.messages import EndOp, PDResult, RecvOp, SendOp, StepMeta
from kvplane.integrations.vllm.pd_groups import destination_ids
from kvplane.integrations.vllm.pd_params import (
    RecvParams,
    SendParams,
    decode_params,
    prompt_key,
    transferred_tokens,
)
from kvplane.integrations.vllm.pd_ranks import RankResults, tp_refusal
from kvplane.integrations.vllm.windows import KVWindow, first_kept_block
from kvplane.metrics import MetricsRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PDRequest:
    """What the PD decisions read of a vLLM request: its id, prompt and parsed params."""

    req_id: str
    prompt: Sequence[int]
    params: SendParams | RecvParams


@dataclass(slots=True)
class _Send:
    session_id: str
    prompt: str
    num_tokens: int
    last_sent: bool = False
    ops: int = 0
    done: bool = False  # the worker reported the session over while vLLM still ran it
    preempted: bool = False  # ended by a preemption: the request's next run sends afresh


@dataclass(slots=True)
class _Recv:
    params: RecvParams
    num_computed: int
    tokens: int
    opened: bool = False
    finished: bool = False


@dataclass(slots=True)
class PDStep:
    """One step's PD part of the worker's instructions."""

    sends: list[SendOp] = field(default_factory=list)
    recvs: list[RecvOp] = field(default_factory=list)
    ends: list[EndOp] = field(default_factory=list)
    delayed: list[str] = field(default_factory=list)

    def into(self, step: StepMeta) -> StepMeta:
        """``step`` with this PD part as its ``sends``, ``recvs``, ``ends`` and ``pd_delayed``."""
        return dataclasses.replace(
            step,
            sends=tuple(self.sends),
            recvs=tuple(self.recvs),
            ends=tuple(self.ends),
            pd_delayed=tuple(self.delayed),
        )


class PDScheduler:
    """See the module docstring. ``block_size`` is vLLM's; metrics go to ``metrics``;
    ``tp_size``: the engine's tensor-parallel size (one worker, and PD session, per rank);
    ``window``: vLLM's sliding window (:class:`~.windows.KVWindow`): a receive covers only the
    blocks vLLM holds after it, the ones in the window of the first token it computes;
    ``groups``: vLLM's KV cache groups (hybrid manager): one session moves every group's blocks
    (:mod:`.pd_groups`; a window group's window comes from its pool's layout, not ``window``)."""

    def __init__(
        self,
        block_size: int,
        metrics: MetricsRegistry,
        *,
        check_prompt: bool = True,
        tp_size: int = 1,
        window: KVWindow | None = None,
        groups: int = 1,
    ) -> None:
        self.block_size = block_size
        self.window = window
        self.groups = groups
        self.check_prompt = check_prompt
        self.tp_size = tp_size
        self.addresses: tuple[str, ...] = ()
        self.engine_id = ""
        self._ranks = RankResults(tp_size)
        self._sends: dict[str, _Send] = {}
        self._held: set[str] = set()  # finished, blocks kept until the worker reports the send
        self._recvs: dict[str, _Recv] = {}
        self._ended: set[str] = set()  # receives that ended, until vLLM finishes the request
        self._pending = PDStep()
        self._requests = metrics.counter(
            "vllm_pd_requests", "PD requests by role and outcome", ["role", "outcome"]
        )
        self._tokens = metrics.counter("vllm_pd_tokens", "prompt tokens moved by PD", ["role"])

    def set_endpoint(self, addresses: Sequence[str], engine_id: str) -> None:
        """The workers' PD endpoints, one per rank in rank order (from their start-up
        handshakes): what finished prefills name."""
        self.addresses, self.engine_id = tuple(addresses), engine_id

    # -- decode side -----------------------------------------------------------------------------
    def matched(self, req: PDRequest, num_computed: int) -> tuple[int, bool]:
        """Prompt tokens beyond ``num_computed`` that arrive asynchronously from the prefill
        engine, and whether any do. A request whose prompt is not the one the prefill engine
        computed (key or length differ) gets 0: it is computed here; so does one from a prefill
        engine of another TP size (:func:`~.pd_ranks.tp_refusal`, logged)."""
        p = req.params
        if not isinstance(p, RecvParams) or req.req_id in self._recvs or req.req_id in self._ended:
            return 0, False  # asked once: after the receive (or its failure) vLLM computes
        n = len(req.prompt)
        refusal = tp_refusal(p.prefill_tp, self.tp_size)
        if refusal is not None:
            log.warning("kvplane PD: request %s computed here: %s", req.req_id, refusal)
            return self._refuse(req, p, "tp_mismatch", str(refusal))
        if (p.num_prompt_tokens is not None and p.num_prompt_tokens != n) or (
            self.check_prompt and p.prompt is not None and p.prompt != prompt_key(req.prompt)
        ):
            why = "the decode request's prompt differs from the prefill's"
            return self._refuse(req, p, "prompt_mismatch", why)
        end = n - 1 if self.groups == 1 else self._moved(n)  # the last is recomputed
        left = end - num_computed  # vLLM is told of prompt tokens
        if left <= 0:
            return 0, False
        self._recvs[req.req_id] = _Recv(p, num_computed, left)
        return left, True

    def _refuse(self, req: PDRequest, p: RecvParams, outcome: str, why: str) -> tuple[int, bool]:
        """Compute ``req`` here and tell the prefill engine (once) it will never be asked."""
        self._requests.labels(role="recv", outcome=outcome).inc()
        self._ended.add(req.req_id)
        key = prompt_key(req.prompt)
        self._pending.recvs.append(
            RecvOp(req.req_id, p.session_id, p.address, key, 0, 0, (), why, p.rank_addresses)
        )
        return 0, False

    def _moved(self, num_prompt_tokens: int) -> int:
        return transferred_tokens(num_prompt_tokens, self.block_size, self.groups)

    def allocated(
        self,
        req: PDRequest,
        block_ids: Sequence[int],
        num_external: int,
        group_block_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """vLLM allocated the request's blocks (``group_block_ids``: groups 1..'s): receive
        into them (next step)."""
        rec = self._recvs.get(req.req_id)
        if rec is None or rec.opened or num_external == 0:
            return
        num = self._moved(len(req.prompt))
        need = num // self.block_size
        if len(block_ids) < need:  # pragma: no cover - vLLM allocates num_computed + external
            raise UnsupportedError(f"request {req.req_id!r}: {len(block_ids)} blocks for {num}")
        dst = tuple(int(b) for b in block_ids[:need])
        if self.groups > 1:
            dst = destination_ids((block_ids, *group_block_ids), need)
        rec.opened = True
        kept = first_kept_block(self.window, rec.num_computed + rec.tokens) * self.block_size
        self._pending.recvs.append(
            RecvOp(
                req.req_id,
                rec.params.session_id,
                rec.params.address,
                prompt_key(req.prompt),
                num,
                min(max(rec.num_computed, kept), num),  # the prefill sends from here on
                dst,
                rank_addresses=rec.params.rank_addresses,
            )
        )

    # -- prefill side ----------------------------------------------------------------------------
    def scheduled(
        self,
        req: PDRequest,
        computed_end: int,
        block_ids: Sequence[int],
        group_block_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """A step computes the request's KV up to ``computed_end`` (in ``block_ids``, and
        ``group_block_ids``: groups 1..): send what exists after it."""
        if not isinstance(req.params, SendParams):
            return
        send = self._sends.get(req.req_id)
        if send is None:
            num = self._moved(len(req.prompt))
            if num == 0:
                return
            sid = req.params.session_id or req.req_id
            send = self._sends[req.req_id] = _Send(sid, prompt_key(req.prompt), num)
        if send.last_sent:
            return
        last = computed_end >= len(req.prompt)
        send.last_sent = last
        send.ops += 1
        self._pending.sends.append(
            SendOp(
                req.req_id,
                send.session_id,
                send.prompt,
                send.num_tokens,
                send.num_tokens if last else min(computed_end, send.num_tokens),
                tuple(int(b) for b in block_ids),
                last,
                tuple(tuple(int(b) for b in ids) for ids in group_block_ids),
            )
        )

    def preempted(self, req_ids: Sequence[str]) -> None:
        """Preempted requests lose their blocks this step: their sends stop (the worker drains
        them before the forward) and the decode side computes what it lacks."""
        for rid in req_ids:
            send = self._sends.get(rid)
            if send is not None and not send.last_sent:
                send.last_sent = send.preempted = True
                self._pending.ends.append(EndOp(rid, "preempted on the prefill engine"))

    # -- both ------------------------------------------------------------------------------------
    def finished(self, req: PDRequest | None, req_id: str) -> tuple[bool, dict[str, object] | None]:
        """vLLM finished ``req_id``: (keep its blocks until the worker reports it, params).

        A prefill whose slices went out keeps its blocks until its session released them and
        returns the decode request's ``kv_transfer_params``; one stopped early ends its session.
        A decode request still receiving ends its session (vLLM itself keeps its blocks until
        the worker reports the receive finished)."""
        self._ended.discard(req_id)
        rec = self._recvs.get(req_id)
        if rec is not None and rec.opened:
            rec.finished = True
            self._pending.ends.append(EndOp(req_id, "request finished in vLLM while receiving"))
        send = self._sends.get(req_id)
        if send is None:
            if rec is not None and not rec.opened:
                del self._recvs[req_id]
            return False, None
        self._pending.delayed.append(req_id)  # the worker reports it once, even if done
        if send.done:
            del self._sends[req_id]
        else:
            self._held.add(req_id)
        if not send.last_sent:
            send.last_sent = True
            self._pending.ends.append(EndOp(req_id, "prefill request ended before its prompt"))
            return True, None
        if not self.addresses or req is None:  # pragma: no cover - set at start-up
            raise UnsupportedError("the PD endpoint's address is unknown: no worker handshake")
        return True, decode_params(send.session_id, self.addresses, req.prompt, self.engine_id)

    def build(self) -> PDStep:
        """This step's PD instructions (and a fresh, empty set for the next)."""
        out, self._pending = self._pending, PDStep()
        return out

    def apply(self, results: Sequence[PDResult]) -> None:
        """The worker's finished sessions (memory released): forget them, count them. At TP > 1
        a request's transfer ends once every rank's session did (ok only if all were); the
        first rank that fails ends the other ranks' sessions of the request."""
        for part in results:
            r, first_failure = self._ranks.add(part)
            if first_failure:
                self._end_ranks(part)
            if r is None:
                continue
            self._requests.labels(role=r.role, outcome="ok" if r.ok else "failed").inc()
            if r.role == "send":
                send = self._sends.get(r.req_id)
                if r.req_id in self._held or (send is not None and send.preempted):
                    self._sends.pop(r.req_id, None)
                    self._held.discard(r.req_id)
                elif send is not None:  # vLLM still runs it (more than one token)
                    send.done = True
            else:
                rec = self._recvs.pop(r.req_id, None)
                if rec is not None and not rec.finished:
                    self._ended.add(r.req_id)
                if rec is not None and r.ok:
                    self._tokens.labels(role="recv").inc(rec.tokens)

    def _end_ranks(self, failed: PDResult) -> None:
        """Rank ``failed.rank``'s session failed: end the request's sessions on every rank (a
        rank ignores the end of a session it no longer has)."""
        send = self._sends.get(failed.req_id) if failed.role == "send" else None
        if send is not None:
            send.last_sent = True  # no more slices of it
        why = f"rank {failed.rank}'s {failed.role} failed: {failed.reason}"
        self._pending.ends.append(EndOp(failed.req_id, why[:200]))

    @property
    def pending_push_work(self) -> bool:
        """True while a finished prefill's blocks wait for its session (vLLM keeps stepping)."""
        return bool(self._held)

    def check_integrity(self) -> None:
        """Nothing held, sent or received any more, no transfer only some ranks reported."""
        opened = any(r.opened for r in self._recvs.values())
        if self._held or self._sends or opened or self._ranks.waiting:
            raise UnsupportedError(
                f"PD state left: held {sorted(self._held)}, sends {sorted(self._sends)}, "
                f"recvs {sorted(self._recvs)}, {self._ranks.waiting} partly reported"
            )
