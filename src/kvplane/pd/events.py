"""Every event of the PD control protocol: frozen, keyword-only msgspec structs.

Wire events (the tagged union :data:`WIRE_EVENTS`, validated on construction and on decode) and
local events (commands, transport evidence, ``Timeout``, ``PeerLost``). See docs/pd.md.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from kvplane.errors import InvalidArgumentError
from kvplane.ids import PeerId, RequestId, SessionId, SliceId, TokenRange
from kvplane.pd.handshake import PeerProfile
from kvplane.validators import is_int, require_id, require_int

MAX_BLOCKS_PER_REQUEST = 1 << 20
MAX_TEXT = 512

_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_U64 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Epoch = Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]
_Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
_Nonce = Annotated[bytes, msgspec.Meta(max_length=32)]


class Outcome(enum.Enum):
    """How an abandoned session ends: on request (ABORTED) or by a failure (FAILED)."""

    ABORTED = "aborted"
    FAILED = "failed"


class SliceStatus(enum.Enum):
    """The receiver's answer to one ``SliceReady``."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    COMMITTED = "committed"
    """All slices up to the final one arrived: the receiver committed SUCCESS."""


class TimerKind(enum.Enum):
    """The deadlines a session arms (``ArmTimer``) and receives back as ``Timeout``."""

    DEADLINE = "deadline"
    """The whole session's deadline: a non-terminal session fails. A sender's bounds its wait
    for the receiver's request; once the request arrives, ``VERDICT`` replaces it."""
    VERDICT = "verdict"
    """A sender's deadline once the receiver's request is known, counted from its arrival (so
    never before the receiver's own deadline plus the grace): a non-terminal sender fails."""
    RETRANSMIT = "retransmit"
    """Resend what the peer has not acknowledged yet."""
    DRAIN = "drain"
    """Stop waiting for in-flight work (sender) or for the abort ack (receiver): IN_DOUBT."""
    RELEASE = "release"
    """An IN_DOUBT ledger entry's fail-closed release deadline (one per unit, never extended)."""


def wire_text(text: str) -> str:
    """``text`` cut to what a wire event carries (a longer reason would make the frame invalid)."""
    return text[:MAX_TEXT]


def check_id(owner: str, name: str, value: str) -> None:
    """``require_id(f"{owner}.{name}", value)``: kept for ``serving/worker_config`` until it
    calls :func:`kvplane.validators.require_id` itself."""
    require_id(f"{owner}.{name}", value)


def _check_range(owner: str, start: int, end: int) -> None:
    require_int(f"{owner}.start", start, min=0)
    require_int(f"{owner}.end", end, min=0)
    if end < start:
        raise InvalidArgumentError(f"{owner} token range [{start}, {end}) has end < start")


# -- wire events ---------------------------------------------------------------------------------
class WireEvent(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Base of every event that crosses the link (one member of the tagged union)."""


class Hello(WireEvent, frozen=True, kw_only=True, tag="hello"):
    """Handshake: who I am, what KV I hold, how my transport is reached, my lease, and a fresh
    ``nonce`` (16 random bytes per handshake; empty only in in-memory simulations)."""

    peer_id: _Id
    incarnation: _U64
    profile: PeerProfile
    fingerprint: Annotated[bytes, msgspec.Meta(max_length=64)]
    transport: Annotated[str, msgspec.Meta(max_length=64)] = ""
    transport_metadata: Annotated[bytes, msgspec.Meta(max_length=1 << 16)] = b""
    lease_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] = 10_000
    nonce: _Nonce = b""


class HelloReply(WireEvent, frozen=True, kw_only=True, tag="hello_reply"):
    """The verdict on a ``Hello`` (``echo``: its nonce). It never carries our ``Hello``: an
    acceptance carries only the responder's fresh ``nonce`` (the frame's tag, made with the
    shared secret, is the proof); the responder's ``Hello`` follows in its ``HelloConfirm``,
    sealed on the association. A refusal carries no nonce, only ``reasons``."""

    accepted: bool
    echo: _Nonce = b""
    nonce: _Nonce = b""
    reasons: Annotated[tuple[_Text, ...], msgspec.Meta(max_length=64)] = ()
    peer_id: Annotated[str, msgspec.Meta(max_length=256)] = ""
    """Who refused (a refusal to a peer that proved the shared secret); else empty."""

    def __post_init__(self) -> None:
        if self.nonce and not self.accepted:
            raise InvalidArgumentError("a refusing HelloReply carries no nonce")


class HelloConfirm(WireEvent, frozen=True, kw_only=True, tag="hello_confirm"):
    """The two frames on the new association. Initiator → responder: ``echo`` is the
    responder's nonce, so the responder knows the handshake is live and not a replayed
    ``Hello``; no ``hello``. Responder → initiator (the acknowledgement): ``echo`` is the
    initiator's nonce and ``hello`` the responder's own ``Hello`` (its nonce the one of the
    reply), disclosed only now that the initiator proved it is live."""

    echo: _Nonce
    hello: Hello | None = None


class Heartbeat(WireEvent, frozen=True, kw_only=True, tag="heartbeat"):
    """Liveness: sent every heartbeat interval; answered with ``LeaseRenew``."""

    peer_id: _Id
    seq: _U64


class LeaseRenew(WireEvent, frozen=True, kw_only=True, tag="lease_renew"):
    """Answer to a heartbeat: the responder is alive and holds the sender's lease ``lease_ms``."""

    peer_id: _Id
    seq: _U64
    lease_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)]


