"""The requests the connector's scheduler side tracks, and what it reads of each.

Owns :class:`RequestView` and :class:`ScheduledRequest` (what vLLM tells the scheduler side
about a request and a step of it), :class:`RequestState` (one request's key chain, match,
offered chunks and gathers in flight) and :class:`RequestTable` (the states by request id).
Plain data: no tier, no tensors, no vLLM import. See ``docs/vllm.md`` ("The scheduler side").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvplane.blocks.hashing import BlockHasher, ExtraKey
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.keys import RequestKeys


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the scheduler side reads of a vLLM request.

    ``token_ids`` are the request's known tokens (prompt + output so far); ``eligible`` is
    False for requests whose tokens do not identify their KV (prompt embeddings, multimodal
    inputs): those are never matched nor stored. ``readable`` is False for requests that must
    compute every token themselves (vLLM's ``skip_reading_prefix_cache``, set for prompt
    logprobs): they are never matched (0 tokens), but their KV is still stored. Built from a
    vLLM request by :func:`~.views.request_view`.
    """

    req_id: str
    token_ids: Sequence[int]
    extra_keys: tuple[ExtraKey, ...] = ()
    eligible: bool = True
    readable: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a step: KV of tokens ``[0, computed_end)`` exists after the step, in
    ``block_ids`` (the request's whole block table, in order); the step writes the KV of
    tokens ``[computed_start, computed_end)`` (0: assume the whole table is written)."""

    view: RequestView
    computed_end: int
    block_ids: Sequence[int]
    computed_start: int = 0


@dataclass(frozen=True, slots=True)
class Match:
    """A request's last answered match: ``num_computed`` local tokens, a load of ``chunks``
    chunks, run asynchronously when ``load_async``; the load that follows keeps to it."""

    num_computed: int = 0
    chunks: int = 0
    load_async: bool = False


@dataclass(slots=True)
class RequestState:
    """One tracked request: its key chain, whether its tiers were looked up (admission counted)
    and its shared store asked, its last :class:`Match`, the chunks offered for storing so
    far, its gathers in flight (store job -> block table slots read) and whether it finished
    while some still ran."""

    keys: RequestKeys
    looked_up: bool = False
    discovered: bool = False
    match: Match = Match()
    offered: int = 0
    gathers: dict[int, tuple[int, ...]] = field(default_factory=dict)
    finished: bool = False


class RequestTable:
    """The scheduler side's :class:`RequestState` by request id, keyed by the handshake's
    hasher (:meth:`start`). Not thread-safe."""

    def __init__(self, spec: ChunkSpec) -> None:
        self.spec = spec
        self._hasher: BlockHasher | None = None
        self._reqs: dict[str, RequestState] = {}

    @property
    def started(self) -> bool:
        """True once :meth:`start` gave the key root."""
        return self._hasher is not None

    def start(self, hasher: BlockHasher) -> None:
        """Root every request's keys in ``hasher`` (the worker's handshake; once)."""
        if self._hasher is not None:
            raise InvalidArgumentError("the worker handshake was already applied")
        self._hasher = hasher

    def state(self, view: RequestView) -> RequestState:
        """The request's state, created (empty) on its first call."""
        req = self._reqs.get(view.req_id)
        if req is None:
            if self._hasher is None:  # pragma: no cover - callers check ready first
                raise InvalidArgumentError("no worker handshake yet")
            req = RequestState(RequestKeys(self._hasher, self.spec, view.extra_keys))
            self._reqs[view.req_id] = req
        return req

    def get(self, req_id: str) -> RequestState | None:
        """The request's state, or ``None`` when it is not tracked."""
        return self._reqs.get(req_id)

    def drop(self, req_id: str) -> None:
        """Stop tracking the request (no-op when it is not tracked)."""
        self._reqs.pop(req_id, None)

    def ids(self) -> list[str]:
        """The tracked requests' ids, sorted."""
        return sorted(self._reqs)

    def any_gathers(self) -> bool:
        """True when some tracked request has a gather in flight."""
        return any(r.gathers for r in self._reqs.values())
