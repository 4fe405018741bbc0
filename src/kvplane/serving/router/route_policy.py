"""How the router picks a prefill worker: ``round-robin`` or ``cache-aware``.

Cache-aware (:func:`pick_cache_aware`) is pure, over plain data: each candidate's queue (prompt
tokens the router has in flight on it) and its cached prefix per tier (the prefix index's
:class:`~kvplane.serving.router.prefix_index.PrefixMatch`); predicted TTFT = uncached tokens x
per-token prefill cost + each loaded chunk's bytes / its tier's bandwidth + queued tokens x
per-token prefill cost. The request's chunk keys come from :class:`ChunkKeyScheme`, the worker's
own hasher and chunk spec (never re-implemented). Costs: :class:`RouteCosts` (defaults, not yet
calibrated). See docs/serving.md ("Cache-aware routing").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.serving.messages import WorkerInfo
from kvplane.serving.router.prefix_index import PrefixIndex, PrefixMatch
from kvplane.validators import require_int, require_number


class RoutePolicy(StrEnum):
    """The router's prefill pick: ``round-robin`` (the default) or ``cache-aware``."""

    ROUND_ROBIN = "round-robin"
    CACHE_AWARE = "cache-aware"

    @classmethod
    def parse(cls, text: object) -> RoutePolicy:
        """The policy named ``text``; ``InvalidArgumentError`` naming the choices otherwise."""
        for policy in cls:
            if text == policy.value:
                return policy
        choices = ", ".join(p.value for p in cls)
        raise InvalidArgumentError(f"route policy must be one of {choices}, got {text!r}")


DEFAULT_TIER_BYTES_PER_S: Mapping[str, float] = {
    "device": 1e12, "host": 20e9, "disk": 2e9, "redis": 1e9,
}  # fmt: skip
"""Default read bandwidth of each tier, bytes/s (pinned host copy, NVMe, a LAN Redis)."""


@dataclass(frozen=True, slots=True)
class RouteCosts:
    """The cost model of cache-aware routing (defaults uncalibrated, documented guesses).

    ``prefill_s_per_token``: seconds to compute one prompt token (also the cost of each token
    queued ahead); ``bytes_per_token``: KV bytes of one token (a chunk's bytes are its tokens
    times this); ``tier_bytes_per_s``: read bandwidth per tier; a tier not named reads at
    ``unknown_tier_bytes_per_s``."""

    prefill_s_per_token: float = 1e-4
    bytes_per_token: float = 64 * 1024
    tier_bytes_per_s: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_TIER_BYTES_PER_S)
    )
    unknown_tier_bytes_per_s: float = 1e9

    def __post_init__(self) -> None:
        require_number("RouteCosts.prefill_s_per_token", self.prefill_s_per_token, above=0)
        require_number("RouteCosts.bytes_per_token", self.bytes_per_token, above=0)
        require_number(
            "RouteCosts.unknown_tier_bytes_per_s", self.unknown_tier_bytes_per_s, above=0
        )
        for tier, bw in self.tier_bytes_per_s.items():
            require_number(f"RouteCosts.tier_bytes_per_s[{tier!r}]", bw, above=0)

    def bandwidth(self, tier: str) -> float:
        return float(self.tier_bytes_per_s.get(tier, self.unknown_tier_bytes_per_s))


@dataclass(frozen=True, slots=True)
class ChunkKeyScheme:
    """A prefill worker's chunk keys of a prompt: its one block hasher (seed and model/layout
    fingerprint at the root) and its offload chunk spec, the functions the worker itself uses
    (:meth:`BlockHasher.hash_blocks`, :meth:`ChunkSpec.chunk_keys`)."""

    hasher: BlockHasher
    spec: ChunkSpec

    def keys(self, token_ids: Sequence[int]) -> list[ChunkKey]:
        """Keys of the full chunks of ``token_ids``, in order (what the worker stores)."""
        if len(token_ids) < self.spec.tokens_per_chunk:
            return []
        return self.spec.chunk_keys(self.hasher.hash_blocks(token_ids, self.spec.block_size))


@dataclass(frozen=True, slots=True)
class Candidate:
    """One prefill worker as cache-aware routing sees it: ``up`` and ``paired`` (with the
    request's decode worker), ``queued_tokens`` (prompt tokens in flight on it) and its
    ``match`` (None: no cached prefix)."""

    worker: str
    up: bool = True
    paired: bool = True
    queued_tokens: int = 0
    match: PrefixMatch | None = None

    def __post_init__(self) -> None:
        require_int("Candidate.queued_tokens", self.queued_tokens, min=0)