class Probe(WireEvent, frozen=True, kw_only=True, tag="probe"):
    """Health probe; answered even before a handshake (still authenticated when a secret is set)."""

    nonce: _U64


class ProbeReply(WireEvent, frozen=True, kw_only=True, tag="probe_reply"):
    """Health: the endpoint's peer id and its frame/session counters."""

    nonce: _U64
    peer_id: _Id
    counters: Annotated[dict[str, int], msgspec.Meta(max_length=256)]


class SessionEvent(WireEvent, frozen=True, kw_only=True):
    """A wire event about one session incarnation."""

    session_id: _Id
    epoch: _Epoch

    @property
    def sid(self) -> SessionId:
        return SessionId(self.session_id)


class TransferRequest(SessionEvent, frozen=True, kw_only=True, tag="transfer_request"):
    """Receiver → sender: write the request's KV into these destination blocks.

    The receiver already holds ``[0, prefix_tokens)``; the transfer must cover
    ``[prefix_tokens, num_tokens)`` exactly.
    """

    request_id: _Id
    dst_block_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_BLOCKS_PER_REQUEST)]
    prefix_tokens: _U64
    num_tokens: _U64

    def __post_init__(self) -> None:
        _check_range("TransferRequest", self.prefix_tokens, self.num_tokens)
        if any(b < 0 for b in self.dst_block_ids):
            raise InvalidArgumentError("TransferRequest.dst_block_ids must be >= 0")


class SliceReady(SessionEvent, frozen=True, kw_only=True, tag="slice_ready"):
    """Sender → receiver: slice ``slice_id``'s bytes have landed (transport reported DONE)."""

    slice_id: _U64
    is_last: bool
    start: _U64
    end: _U64

    def __post_init__(self) -> None:
        _check_range("SliceReady", self.start, self.end)

    @property
    def token_range(self) -> TokenRange:
        return TokenRange(self.start, self.end)


class SliceResult(SessionEvent, frozen=True, kw_only=True, tag="slice_result"):
    """Receiver → sender: what the receiver made of one slice (see :class:`SliceStatus`)."""

    slice_id: _U64
    is_last: bool
    start: _U64
    end: _U64
    status: SliceStatus

    def __post_init__(self) -> None:
        _check_range("SliceResult", self.start, self.end)


class Abort(SessionEvent, frozen=True, kw_only=True, tag="abort"):
    """Either side: end this session with ``outcome``; idempotent, identified by ``token``.

    ``drained`` (meaningful from the sender): the sender has no transfer in flight and none in
    doubt, so the receiver may release its destination memory at once.
    """

    token: _U64
    outcome: Outcome
    reason: _Text = ""
    drained: bool = True


