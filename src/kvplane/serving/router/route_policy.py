"""How the router picks a prefill worker: ``round-robin`` or ``cache-aware``.

Cache-aware (:func:`pick_cache_aware`) is pure, over plain data: each candidate's queue (tokens
the router's requests in flight on it compute) and its cached prefix per tier (the prefix
index's :class:`~kvplane.serving.router.prefix_index.PrefixMatch`); predicted TTFT = (uncached +
queued tokens) x per-token prefill cost + each loaded chunk's bytes / its tier's bandwidth. Of
the workers within ``affinity`` of the least, the longest usable cached prefix wins; ties go to
the worker the prompt's first chunk key picks by :func:`rendezvous` hashing. Chunk keys come
from :class:`ChunkKeyScheme`, the worker's own hasher and chunk spec (never re-implemented).
Costs: :class:`RouteCosts` (uncalibrated defaults). See docs/serving.md ("Cache-aware routing").
"""

from __future__ import annotations

import dataclasses
import hashlib
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
    ``unknown_tier_bytes_per_s``; ``affinity``: a worker with a longer usable cached prefix
    is preferred while its predicted TTFT is at most ``1 + affinity`` times the least (a
    worker busier than that is clearly busier: load wins)."""

    prefill_s_per_token: float = 1e-4
    bytes_per_token: float = 64 * 1024
    tier_bytes_per_s: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_TIER_BYTES_PER_S)
    )
    unknown_tier_bytes_per_s: float = 1e9
    affinity: float = 0.35

    def __post_init__(self) -> None:
        require_number("RouteCosts.affinity", self.affinity, min=0)
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


def loadable_chunks(match: PrefixMatch | None, prompt_tokens: int, tokens_per_chunk: int) -> int:
    """Leading cached chunks of ``match`` a worker loads for a ``prompt_tokens`` prompt: never
    the chunk holding the last token (it is computed, as the worker does)."""
    held = match.any_tier if match is not None else 0
    return max(0, min(held, (prompt_tokens - 1) // tokens_per_chunk))


def predicted_ttft(
    c: Candidate, prompt_tokens: int, tokens_per_chunk: int, costs: RouteCosts
) -> float:
    """Predicted seconds to the first token of a ``prompt_tokens`` prompt on ``c``: the worker
    loads its leading cached chunks (never the one holding the last token, as the worker does)
    and computes the rest, after the tokens queued ahead of it."""
    chunks = loadable_chunks(c.match, prompt_tokens, tokens_per_chunk)
    uncached = prompt_tokens - chunks * tokens_per_chunk
    load = load_seconds(c.match, chunks, tokens_per_chunk * costs.bytes_per_token, costs)
    return (uncached + c.queued_tokens) * costs.prefill_s_per_token + load


def rendezvous(key: ChunkKey, worker: str) -> int:
    """``worker``'s rendezvous weight for ``key`` (the highest weight wins): a stable hash of
    both, the same in every process, so each key picks one worker among any set holding it."""
    digest = hashlib.blake2b(bytes(key) + worker.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick_cache_aware(
    candidates: Sequence[Candidate],
    prompt_tokens: int,
    tokens_per_chunk: int,
    costs: RouteCosts,
    first_key: ChunkKey | None = None,
) -> int | None:
    """Index in ``candidates`` of the worker to pick among those up and paired, None when
    there is none: of those whose predicted TTFT (:func:`predicted_ttft`) is within
    ``costs.affinity`` of the least, the one with the longest usable cached prefix
    (:func:`loadable_chunks`); ties to the longest cached prefix, then the highest
    :func:`rendezvous` weight of ``first_key`` (the prompt's first chunk key: one prefix, one
    worker, whichever of them is a little busier now); without ``first_key``, ties to the
    least predicted TTFT, then the longest cached prefix, then the first."""
    require_int("prompt_tokens", prompt_tokens, min=1)
    require_int("tokens_per_chunk", tokens_per_chunk, min=1)
    live = [(i, c) for i, c in enumerate(candidates) if c.up and c.paired]
    if not live:
        return None
    ttft = {i: predicted_ttft(c, prompt_tokens, tokens_per_chunk, costs) for i, c in live}
    bound = min(ttft.values()) * (1 + costs.affinity)

    def rank(ic: tuple[int, Candidate]) -> tuple[int, float, int, int]:
        i, c = ic
        held = c.match.any_tier if c.match is not None else 0
        usable = loadable_chunks(c.match, prompt_tokens, tokens_per_chunk)
        if first_key is not None:
            return (-usable, 0.0, -held, -rendezvous(first_key, c.worker))
        return (-usable, ttft[i], -held, i)

    return min((ic for ic in live if ttft[ic[0]] <= bound), key=rank)[0]


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

    def keys(self, token_ids: Sequence[int]) -> list[ChunkKey]:
        """The chunk keys of ``token_ids`` (none without a scheme)."""
        return self.scheme.keys(token_ids) if self.scheme is not None else []

    def matches(
        self, index: PrefixIndex, token_ids: Sequence[int], *, now: float | None = None
    ) -> dict[str, PrefixMatch]:
        """Each worker's cached prefix of ``token_ids`` in ``index`` (by peer id); with
        ``now``, its pending holdings live then included (:meth:`PrefixIndex.longest_prefix`)."""
        keys = self.keys(token_ids)
        return index.longest_prefix(keys, now=now) if keys else {}

    def uncached_tokens(self, match: PrefixMatch | None, prompt_tokens: int) -> int:
        """Tokens of a ``prompt_tokens`` prompt a worker with cached prefix ``match`` computes
        (the rest it loads): what the request adds to that worker's queue."""
        tokens_per_chunk = self.scheme.spec.tokens_per_chunk if self.scheme is not None else 1
        return prompt_tokens - loadable_chunks(match, prompt_tokens, tokens_per_chunk) * (
            tokens_per_chunk
        )

    def pick(
        self,
        workers: Sequence[str],
        start: int,
        *,
        queued: Mapping[str, int],
        matches: Mapping[str, PrefixMatch],
        prompt_tokens: int,
        first_key: ChunkKey | None = None,
    ) -> int:
        """Index into ``workers`` (peer ids, all up and paired; at least one) of
        :func:`pick_cache_aware` over them taken from ``start`` (modulo), so exact ties rotate
        with the caller's turn when there is no ``first_key`` (the prompt's first chunk key);
        ``queued`` and ``matches`` by peer id (missing: none)."""
        tokens_per_chunk = self.scheme.spec.tokens_per_chunk if self.scheme is not None else 1
        n = len(workers)
        order = [(start + i) % n for i in range(n)]
        cands = [
            Candidate(w, queued_tokens=queued.get(w, 0), match=matches.get(w))
            for w in (workers[j] for j in order)
        ]
        got = pick_cache_aware(cands, prompt_tokens, tokens_per_chunk, self.costs, first_key)
        if got is None:
            raise InvalidArgumentError("a cache-aware pick needs at least one worker")
        return order[got]