def load_seconds(
    match: PrefixMatch | None, chunks: int, chunk_bytes: float, costs: RouteCosts
) -> float:
    """Seconds to read the first ``chunks`` chunks of ``match``: each from the fastest tier whose
    leading run covers it, the rest (held chunk by chunk across tiers) at the slowest bandwidth
    among the tiers (or the unknown tier's)."""
    if match is None or chunks <= 0:
        return 0.0
    tiers = sorted(match.by_tier.items(), key=lambda kv: (-costs.bandwidth(kv[0]), kv[0]))
    covered, seconds = 0, 0.0
    for tier, held in tiers:
        run = min(held, chunks)
        if run > covered:
            seconds += (run - covered) * chunk_bytes / costs.bandwidth(tier)
            covered = run
    if covered < chunks:
        slowest = min((costs.bandwidth(t) for t in match.by_tier), default=None)
        bw = slowest if slowest is not None else costs.unknown_tier_bytes_per_s
        seconds += (chunks - covered) * chunk_bytes / bw
    return seconds


def predicted_ttft(
    c: Candidate, prompt_tokens: int, tokens_per_chunk: int, costs: RouteCosts
) -> float:
    """Predicted seconds to the first token of a ``prompt_tokens`` prompt on ``c``: the worker
    loads its leading cached chunks (never the one holding the last token, as the worker does)
    and computes the rest, after the tokens queued ahead of it."""
    held = c.match.any_tier if c.match is not None else 0
    chunks = max(0, min(held, (prompt_tokens - 1) // tokens_per_chunk))
    uncached = prompt_tokens - chunks * tokens_per_chunk
    load = load_seconds(c.match, chunks, tokens_per_chunk * costs.bytes_per_token, costs)
    return (uncached + c.queued_tokens) * costs.prefill_s_per_token + load


def pick_cache_aware(
    candidates: Sequence[Candidate], prompt_tokens: int, tokens_per_chunk: int, costs: RouteCosts
) -> int | None:
    """Index in ``candidates`` of the worker up and paired with the least predicted TTFT
    (:func:`predicted_ttft`); ties to the longest cached prefix, then the fewest queued tokens,
    then the first. None when no candidate is up and paired."""
    require_int("prompt_tokens", prompt_tokens, min=1)
    require_int("tokens_per_chunk", tokens_per_chunk, min=1)
    best: tuple[float, int, int, int] | None = None
    for i, c in enumerate(candidates):
        if not (c.up and c.paired):
            continue
        held = c.match.any_tier if c.match is not None else 0
        rank = (
            predicted_ttft(c, prompt_tokens, tokens_per_chunk, costs),
            -held,
            c.queued_tokens,
            i,
        )
        if best is None or rank < best:
            best = rank
    return None if best is None else best[3]


@dataclass(frozen=True, slots=True)
class CacheRouting:
    """The router's cache-aware inputs: its key ``scheme`` (None: no chunk is ever found
    cached, so it picks by queued tokens only) and its ``costs``."""

    scheme: ChunkKeyScheme | None = None
    costs: RouteCosts = field(default_factory=RouteCosts)

    def adopt(self, infos: Iterable[WorkerInfo | None]) -> CacheRouting:
        """This routing with the key scheme the first prefill worker with offload tiers
        advertises when it has none yet (itself otherwise): workers of one model and hash seed
        key chunks alike; one that keys differently is never found cached, never misrouted."""
        if self.scheme is not None:
            return self
        for info in infos:
            if info is not None and info.role == "prefill" and info.blocks_per_chunk > 0:
                hasher = BlockHasher(seed=info.hash_seed, fingerprint=info.hash_fingerprint)
                spec = ChunkSpec(info.block_size, info.blocks_per_chunk)
                return dataclasses.replace(self, scheme=ChunkKeyScheme(hasher, spec))
        return self

    def matches(self, index: PrefixIndex, token_ids: Sequence[int]) -> dict[str, PrefixMatch]:
        """Each worker's cached prefix of ``token_ids`` in ``index`` (by peer id)."""
        keys = self.scheme.keys(token_ids) if self.scheme is not None else []
        return index.longest_prefix(keys) if keys else {}

    def pick(
        self,
        workers: Sequence[str],
        start: int,
        *,
        queued: Mapping[str, int],
        matches: Mapping[str, PrefixMatch],
        prompt_tokens: int,
    ) -> int:
        """Index into ``workers`` (peer ids, all up and paired; at least one) of
        :func:`pick_cache_aware` over them taken from ``start`` (modulo), so exact ties rotate
        with the caller's turn; ``queued`` and ``matches`` by peer id (missing: none)."""
        tokens_per_chunk = self.scheme.spec.tokens_per_chunk if self.scheme is not None else 1
        n = len(workers)
        order = [(start + i) % n for i in range(n)]
        cands = [
            Candidate(w, queued_tokens=queued.get(w, 0), match=matches.get(w))
            for w in (workers[j] for j in order)
        ]
        got = pick_cache_aware(cands, prompt_tokens, tokens_per_chunk, self.costs)
        if got is None:
            raise InvalidArgumentError("a cache-aware pick needs at least one worker")
        return order[got]