class AbortAck(SessionEvent, frozen=True, kw_only=True, tag="abort_ack"):
    """Answer to an ``Abort`` (echoes its token), carrying the responder's committed outcome.

    Sent by a sender only after it drained its in-flight work; ``drained`` is False when some of
    that work ended IN_DOUBT (the receiver then holds its memory until its release deadline).
    """

    token: _U64
    outcome: Outcome
    drained: bool = True


WIRE_EVENTS = (
    Hello,
    HelloReply,
    HelloConfirm,
    Heartbeat,
    LeaseRenew,
    Probe,
    ProbeReply,
    TransferRequest,
    SliceReady,
    SliceResult,
    Abort,
    AbortAck,
)
"""Members of the tagged union on the wire (the codec decodes exactly these)."""

AnyWireEvent = (
    Hello
    | HelloReply
    | HelloConfirm
    | Heartbeat
    | LeaseRenew
    | Probe
    | ProbeReply
    | TransferRequest
    | SliceReady
    | SliceResult
    | Abort
    | AbortAck
)


# -- local events --------------------------------------------------------------------------------
class LocalEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Base of events that never leave the process."""


class StartTransfer(LocalEvent, frozen=True, kw_only=True):
    """Receiver command: destination blocks are allocated; ask the sender to fill them."""

    request_id: RequestId
    dst_block_ids: tuple[int, ...]
    prefix_tokens: int
    num_tokens: int

    def __post_init__(self) -> None:
        _check_range("StartTransfer", self.prefix_tokens, self.num_tokens)
        require_id("StartTransfer.request_id", self.request_id)
        if len(self.dst_block_ids) > MAX_BLOCKS_PER_REQUEST:
            raise InvalidArgumentError(
                f"StartTransfer: {len(self.dst_block_ids)} destination blocks, "
                f"over {MAX_BLOCKS_PER_REQUEST}"
            )
        if any(not is_int(b) or b < 0 for b in self.dst_block_ids):
            raise InvalidArgumentError(
                f"StartTransfer.dst_block_ids must be ints >= 0, got {self.dst_block_ids!r}"
            )


class SubmitSlice(LocalEvent, frozen=True, kw_only=True):
    """Sender command: prefill produced slice ``slice_id`` covering ``[start, end)``."""

    slice_id: SliceId
    is_last: bool
    start: int
    end: int

    def __post_init__(self) -> None:
        require_int("SubmitSlice.slice_id", self.slice_id, min=0)
        _check_range("SubmitSlice", self.start, self.end)


class Cancel(LocalEvent, frozen=True, kw_only=True):
    """Either side's application abandons the session (outcome ABORTED)."""

    reason: str = "cancelled"


class Fail(LocalEvent, frozen=True, kw_only=True):
    """Either side's application reports a local failure (outcome FAILED)."""

    reason: str


class SliceFact(LocalEvent, frozen=True, kw_only=True):
    """A fact about one sender-side slice from the transport driver."""

    slice_id: SliceId

    def __post_init__(self) -> None:
        require_int(f"{type(self).__name__}.slice_id", self.slice_id, min=0)


class SubmitStarted(SliceFact, frozen=True, kw_only=True):
    """The driver is about to call ``transport.submit`` for this slice."""


class SubmitAccepted(SliceFact, frozen=True, kw_only=True):
    """``transport.submit`` returned a handle: the backend now reads the slice's memory."""


class SubmitSkipped(SliceFact, frozen=True, kw_only=True):
    """The slice needs no bytes moved (e.g. all of it is in the receiver's prefix)."""


class TransportDone(SliceFact, frozen=True, kw_only=True):
    """Evidence: the backend finished the slice; its bytes landed."""


class TransportFailed(SliceFact, frozen=True, kw_only=True):
    """Evidence: the backend stopped touching the memory without delivering the slice."""

    reason: str = ""


class TransportInDoubt(SliceFact, frozen=True, kw_only=True):
    """Evidence is missing: the backend may still touch the memory (submit raised, peer gone)."""

    reason: str = ""


class Timeout(LocalEvent, frozen=True, kw_only=True):
    """A timer the session armed has expired (delivered by whoever owns the clock)."""

    timer: TimerKind
    unit: int = 0


class PeerLost(LocalEvent, frozen=True, kw_only=True):
    """The lease keeper declared the session's peer dead."""

    peer_id: PeerId
    reason: str = "lease expired"
